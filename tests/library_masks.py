"""Masks written the way real libraries build them (for test_library_masks.py).

Each function is an attention whose mask is built inside it from iotas and
constants, in one library's spelling: keras-hub (``compute_causal_mask``, the
Gemma 3 / Mistral sliding ``triu * tril`` window, keras' ``Softmax(mask)``),
flax.linen (``make_causal_mask``, ``make_attention_mask``, ``combine_masks``,
``dot_product_attention``'s ``finfo.min`` fill), Hugging Face Flax (a causal
buffer sliced, ``lax.select(mask > 0, 0, finfo.min)`` added to the scores),
DeepMind gemma (``K_MASK = -2.38e38``, an int window product), MaxText (an
additive ``-0.7 * finfo.max`` mask over packed segments, a 5-D grouped layout,
normalisation after P·V), and the arithmetic spellings of issue #28.

``FORMS``: name -> (function, extra-argument builder, descriptors expected).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

B, H, T, D = 1, 2, 1024, 16
W = 128  # window width
NEG = -1e9
K_MASK = -2.3819763e38  # DeepMind gemma
MAXTEXT = -0.7 * float(np.finfo(np.float32).max)
F32_MIN = float(np.finfo(np.float32).min)


def _scores(q, k):
    return jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5


def _out(s, v):
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def _ij(t=T, s=T):
    return jnp.arange(t)[:, None], jnp.arange(s)[None, :]


def _causal():
    i, j = _ij()
    return j <= i


def _window():
    i, j = _ij()
    return (j <= i) & (i - j < W)


# --------------------------------------------------------------------------- additive


def add_where_1e9(q, k, v):
    return _out(_scores(q, k) + jnp.where(_causal(), 0.0, NEG), v)


def add_where_finfo_min(q, k, v):
    return _out(_scores(q, k) + jnp.where(_window(), 0.0, jnp.finfo(q.dtype).min), v)


def add_one_minus_int(q, k, v):
    m = _window().astype(jnp.int32)
    return _out(_scores(q, k) + (1 - m) * NEG, v)


def add_one_minus_float(q, k, v):
    m = _causal().astype(jnp.float32)
    return _out(_scores(q, k) + (1.0 - m) * NEG, v)


def add_lax_select(q, k, v):
    zeros = jnp.zeros((T, T), jnp.float32)
    return _out(_scores(q, k) + lax.select(_window(), zeros, jnp.full((T, T), NEG)), v)


def add_bias_none_none(q, k, v):
    bias = jnp.where(_window(), 0.0, K_MASK)
    return _out(_scores(q, k) + bias[None, None], v)


def add_maxtext_fill(q, k, v):
    return _out(_scores(q, k) + jnp.where(_causal(), 0.0, MAXTEXT), v)


def add_window_sinks(q, k, v, sinks):
    """gpt-oss: a causal window in additive form, a per-head sink logit."""
    s = _scores(q, k) + jnp.where(_window(), 0.0, F32_MIN)
    col = jnp.broadcast_to(sinks.reshape(1, -1, 1, 1), (*s.shape[:-1], 1))
    c = jnp.concatenate([s, col], axis=-1)
    c = c - lax.stop_gradient(c.max(-1, keepdims=True))
    p = jax.nn.softmax(c, axis=-1)[..., :-1]
    return jnp.einsum("bhts,bhsd->bhtd", p, v)


# --------------------------------------------------------------------------- int arithmetic


def int_minimum(q, k, v):
    i, j = _ij()
    m = jnp.minimum((j <= i).astype(jnp.int32), (i - j < W).astype(jnp.int32))
    return _out(jnp.where(m > 0, _scores(q, k), NEG), v)


def int_product(q, k, v):
    i, j = _ij()
    m = (j <= i).astype(jnp.int32) * (i - j < W).astype(jnp.int32)
    return _out(jnp.where(m.astype(bool), _scores(q, k), NEG), v)


def int_bitand(q, k, v):
    i, j = _ij()
    m = (j <= i).astype(jnp.int32) & (i - j < W).astype(jnp.int32)
    return _out(jnp.where(m == 1, _scores(q, k), NEG), v)


def int_segments_product(q, k, v, ids):
    """Packed documents as an int product of two 0/1 masks, read with ``> 0``."""
    i, j = _ij()
    same = (ids[:, :, None] == ids[:, None, :]).astype(jnp.int32)[:, None]
    m = same * (j <= i).astype(jnp.int32)
    return _out(jnp.where(m > 0, _scores(q, k), NEG), v)


def int_minimum_additive(q, k, v):
    i, j = _ij()
    m = jnp.minimum((j <= i).astype(jnp.int32), (i - j < W).astype(jnp.int32))
    return _out(_scores(q, k) + (1 - m) * NEG, v)


# --------------------------------------------------------------------------- library helpers


def keras_hub_causal(q, k, v):
    """keras-hub ``compute_causal_mask`` (float iotas) + keras ``Softmax(mask)``
    (``where(mask, s, -1e9)``, then ``where(mask, p, 0)``)."""
    i = jnp.arange(T, dtype=jnp.float32)[:, None]
    j = jnp.arange(T, dtype=jnp.float32)
    mask = jnp.broadcast_to((i >= j)[None], (B, T, T))[:, None, :, :]
    s = jnp.where(mask, _scores(q, k), NEG)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    return jnp.einsum("bhts,bhsd->bhtd", p, v)


def keras_hub_sliding(q, k, v):
    """keras-hub Gemma 3 / Mistral: ``triu(ones, -W + 1) * tril(ones, W - 1)``
    sliced and ``logical_and``-ed with the causal mask."""
    i = jnp.arange(T, dtype=jnp.float32)[:, None]
    j = jnp.arange(T, dtype=jnp.float32)
    causal = jnp.broadcast_to((i >= j)[None], (B, T, T))
    ones = jnp.ones((T, T), bool)
    sliding = jnp.triu(ones, -W + 1) * jnp.tril(ones, W - 1)
    sliding = lax.dynamic_slice(sliding, (0, 0), (T, T))[None]
    mask = jnp.logical_and(causal, sliding.astype(bool))[:, None]
    return _out(jnp.where(mask, _scores(q, k), NEG), v)


def flax_combine(q, k, v):
    """flax.linen ``make_causal_mask`` & a windowed ``make_attention_mask``
    through ``combine_masks``, filled with ``finfo.min``."""
    import flax.linen as nn

    ids = jnp.arange(T)[None]
    causal = nn.make_causal_mask(jnp.ones((B, T)))
    window = nn.make_attention_mask(ids, ids, lambda a, b: a - b < W)
    mask = nn.combine_masks(causal, window)
    return _out(jnp.where(mask, _scores(q, k), jnp.finfo(q.dtype).min), v)


def hf_flax_buffer(q, k, v):
    """Hugging Face Flax: a ``make_causal_mask`` buffer of the max length,
    sliced, made an additive bias with ``lax.select(mask > 0, 0, finfo.min)``."""
    import flax.linen as nn

    buffer = nn.make_causal_mask(jnp.ones((1, 2 * T), bool), dtype="bool")
    mask = buffer[:, :, :T, :T]
    bias = lax.select(
        mask > 0,
        jnp.full(mask.shape, 0.0, jnp.float32),
        jnp.full(mask.shape, jnp.finfo(jnp.float32).min, jnp.float32),
    )
    return _out(_scores(q, k) + bias, v)


def gemma_sliding(q, k, v):
    """DeepMind gemma (older modules.py): ``attn_mask * (triu * tril)`` of
    bool masks, ``where(mask, logits, K_MASK)``."""
    causal = jnp.tril(jnp.ones((B, T, T), bool))
    ones = jnp.ones_like(causal)
    sliding = jnp.triu(ones, -W + 1) * jnp.tril(ones, W - 1)
    mask = sliding * causal
    return _out(jnp.where(mask[:, None], _scores(q, k), K_MASK), v)


def maxtext_packed(q, k, v, ids):
    """MaxText: GQA in a 5-D grouped layout, an additive mask of segment ids
    and causality, added to the scores, normalisation after P·V."""
    g = 2
    qg = q.reshape(B, H // g, g, T, D).transpose(0, 3, 1, 2, 4)  # b t k g d
    kk = k[:, : H // g].transpose(0, 2, 1, 3)  # b s k d
    vv = v[:, : H // g].transpose(0, 2, 1, 3)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, kk) * D**-0.5
    i, j = _ij()
    keep = (ids[:, :, None] == ids[:, None, :]) & (j <= i)[None]
    bias = jnp.where(keep, 0.0, MAXTEXT)[:, None, None]
    s = s + bias
    m = lax.stop_gradient(s.max(-1, keepdims=True))
    e = jnp.exp(s - m)
    total = e.sum(-1)  # b k g t
    out = jnp.einsum("bkgts,bskd->btkgd", e, vv)
    out = out / total.transpose(0, 3, 1, 2)[..., None]
    return out.reshape(B, T, H, D)


# --------------------------------------------------------------------------- padding


def hf_flax_padding(q, k, v, attention_mask):
    """Hugging Face Flax (GPT-2, Llama...): the sliced causal buffer combined
    with the batch's ``attention_mask`` (``combine_masks``), made additive with
    ``lax.select(mask > 0, 0, finfo.min)``."""
    import flax.linen as nn

    buffer = nn.make_causal_mask(jnp.ones((1, 2 * T), bool), dtype="bool")
    causal = jnp.broadcast_to(buffer[:, :, :T, :T], (B, 1, T, T))
    padding = jnp.broadcast_to(attention_mask[:, None, None, :], causal.shape)
    mask = nn.combine_masks(padding, causal)
    zero = jnp.full(mask.shape, 0.0, jnp.float32)
    bias = lax.select(mask > 0, zero, jnp.full(mask.shape, F32_MIN, jnp.float32))
    return _out(_scores(q, k) + bias, v)


def hf_extended_mask(q, k, v, attention_mask):
    """Hugging Face ``get_extended_attention_mask`` for an encoder:
    ``(1.0 - mask[:, None, None, :]) * finfo.min``, no causality.  The mask
    is boolean (cast to float): an int mask from an input is not known to
    hold only 0 and 1, so its arithmetic is no mask (test_library_masks)."""
    extended = attention_mask[:, None, None, :].astype(jnp.float32)
    return _out(_scores(q, k) + (1.0 - extended) * F32_MIN, v)


def int_causal_padding(q, k, v, attention_mask):
    """``(1 - causal_int * mask_int) * -1e9``: an int product of causality and
    the (boolean) padding mask."""
    i, j = _ij()
    m = (j <= i).astype(jnp.int32)[None, None] * attention_mask[:, None, None, :].astype(jnp.int32)
    return _out(_scores(q, k) + (1 - m) * NEG, v)


def window_padding_sinks(q, k, v, attention_mask, sinks):
    """gpt-oss with a padded batch: a causal window and the padding mask in
    one additive bias, a per-head sink logit."""
    i, j = _ij()
    keep = _window()[None, None] & (attention_mask[:, None, None, :] > 0)
    s = _scores(q, k) + jnp.where(keep, 0.0, NEG)
    sink = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:-1], 1))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhts,bhsd->bhtd", p, v)


def packed_two_id_arrays(q, k, v, q_ids, kv_ids):
    """Packed documents whose query and key ids are two arrays (a decoder
    reading another packing), MaxText's additive fill."""
    keep = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    return _out(_scores(q, k) + jnp.where(keep, 0.0, MAXTEXT), v)


def left_padding(rng, lead: int = 10):
    """An int ``[B, S]`` attention mask whose first ``lead`` keys are padding:
    under causality rows ``0 .. lead - 1`` keep no key."""
    mask = np.ones((B, T), np.int32)
    mask[:, :lead] = 0
    return (jnp.asarray(mask),)


def left_padding_bool(rng, lead: int = 10):
    """`left_padding` as a boolean mask."""
    return (left_padding(rng, lead)[0] > 0,)


def _two_id_arrays(rng):
    q_ids = np.sort(rng.integers(0, 4, (B, T)), axis=1).astype(np.int32)
    kv_ids = np.sort(rng.integers(1, 5, (B, T)), axis=1).astype(np.int32)  # no key has id 0
    return jnp.asarray(q_ids), jnp.asarray(kv_ids)


def _ids(rng):
    ids = np.sort(rng.integers(0, 4, (B, T)), axis=1).astype(np.int32)
    return (jnp.asarray(ids),)


def _sinks(rng):
    return (jnp.asarray(rng.standard_normal(H), jnp.float32),)


def _none(rng):
    return ()


CW = ["Causal(0)", f"Window({W - 1}, None)"]

FORMS = {
    "add_where_1e9": (add_where_1e9, _none, ["Causal(0)"]),
    "add_where_finfo_min": (add_where_finfo_min, _none, CW),
    "add_one_minus_int": (add_one_minus_int, _none, CW),
    "add_one_minus_float": (add_one_minus_float, _none, ["Causal(0)"]),
    "add_lax_select": (add_lax_select, _none, CW),
    "add_bias_none_none": (add_bias_none_none, _none, CW),
    "add_maxtext_fill": (add_maxtext_fill, _none, ["Causal(0)"]),
    "add_window_sinks": (add_window_sinks, _sinks, [*CW, "Sink"]),
    "int_minimum": (int_minimum, _none, [f"Window({W - 1}, 0)"]),
    "int_product": (int_product, _none, [f"Window({W - 1}, 0)"]),
    "int_bitand": (int_bitand, _none, [f"Window({W - 1}, 0)"]),
    "int_segments_product": (int_segments_product, _ids, ["Causal(0)", "Segments"]),
    "int_minimum_additive": (int_minimum_additive, _none, CW),
    "keras_hub_causal": (keras_hub_causal, _none, ["Causal(0)"]),
    # Its whole-array dynamic_slice is read through (an identity): the triu * tril
    # product is read factor by factor, as gemma's, where the folded constant
    # was one Window(W - 1, W - 1) before; the same keys.
    "keras_hub_sliding": (keras_hub_sliding, _none, [*CW, f"Causal({W - 1})"]),
    "flax_combine": (flax_combine, _none, CW),
    "hf_flax_buffer": (hf_flax_buffer, _none, ["Causal(0)"]),
    "gemma_sliding": (gemma_sliding, _none, [*CW, f"Causal({W - 1})"]),
    "maxtext_packed": (maxtext_packed, _ids, ["Causal(0)", "Segments"]),
}


def _empty(count: int, fill: float) -> str:
    return f"EmptyRows({count}, {fill}, float32)"


#: Additive masks with a finite fill whose rows may keep no key (padding, ids
#: from two arrays): their descriptors and an `EmptyRows` op (name -> as FORMS).
PADDED_FORMS = {
    "hf_flax_padding": (
        hf_flax_padding,
        left_padding,
        ["Causal(0)", _empty(2, F32_MIN), "Mask"],
    ),
    "hf_extended_mask": (hf_extended_mask, left_padding_bool, [_empty(1, F32_MIN), "Mask"]),
    "int_causal_padding": (
        int_causal_padding,
        left_padding_bool,
        ["Causal(0)", _empty(2, NEG), "Mask"],
    ),
    "window_padding_sinks": (
        window_padding_sinks,
        lambda rng: (*left_padding(rng), *_sinks(rng)),
        [*CW, _empty(3, NEG), "Mask", "Sink"],
    ),
    "packed_two_id_arrays": (
        packed_two_id_arrays,
        _two_id_arrays,
        [_empty(1, float(np.float32(MAXTEXT))), "Segments"],
    ),
}


def qkv(rng, dtype=np.float32):
    return tuple(jnp.asarray(rng.standard_normal((B, H, T, D)).astype(dtype)) for _ in range(3))
