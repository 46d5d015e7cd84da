"""Attention spellings shared by the matcher, golden and kernel-integration tests.

Each entry: name -> (function, argument builder).  Every function computes
attention the way some real code writes it; the tests check it is rewritten
and that outputs and gradients equal the original's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass.compat import JAX_VERSION

B, T, S, H, D = 2, 16, 16, 3, 8


def _normal(rng, shape, dtype=np.float32):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def btnh(rng, t=T, s=S, dtype=np.float32):
    return (
        _normal(rng, (B, t, H, D), dtype),
        _normal(rng, (B, s, H, D), dtype),
        _normal(rng, (B, s, H, D), dtype),
    )


def bnth(rng, t=T, s=S, dtype=np.float32):
    return (
        _normal(rng, (B, H, t, D), dtype),
        _normal(rng, (B, H, s, D), dtype),
        _normal(rng, (B, H, s, D), dtype),
    )


# ---------------------------------------------------------------- positive spellings


def einsum_btnh(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def matmul_bnth(q, k, v):
    s = (q @ jnp.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    return jax.nn.softmax(s) @ v


def matmul_transpose_rsqrt(q, k, v):
    s = jnp.matmul(q, jnp.transpose(k, (0, 1, 3, 2))) * lax.rsqrt(jnp.float32(q.shape[-1]))
    return jnp.matmul(jax.nn.softmax(s, axis=-1), v)


def dot_general_swapped(q, k, v):
    # scores laid out [B, H, S, T] (key operand first); softmax over the key axis -2
    s = lax.dot_general(k, q, (((3,), (3,)), ((0, 1), (0, 1))))
    p = jax.nn.softmax(s * 0.5, axis=-2)
    return lax.dot_general(p, v, (((2,), (2,)), ((0, 1), (0, 1))))  # [B, H, T, D]


def handwritten_softmax(q, k, v):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = e / jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("bhts,bhsd->bhtd", p, v)


def unstabilised_softmax(q, k, v):
    e = jnp.exp(jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25)
    return jnp.einsum("bhts,bhsd->bhtd", e / e.sum(-1, keepdims=True), v)


def reciprocal_softmax(q, k, v):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k)
    e = jnp.exp(s - lax.stop_gradient(s.max(-1, keepdims=True)))
    p = e * (1.0 / e.sum(-1, keepdims=True))
    return jnp.einsum("bhts,bhsd->bhtd", p, v)


def causal_tril_where(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), dtype=bool))
    s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def causal_iota_finfo_min(q, k, v):
    t, s_len = q.shape[2], k.shape[2]
    qi = lax.broadcasted_iota(jnp.int32, (t, s_len), 0)
    ki = lax.broadcasted_iota(jnp.int32, (t, s_len), 1)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    s = jnp.where(ki <= qi, s, jnp.finfo(s.dtype).min)
    return jax.nn.softmax(s, -1) @ v


def causal_additive(q, k, v):
    t = q.shape[2]
    bias = jnp.triu(jnp.full((t, t), -1e9, jnp.float32), k=1)
    s = q @ k.swapaxes(-1, -2) * 0.3 + bias
    return jax.nn.softmax(s, -1) @ v


def causal_bottom_right(q, k, v):
    # decode-style: T < S, query i sits at position i + (S - T)
    t, s_len = q.shape[2], k.shape[2]
    mask = jnp.tril(jnp.ones((t, s_len), dtype=bool), k=s_len - t)
    s = jnp.where(mask, q @ k.swapaxes(-1, -2), -1e30)
    return jax.nn.softmax(s, -1) @ v


def padding_mask(q, k, v, mask):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(mask[:, None, None, :], s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def mask_and_causal(q, k, v, mask):
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    full = jnp.logical_and(causal[None, None], mask[:, None, None, :])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    s = jnp.where(full, s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def bias_input(q, k, v, bias):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.35 + bias
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def flax_style_prescaled(q, k, v, bias):
    # flax.linen.dot_product_attention_weights: q scaled first, bias, then where
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    s = jnp.einsum("...qhd,...khd->...hqk", q, k)
    s = s + bias
    big_neg = jnp.finfo(s.dtype).min
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    s = jnp.where(causal, s, big_neg)
    w = jax.nn.softmax(s).astype(q.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", w, v)


def mixed_precision(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@jax.jit
def _softmax_helper(x):
    return jax.nn.softmax(x, axis=-1)


def nested_jit(q, k, v):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.2
    return jnp.einsum("bhts,bhsd->bhtd", _softmax_helper(s), v)


def single_head(q, k, v):
    # per-head code, as Equinox writes it before vmap: [T, D]
    def head(qh, kh, vh):
        return jax.nn.softmax(qh @ kh.T / math.sqrt(qh.shape[-1]), axis=-1) @ vh

    return head(q[0, 0], k[0, 0], v[0, 0])


def flattened_batch(q, k, v):
    bh = q.shape[0] * q.shape[1]
    qf, kf, vf = (x.reshape(bh, x.shape[2], x.shape[3]) for x in (q, k, v))
    s = jnp.einsum("ntd,nsd->nts", qf, kf) * 0.3
    return jnp.einsum("nts,nsd->ntd", jax.nn.softmax(s, -1), vf)


def scan_layers(q, k, v):
    def layer(x, _):
        s = jnp.einsum("bhtd,bhsd->bhts", x, k) * 0.3
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v), None

    out, _ = lax.scan(layer, q, None, length=2)
    return out


def remat_attention(q, k, v):
    @jax.checkpoint
    def attn(q, k, v):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)

    return attn(q, k, v) * 2.0


def softcapped(q, k, v):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3
    s = 5.0 * jnp.tanh(s / 5.0)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


def deferred_normalisation(q, k, v):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3
    e = jnp.exp(s - lax.stop_gradient(s.max(-1, keepdims=True)))
    return jnp.einsum("bhts,bhsd->bhtd", e, v) / e.sum(-1)[..., None]


def exp_log_softmax(q, k, v):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3
    return jnp.einsum("bhts,bhsd->bhtd", jnp.exp(jax.nn.log_softmax(s, -1)), v)


def traced_scale(q, k, v, temperature):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) / temperature
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


def head_mask(q, k, v, mask):
    # Hugging Face `layer_head_mask`: probabilities scaled per head
    p = jax.nn.softmax(jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3, -1)
    p = p * mask[None, :, None, None]
    return jnp.einsum("bhts,bhsd->bhtd", p, v)


def gqa_dot_product_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _mask_args(rng, layout=btnh):
    q, k, v = layout(rng)
    lengths = np.array([S, S // 2])
    mask = jnp.asarray(np.arange(S)[None, :] < lengths[:, None])
    return q, k, v, mask


def _bias_args(rng):
    q, k, v = bnth(rng)
    return q, k, v, _normal(rng, (1, H, T, S))


def _flax_bias_args(rng):
    q, k, v = btnh(rng)
    return q, k, v, _normal(rng, (1, H, T, S))


def _gqa_args(rng):
    return (_normal(rng, (B, T, 4, D)), _normal(rng, (B, S, 2, D)), _normal(rng, (B, S, 2, D)))


POSITIVE = {
    "deferred_normalisation": (deferred_normalisation, bnth),
    "exp_log_softmax": (exp_log_softmax, bnth),
    "traced_scale": (traced_scale, lambda r: (*bnth(r), jnp.float32(2.5))),
    "head_mask": (head_mask, lambda r: (*bnth(r), _normal(r, (H,)))),
    "gqa_dot_product_attention": (gqa_dot_product_attention, _gqa_args),
    "einsum_btnh": (einsum_btnh, btnh),
    "matmul_bnth": (matmul_bnth, bnth),
    "matmul_transpose_rsqrt": (matmul_transpose_rsqrt, bnth),
    "dot_general_swapped": (dot_general_swapped, bnth),
    "handwritten_softmax": (handwritten_softmax, bnth),
    "unstabilised_softmax": (unstabilised_softmax, bnth),
    "reciprocal_softmax": (reciprocal_softmax, bnth),
    "causal_tril_where": (causal_tril_where, btnh),
    "causal_iota_finfo_min": (causal_iota_finfo_min, bnth),
    "causal_additive": (causal_additive, bnth),
    "causal_bottom_right": (causal_bottom_right, lambda r: bnth(r, t=8, s=S)),
    "cross_attention": (matmul_bnth, lambda r: bnth(r, t=5, s=24)),
    "padding_mask": (padding_mask, _mask_args),
    "mask_and_causal": (mask_and_causal, _mask_args),
    "bias_input": (bias_input, _bias_args),
    "flax_style_prescaled": (flax_style_prescaled, _flax_bias_args),
    "mixed_precision_bf16": (mixed_precision, lambda r: btnh(r, dtype=jnp.bfloat16)),
    "nested_jit": (nested_jit, bnth),
    "single_head": (single_head, bnth),
    "flattened_batch": (flattened_batch, bnth),
    "scan_layers": (scan_layers, bnth),
    "remat": (remat_attention, bnth),
    "softcap": (softcapped, bnth),
}

#: Spellings whose score ops must include a Causal op.
CAUSAL = {
    "gqa_dot_product_attention",
    "causal_tril_where",
    "causal_iota_finfo_min",
    "causal_additive",
    "causal_bottom_right",
    "mask_and_causal",
    "flax_style_prescaled",
}


def keras_remasked(q, k, v, mask):
    # keras' masked Softmax: where(mask, softmax(where(mask, s, -1e9)), 0)
    m = mask[:, None, None, :]
    s = jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3, -1e9)
    p = jnp.where(m, jax.nn.softmax(s, axis=-1), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def keras_remasked_causal(q, k, v):
    t = q.shape[1]
    m = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
    p = jnp.where(m, jax.nn.softmax(s, axis=-1), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def bert_head_mask(q, k, v):
    # transformers' BERT: einsum("...hqk,h->...hqk", weights, head_mask) with int ones
    head_mask = jnp.ones((q.shape[1],), jnp.int32)
    p = jax.nn.softmax(jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3, -1)
    p = jnp.einsum("...hqk,h->...hqk", p, head_mask)
    return jnp.einsum("bhts,bhsd->bhtd", p, v)


def _padded_rows_args(rng):
    q, k, v, mask = _mask_args(rng)
    return q, k, v, mask.at[1].set(False)  # a fully masked batch row


POSITIVE.update(
    {
        "keras_remasked": (keras_remasked, _padded_rows_args),
        "keras_remasked_causal": (keras_remasked_causal, btnh),
        "bert_head_mask": (bert_head_mask, bnth),
    }
)
CAUSAL.add("keras_remasked_causal")


def hf_attention_bias(q, k, v, attention_mask):
    # transformers' Flax GPT-2/Llama: combine_masks(padding, causal) -> float,
    # then an additive bias lax.select(mask > 0, 0, finfo.min)
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((1, 1, t, t), bool))
    padding = jnp.broadcast_to(attention_mask[:, None, None, :], (q.shape[0], 1, t, t))
    combined = jnp.logical_and(padding, causal).astype(jnp.float32)
    bias = lax.select(
        combined > 0,
        jnp.full(combined.shape, 0.0, jnp.float32),
        jnp.full(combined.shape, jnp.finfo(jnp.float32).min, jnp.float32),
    )
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


POSITIVE["hf_attention_bias"] = (hf_attention_bias, _padded_rows_args)
CAUSAL.add("hf_attention_bias")  # causal + a key mask + EmptyRows


# ---------------------------------------------------------------- structured masks
#
# Each becomes an O(T) descriptor (Window, Chunk, Prefix, Segments) instead of
# a dense mask: tests/test_structured_masks.py checks the descriptors.

WINDOW = 4  # keys i - 3 .. i
CHUNK = 4
PREFIX = 5
SINK_TOKENS = 2
BLOCK = 4


def _positions(n):
    return jnp.arange(n)


def window_iota(q, k, v):
    # iota difference, combined with causal by `&` (Mistral-style)
    i = lax.broadcasted_iota(jnp.int32, (q.shape[2], k.shape[2]), 0)
    j = lax.broadcasted_iota(jnp.int32, (q.shape[2], k.shape[2]), 1)
    keep = (j <= i) & (i - j < WINDOW)
    s = jnp.where(keep, q @ k.swapaxes(-1, -2) * 0.3, -jnp.inf)
    return jax.nn.softmax(s, -1) @ v


def window_tril_difference(q, k, v):
    # tril minus an earlier tril, as 0/1 floats
    t = q.shape[1]
    band = jnp.tril(jnp.ones((t, t))) - jnp.tril(jnp.ones((t, t)), -WINDOW)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(band.astype(bool), s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def window_tril_xor(q, k, v):
    t = q.shape[2]
    causal = jnp.tril(jnp.ones((t, t), bool))
    band = causal ^ jnp.tril(jnp.ones((t, t), bool), -WINDOW)
    s = jnp.where(band[None, None], q @ k.swapaxes(-1, -2), -1e9)
    return jax.nn.softmax(s, -1) @ v


def window_positions_int_min(q, k, v):
    # position-based, with an integer-min fill (as some JAX ports write it)
    pos_q, pos_k = _positions(q.shape[2]), _positions(k.shape[2])
    dist = pos_q[:, None] - pos_k[None, :]
    keep = (dist >= 0) & (dist < WINDOW)
    s = jnp.where(keep, q @ k.swapaxes(-1, -2) * 0.3, jnp.iinfo(jnp.int32).min)
    return jax.nn.softmax(s, -1) @ v


def window_bidirectional(q, k, v):
    # local attention both ways: |i - j| <= 2
    pos = _positions(q.shape[2])
    keep = jnp.abs(pos[:, None] - pos[None, :]) <= 2
    s = jnp.where(keep, q @ k.swapaxes(-1, -2) * 0.3, -1e30)
    return jax.nn.softmax(s, -1) @ v


def llama4_chunked(q, k, v):
    # Llama 4's chunked local attention: same chunk and causal
    pos = _positions(q.shape[2])
    same_chunk = (pos[:, None] // CHUNK) == (pos[None, :] // CHUNK)
    keep = same_chunk & (pos[None, :] <= pos[:, None])
    s = jnp.where(keep, q @ k.swapaxes(-1, -2) * 0.3, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(s, -1) @ v


def prefix_lm(q, k, v):
    # prefix-LM: the first PREFIX keys are seen by everyone, the rest causally
    pos = _positions(q.shape[2])
    keep = (pos[None, :] <= pos[:, None]) | (pos[None, :] < PREFIX)
    s = jnp.where(keep, q @ k.swapaxes(-1, -2) * 0.3, -1e9)
    return jax.nn.softmax(s, -1) @ v


def streaming_llm(q, k, v):
    # StreamingLLM: the first SINK_TOKENS keys always, the rest in a causal window
    i, j = _positions(q.shape[2])[:, None], _positions(k.shape[2])[None, :]
    keep = (j < SINK_TOKENS) | ((j <= i) & (j > i - WINDOW))
    s = jnp.where(keep, q @ k.swapaxes(-1, -2) * 0.3, -jnp.inf)
    return jax.nn.softmax(s, -1) @ v


def block_diffusion(q, k, v):
    # block diffusion LMs (BD3-LM): causal between blocks of BLOCK, bidirectional within
    block = _positions(q.shape[2]) // BLOCK
    keep = block[:, None] >= block[None, :]
    s = jnp.where(keep, q @ k.swapaxes(-1, -2) * 0.3, -1e9)
    return jax.nn.softmax(s, -1) @ v


def packed_segments(q, k, v, segment_ids):
    # MaxText-style packed documents: same segment and causal
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    t = q.shape[2]
    keep = same[:, None] & jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(keep, q @ k.swapaxes(-1, -2) * 0.3, -0.7 * float(np.finfo(np.float32).max))
    return jax.nn.softmax(s, -1) @ v


EOS = 7


def packed_eos_cumsum(q, k, v, tokens):
    # segment ids derived in the program: a new document after every EOS token
    ids = jnp.cumsum(tokens == EOS, axis=-1) - (tokens == EOS)
    same = ids[:, None, :, None] == ids[:, None, None, :]
    s = jnp.where(same, q @ k.swapaxes(-1, -2) * 0.3, -jnp.inf)
    return jax.nn.softmax(s, -1) @ v


def _segment_args(rng):
    q, k, v = bnth(rng)
    ids = np.sort(rng.integers(0, 4, (B, T)), axis=1).astype(np.int32)
    return q, k, v, jnp.asarray(ids)


def _token_args(rng):
    q, k, v = bnth(rng)
    tokens = rng.integers(0, 10, (B, T)).astype(np.int32)
    tokens[:, 3] = EOS
    return q, k, v, jnp.asarray(tokens)


def deberta_padding(q, k, v, mask):
    # DeBERTa: the int padding mask times itself transposed, read as bool,
    # masked_fill(~mask, finfo.min): padded query rows keep no key
    m = mask[:, None, None, :] * mask[:, None, :, None]
    s = jnp.where(~m.astype(bool), float(np.finfo(np.float32).min), q @ k.swapaxes(-1, -2) * 0.3)
    return jax.nn.softmax(s, -1) @ v


def padding_sum_threshold(q, k, v, mask):
    # two float padding vectors summed and compared: keeps where both are 1
    m = mask.astype(jnp.float32)
    keep = (m[:, None, :, None] + m[:, None, None, :]) > 1.5
    s = jnp.where(keep, q @ k.swapaxes(-1, -2) * 0.3, -1e9)
    return jax.nn.softmax(s, -1) @ v


def _padding_args(rng):
    q, k, v = bnth(rng)
    mask = np.ones((B, T), np.int32)
    mask[1, T - 5 :] = 0
    return q, k, v, jnp.asarray(mask)


#: Structured-mask spellings and the descriptors their spec must hold.
STRUCTURED = {
    "window_iota": (window_iota, bnth, ("Causal(0)", "Window(3, None)")),
    "window_tril_difference": (window_tril_difference, btnh, ("Window(3, 0)",)),
    "window_tril_xor": (window_tril_xor, bnth, ("Window(3, 0)",)),
    "window_positions_int_min": (
        window_positions_int_min,
        bnth,
        ("Causal(0)", "Window(3, None)"),
    ),
    "window_bidirectional": (window_bidirectional, bnth, ("Window(2, 2)",)),
    "llama4_chunked": (llama4_chunked, bnth, ("Chunk(4)", "Causal(0)")),
    "prefix_lm": (prefix_lm, bnth, ("Prefix(5)",)),
    "streaming_llm": (streaming_llm, bnth, ("SinkWindow(2, 4)",)),
    "block_diffusion": (block_diffusion, bnth, ("BlockCausal(4)",)),
    "packed_segments": (packed_segments, _segment_args, ("Segments", "Causal(0)")),
    "packed_eos_cumsum": (packed_eos_cumsum, _token_args, ("Segments",)),
    "deberta_padding": (deberta_padding, _padding_args, ("OuterMask(mul, ne, 0, False, True)",)),
    "padding_sum_threshold": (
        padding_sum_threshold,
        _padding_args,
        ("OuterMask(add, gt, 1.5, True, True)",),
    ),
}
POSITIVE.update({name: (fn, make) for name, (fn, make, _) in STRUCTURED.items()})
CAUSAL.update({"window_iota", "window_positions_int_min", "llama4_chunked", "packed_segments"})


# ---------------------------------------------------------------- newer libraries
def remasked_conjunction(q, k, v, mask):
    # keras-hub's Gemma: where(m, softmax(where(m, s, -1e9)), 0) with m = padding & causal,
    # split into factors on the scores and re-applied whole to the probabilities
    t = q.shape[1]
    m = jnp.logical_and(mask[:, None, :], jnp.tril(jnp.ones((t, t), bool))[None])[:, None]
    s = jnp.where(m, jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3, -1e9)
    p = jnp.where(m, jax.nn.softmax(s, axis=-1), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def probabilities_copied(q, k, v):
    # penzai's named arrays copy the probabilities before P·V
    p = jnp.copy(jax.nn.softmax(q @ k.swapaxes(-1, -2) * 0.3, axis=-1))
    return p @ v


def deferred_bthd(q, k, v):
    # MaxText-style: exp(s - max) @ v, normalised after the einsum moved heads
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3
    e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
    out = jnp.einsum("bhts,bhsd->bthd", e, v)
    return out / jnp.moveaxis(e.sum(-1), 1, 2)[..., None]


def unstabilised_minus_bias(q, k, v, bias):
    e = jnp.exp(q @ k.swapaxes(-1, -2) - bias)
    return (e / e.sum(-1, keepdims=True)) @ v


POSITIVE.update(
    {
        "remasked_conjunction": (remasked_conjunction, _padded_rows_args),
        "probabilities_copied": (probabilities_copied, bnth),
        "deferred_bthd": (deferred_bthd, bnth),
        "unstabilised_minus_bias": (unstabilised_minus_bias, _bias_args),
    }
)
CAUSAL.add("remasked_conjunction")


# ---------------------------------------------------------------- regrouped scores


def gemma_gqa(q, k, v):
    # DeepMind gemma: GQA scores [B, T, K, G, S] reshaped to [B, T, K*G, S] for the
    # soft-cap, mask and softmax, and the probabilities reshaped back before P·V.
    b, t, n, h = q.shape
    kv = k.shape[2]
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, kv, n // kv, h) * 0.3, k)
    logits = logits.reshape(b, t, n, k.shape[1])
    logits = jnp.tanh(logits / 50.0) * 50.0
    causal = jnp.tril(jnp.ones((t, k.shape[1]), bool))[None]
    logits = jnp.where(jnp.expand_dims(causal, -2), logits, -2.3819763e38)
    probs = jax.nn.softmax(logits, axis=-1).astype(k.dtype)
    probs = probs.reshape(b, t, kv, n // kv, k.shape[1])
    encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v)
    return encoded.reshape(b, t, n, h)


def gemma_gqa_head_bias(q, k, v, bias):
    # The GQA scores regrouped as in `gemma_gqa`, with a per-head bias along the
    # merged (kv head, group) axis: split back into the two roles when read.
    b, t, n, h = q.shape
    kv = k.shape[2]
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, kv, n // kv, h) * 0.3, k)
    logits = logits.reshape(b, t, n, k.shape[1]) + bias
    probs = jax.nn.softmax(logits, axis=-1).reshape(b, t, kv, n // kv, k.shape[1])
    return jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(b, t, n, h)


def deferred_regrouped(q, k, v):
    # MaxText's AttentionOp (dot_product): GQA scores [B, K, G, T, S] merged to
    # [B, K*G, T, S] for an unnormalised exp, the exps split back for P·V, the
    # output merged to [B, T, K*G, H] and divided by the row sums moved to
    # [B, T, K*G, 1] by a transpose alone.
    b, t, n, h = q.shape
    kv, s = k.shape[2], k.shape[1]
    logits = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kv, n // kv, h) * 0.3, k)
    logits = logits.reshape(b, n, t, s)
    e = jnp.exp(logits - logits.max(-1, keepdims=True))
    total = jnp.transpose(e.sum(-1, keepdims=True), (0, 2, 1, 3))
    out = jnp.einsum("bkgts,bskd->btkgd", e.reshape(b, kv, n // kv, t, s), v)
    return out.reshape(b, t, n, h) / total


def _gqa_mqa_args(rng):
    # one kv head: the size-1 kv-head axis is dropped by the reshape and restored
    return (_normal(rng, (B, T, 4, D)), _normal(rng, (B, S, 1, D)), _normal(rng, (B, S, 1, D)))


POSITIVE.update(
    {
        "gemma_gqa": (gemma_gqa, _gqa_args),
        "gemma_mqa": (gemma_gqa, _gqa_mqa_args),
        "deferred_regrouped": (deferred_regrouped, _gqa_args),
        "gemma_gqa_head_bias": (
            gemma_gqa_head_bias,
            lambda r: (*_gqa_args(r), _normal(r, (1, T, 4, S))),
        ),
    }
)
#: JAX 0.9's jnp.matmul keeps a unit batch axis as a unit *free* axis of the
#: score product instead of squeezing it (known gap G5 there, see
#: tests/fuzz/attention_programs.py); from JAX 0.10 on it squeezes and
#: broadcasts back, which patterns/regroup.py reads.
UNIT_AXIS_MATMUL = JAX_VERSION >= (0, 10)
if UNIT_AXIS_MATMUL:
    POSITIVE.update(
        {
            # jnp.matmul squeezes a unit batch or head axis around each product
            "matmul_batch_one": (matmul_bnth, lambda r: tuple(x[:1] for x in bnth(r))),
            "matmul_one_head": (matmul_bnth, lambda r: tuple(x[:, :1] for x in bnth(r))),
        }
    )
CAUSAL.update({"gemma_gqa", "gemma_mqa"})


# ---------------------------------------------------------------- attention sinks


def attention_sinks(q, k, v, sinks):
    # keras-hub's gpt-oss: a learned logit per head concatenated to the causal
    # scores, the max over scores and sink subtracted, the sink column dropped.
    s = jnp.einsum("bthd,bshd->bhts", q, k) * 0.35
    t, n = s.shape[-2:]
    s = jnp.where(jnp.tril(jnp.ones((t, n), bool)), s, -1e9)
    col = jnp.broadcast_to(sinks.reshape(1, -1, 1, 1), (*s.shape[:-1], 1)).astype(s.dtype)
    c = jnp.concatenate([s, col], axis=-1)
    c = c - lax.stop_gradient(c.max(-1, keepdims=True))
    p = jax.nn.softmax(c, axis=-1)[..., :-1]
    return jnp.einsum("bhts,bshd->bthd", p, v)


POSITIVE["attention_sinks"] = (attention_sinks, lambda r: (*btnh(r), _normal(r, (H,))))
CAUSAL.add("attention_sinks")


# ---------------------------------------------------------------- a block of the scores


def block_set_relpos(q, k, v, rh, rw):
    # timm's MViTv2 (a `scatter` through torchax): decomposed relative positions
    # from q, added to every score but the class token's row and column,
    # attn[:, :, 1:, 1:] = (attn[:, :, 1:, 1:].view(..., qh, qw, kh, kw) + rel).view(...).
    b, h, t, d = q.shape
    g = rh.shape[0]
    s = (q * d**-0.5) @ jnp.swapaxes(k, -1, -2)
    r_q = q[:, :, 1:].reshape(b, h, g, g, d)
    rel_h = jnp.einsum("byhwc,hkc->byhwk", r_q, rh)
    rel_w = jnp.einsum("byhwc,wkc->byhwk", r_q, rw)
    block = s[:, :, 1:, 1:].reshape(b, h, g, g, g, g) + rel_h[..., None] + rel_w[..., None, :]
    s = s.at[:, :, 1:, 1:].set(block.reshape(b, h, g * g, g * g))
    return jax.nn.softmax(s, axis=-1) @ v


POSITIVE["block_set_relpos"] = (
    block_set_relpos,
    lambda r: (*bnth(r, t=17, s=17), _normal(r, (4, 4, D)) / 3, _normal(r, (4, 4, D)) / 3),
)
