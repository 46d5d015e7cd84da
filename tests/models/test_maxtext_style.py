"""A hand-written MaxText-style decoder (MaxText itself is not a pip package):
its ``AttentionOp.apply_attention_dot`` path, spelt as MaxText spells it.

* Queries are pre-scaled by ``1/sqrt(head_dim)`` and grouped for GQA
  (``[b, t, kv, groups, d]``), scores are ``einsum("btkgd,bskd->bkgts")``.
* The mask is built from packed-document segment ids (``ids[:, :, None] ==
  ids[:, None, :]``) and an iota causal mask (and a sliding window on local
  layers), turned into an additive ``where(mask, 0, DEFAULT_MASK_VALUE)`` array
  and applied as ``where(mask >= DEFAULT_MASK_VALUE * 0.5, logits, DEFAULT_MASK_VALUE)``.
* Normalisation is deferred: ``exp(w - max)`` goes through ``P·V`` unnormalised,
  and the output is divided by the row sums after a ``moveaxis`` and a reshape
  that flattens ``(kv, groups)`` back into heads.
* Gemma 2 decoders alternate local and global layers with a logit soft-cap, and
  scan a (local, global) pair block under ``jax.checkpoint`` (``scan_layers``,
  ``remat_policy``).
* A mixture-of-experts MLP routes tokens with a softmax over experts: not attention,
  never rewritten.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import flashpass

from conftest import F32_TOL, assert_close, assert_tree_close

B, T, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 2, 16, 32, 4, 2, 8, 64, 64
WINDOW = 4
WHERE = "tests/models/test_maxtext_style.py"
STACK_TOL = 5e-5  # two layers deep
DEFAULT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.dtype("float32")).max)


# ----------------------------------------------------------------------------- attention op


def generate_attention_mask(segment_ids, window: int | None):
    """MaxText's ``AttentionOp.generate_attention_mask`` (training, causal)."""
    mask = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = mask[:, None, None, :, :]
    t = segment_ids.shape[1]
    row_ids = lax.broadcasted_iota(jnp.int32, (t, t), 0)
    col_ids = lax.broadcasted_iota(jnp.int32, (t, t), 1)
    causal_mask = (col_ids <= row_ids)[None, None, None, :, :]
    output_mask = jnp.logical_and(mask, causal_mask)
    if window is not None:
        sliding = (col_ids > row_ids - window) & (col_ids < row_ids + window)
        output_mask = sliding[None, None, None, :, :] * output_mask
    return jnp.where(output_mask, 0.0, DEFAULT_MASK_VALUE)


def apply_mask_to_logits(logits, mask):
    return jnp.where(mask >= DEFAULT_MASK_VALUE * 0.5, logits, DEFAULT_MASK_VALUE)


def apply_attention_dot(
    query, key, value, segment_ids, *, window=None, softcap=None, verbatim=True
):
    """``[b, t, n, d]`` query, ``[b, s, kv, d]`` key/value -> ``[b, t, n, d]``.

    ``verbatim``: MaxText's own normalisation (keepdims sum, ``moveaxis``, the
    sum and the output both reshaped to ``n = kv * groups`` heads, then divided).
    Else the division comes before the head merge, with the sum moved to the
    output's layout (``deferred_bthd`` in tests/spellings.py)."""
    b, t, n, d = query.shape
    kv = key.shape[2]
    # qk_product: grouped queries, heads before positions.
    query = jnp.reshape(query, (b, t, kv, n // kv, d))
    attn_weights = jnp.einsum("btkgd,bskd->bkgts", query, key)
    if softcap is not None:
        attn_weights = jnp.tanh(attn_weights / softcap)
        attn_weights = attn_weights * softcap
    attn_weights = attn_weights.astype(jnp.float32)  # float32_logits
    attn_weights = apply_mask_to_logits(attn_weights, generate_attention_mask(segment_ids, window))
    # compute_local_attention: unnormalised exponentials.
    local_max = jnp.max(attn_weights, axis=-1, keepdims=True)
    local_exps = jnp.exp(attn_weights - local_max)
    if not verbatim:
        out = jnp.einsum("bkgts,bskd->btkgd", local_exps, value)
        out = out / jnp.moveaxis(jnp.sum(local_exps, axis=-1), -1, 1)[..., None]
        return jnp.reshape(out, (b, t, n, d))
    local_sum = jnp.sum(local_exps, axis=-1, keepdims=True)
    local_sum = jnp.moveaxis(local_sum, -2, 1)
    local_sum = jnp.reshape(local_sum, (b, t, n, 1))
    # wv_product, then AttentionOp.__call__'s division.
    out = jnp.einsum("bkgts,bskd->btkgd", local_exps, value)
    out = jnp.reshape(out, (b, t, n, d))
    return out / local_sum


# ----------------------------------------------------------------------------- decoder


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    return x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * scale


def rope(x, positions, wavelength=10_000.0):
    half = x.shape[-1] // 2
    timescale = wavelength ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
    angle = positions[:, :, None, None].astype(jnp.float32) / timescale
    first, second = x[..., :half], x[..., half:]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention_layer(p, x, segment_ids, positions, *, verbatim, window=None, softcap=None):
    h = rms_norm(x, p["pre_norm"])
    q = jnp.einsum("btd,dnh->btnh", h, p["q"]) / jnp.sqrt(HEAD_DIM).astype(h.dtype)
    k = jnp.einsum("btd,dnh->btnh", h, p["k"])
    v = jnp.einsum("btd,dnh->btnh", h, p["v"])
    q, k = rope(q, positions), rope(k, positions)
    out = apply_attention_dot(
        q, k, v, segment_ids, window=window, softcap=softcap, verbatim=verbatim
    )
    return x + jnp.einsum("btnh,nhd->btd", out, p["o"])


def mlp(p, x):
    h = rms_norm(x, p["mlp_norm"])
    return x + jax.nn.gelu(h @ p["wi"]) @ p["wo"]


def moe(p, x, top_k=2):
    """MaxText's dense-matmul MoE: softmax router over experts, top-k gates."""
    h = rms_norm(x, p["mlp_norm"])
    gate_logits = jnp.einsum("btd,de->bte", h, p["router"])
    weights = jax.nn.softmax(gate_logits.astype(jnp.float32), axis=-1)
    top_w, top_i = lax.top_k(weights, top_k)
    combine = jnp.sum(jax.nn.one_hot(top_i, weights.shape[-1]) * top_w[..., None], axis=-2)
    hidden = jax.nn.gelu(jnp.einsum("btd,edf->btef", h, p["wi"]))
    expert_out = jnp.einsum("btef,efd->bted", hidden, p["wo"])
    return x + jnp.einsum("bted,bte->btd", expert_out, combine)


def _layer_params(rng, experts: int | None):
    def normal(shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), jnp.float32)

    p = {
        "pre_norm": jnp.asarray(1 + 0.1 * rng.standard_normal(D_MODEL), jnp.float32),
        "mlp_norm": jnp.asarray(1 + 0.1 * rng.standard_normal(D_MODEL), jnp.float32),
        "q": normal((D_MODEL, HEADS, HEAD_DIM), D_MODEL),
        "k": normal((D_MODEL, KV_HEADS, HEAD_DIM), D_MODEL),
        "v": normal((D_MODEL, KV_HEADS, HEAD_DIM), D_MODEL),
        "o": normal((HEADS, HEAD_DIM, D_MODEL), HEADS * HEAD_DIM),
    }
    if experts is None:
        p["wi"] = normal((D_MODEL, MLP), D_MODEL)
        p["wo"] = normal((MLP, D_MODEL), MLP)
    else:
        p["router"] = normal((D_MODEL, experts), D_MODEL)
        p["wi"] = normal((experts, D_MODEL, MLP), D_MODEL)
        p["wo"] = normal((experts, MLP, D_MODEL), MLP)
    return p


def _params(layers: int, experts: int | None = None, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.standard_normal((VOCAB, D_MODEL)), jnp.float32),
        "final_norm": jnp.ones((D_MODEL,), jnp.float32),
        "layers": [_layer_params(rng, experts) for _ in range(layers)],
    }


def _packed_batch():
    """Row 0: three documents; row 1: two documents and right padding (segment 0)."""
    lengths = [[5, 7, 4], [9, 4, 0]]
    ids, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for row, docs in enumerate(lengths):
        start = 0
        for seg, n in enumerate(docs, start=1):
            ids[row, start : start + n] = seg
            pos[row, start : start + n] = np.arange(n)
            start += n
    tokens = np.random.default_rng(7).integers(0, VOCAB, (B, T)).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(ids), jnp.asarray(pos)


def _logits(params, x):
    return rms_norm(x, params["final_norm"]) @ params["embed"].T


def decoder(verbatim: bool):
    """Llama-style MaxText decoder, layers unrolled (``scan_layers=False``)."""

    def fn(params, tokens, segment_ids, positions):
        x = params["embed"][tokens]
        for p in params["layers"]:
            x = attention_layer(p, x, segment_ids, positions, verbatim=verbatim)
            x = moe(p, x) if "router" in p else mlp(p, x)
        return _logits(params, x)

    return fn


def gemma2_decoder(verbatim: bool):
    """Gemma 2-style: a (local, global) pair block scanned and rematerialised."""

    def fn(params, tokens, segment_ids, positions):
        def pair(x, p):
            kw = dict(verbatim=verbatim, softcap=50.0)
            x = attention_layer(p["local"], x, segment_ids, positions, window=WINDOW, **kw)
            x = mlp(p["local"], x)
            x = attention_layer(p["global"], x, segment_ids, positions, **kw)
            return mlp(p["global"], x), None

        x = params["embed"][tokens] * jnp.sqrt(D_MODEL)
        body = jax.checkpoint(pair, policy=jax.checkpoint_policies.nothing_saveable)
        x, _ = lax.scan(body, x, params["blocks"])
        return jnp.tanh(_logits(params, x) / 30.0) * 30.0

    return fn


def _gemma2_params(pairs: int = 2):
    base = _params(2 * pairs, seed=1)
    layers = base.pop("layers")

    def stack(which):
        return jax.tree.map(lambda *xs: jnp.stack(xs), *layers[which::2])

    base["blocks"] = {"local": stack(0), "global": stack(1)}
    return base


def _ops(rewrite):
    return [op["op"] for op in rewrite.spec["score_ops"]]


NORMALISATION = [
    pytest.param(True, id="verbatim"),
    pytest.param(False, id="normalised-before-head-merge"),
]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("verbatim", NORMALISATION)
def test_packed_decoder(check_model, verbatim):
    report = check_model(
        decoder(verbatim),
        _params(2),
        *_packed_batch(),
        library="MaxText-style",
        case="packed segments, GQA, deferred normalisation"
        + (" (verbatim)" if verbatim else " before the head merge"),
        sites=2,
        where=WHERE,
        tol=STACK_TOL,
    )
    # The additive mask read back with >= is segment ids and causal: O(T) descriptors.
    assert [_ops(r) for r in report.rewrites] == [["segments", "causal"]] * 2


@pytest.mark.slow
@pytest.mark.parametrize("verbatim", NORMALISATION)
def test_gemma2_scanned_local_global(check_model, verbatim):
    report = check_model(
        gemma2_decoder(verbatim),
        _gemma2_params(),
        *_packed_batch(),
        library="MaxText-style",
        case="Gemma 2: scanned remat (local, global), soft-cap, packed"
        + (" (verbatim)" if verbatim else ""),
        sites=2,
        where=WHERE,
        scope="remat",  # the scan's body is the jax.checkpoint
        tol=STACK_TOL,
    )
    local, glob = (_ops(r) for r in report.rewrites)
    assert local[0] == glob[0] == "softcap"
    assert "window" in local and "segments" in local
    assert glob == ["softcap", "segments", "causal"]


def test_moe_router_not_rewritten(record_coverage):
    # One MoE layer: the router's softmax is over experts and feeds top_k, not a P·V.
    fn, params, batch = decoder(False), _params(1, experts=4), _packed_batch()
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(params, *batch)
    record_coverage(
        report,
        library="MaxText-style",
        case="MoE decoder (router softmax kept)",
        sites=1,
        not_attention=("feed `top_k`",),
    )
    assert len(report.rewrites) == 1 and not report.errors, str(report)
    assert _ops(report.rewrites[0]) == ["segments", "causal"]
    # A softmax whose weights top_k only selects from is no attention site:
    # nothing to rewrite and nothing reported as kept (patterns/products.py).
    assert not report.fallbacks, str(report)
    out_ref = jax.jit(fn)(params, *batch)
    assert_close(opt(params, *batch), out_ref, F32_TOL, "output")

    def grad(f):
        return jax.jit(jax.grad(lambda p, *b: jnp.sum(f(p, *b) ** 2)))(params, *batch)

    assert_tree_close(grad(opt), grad(fn), F32_TOL, "grad")
