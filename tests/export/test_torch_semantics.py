"""PyTorch's attention semantics, as torch_xla/torchax lower them, written in JAX:
the safe-softmax guard, masked_fill with -inf or finfo.min, a scale split onto q
and k, boolean masks passed in as inputs.  Proven, not wildcarded: the
near misses next to each are kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass.export as fx

B, H, T, D = 2, 2, 256, 32
SCALE = D**-0.5
QKV = jax.ShapeDtypeStruct((B, H, T, D), jnp.float32)
MASK = jax.ShapeDtypeStruct((B, T), jnp.bool_)
NEG = float(jnp.finfo(jnp.float32).min)


def _scores(q, k):
    return jnp.einsum("bhqd,bhkd->bhqk", q, k) * SCALE


def _out(p, v):
    return jnp.einsum("bhqk,bhkd->bhqd", p, v)


def safe_softmax(s, axis=-1):
    """``torch._safe_softmax``: a row of only -inf gives 0, not NaN."""
    p = jax.nn.softmax(s, axis)
    rows = jnp.all(s == -jnp.inf, axis=axis, keepdims=True)
    return jnp.where(rows, jnp.zeros_like(p), p)


def safe_softmax_any(s, axis=-1):
    """The guard as torchax lowers it: ``not(any(not(s == -inf)))``."""
    p = jax.nn.softmax(s, axis)
    rows = ~jnp.any(~(s == -jnp.inf), axis=axis, keepdims=True)
    return jnp.where(rows, jnp.zeros_like(p), p)


def sdpa_bool_mask_any(q, k, v, mask):
    bias = jnp.where(mask, 0.0, -jnp.inf)[:, None, None, :]
    return _out(safe_softmax_any(_scores(q, k) + bias), v)


def sdpa_causal(q, k, v):  # is_causal=True
    s = _scores(q, k)
    keep = jnp.tril(jnp.ones((T, T), bool))
    return _out(safe_softmax(s + jnp.where(keep, 0.0, -jnp.inf)), v)


def sdpa_bool_mask(q, k, v, mask):  # attn_mask=bool tensor, made additive by torch
    bias = jnp.where(mask, 0.0, -jnp.inf)[:, None, None, :]
    return _out(safe_softmax(_scores(q, k) + bias), v)


def masked_fill_inf(q, k, v, mask):  # scores.masked_fill(~mask, -inf)
    s = jnp.where(~mask[:, None, None, :], -jnp.inf, _scores(q, k))
    return _out(safe_softmax(s), v)


def masked_fill_min(q, k, v, mask):  # masked_fill(~mask, finfo.min), plain softmax
    s = jnp.where(~mask[:, None, None, :], NEG, _scores(q, k))
    return _out(jax.nn.softmax(s, -1), v)


def split_scale(q, k, v):  # SDPA's math path scales q and k by sqrt(scale) each
    r = SCALE**0.5
    return _out(safe_softmax(jnp.einsum("bhqd,bhkd->bhqk", q * r, k * r)), v)


POSITIVE = [
    (sdpa_causal, (QKV, QKV, QKV), "causal"),
    (sdpa_bool_mask, (QKV, QKV, QKV, MASK), "key mask"),
    (sdpa_bool_mask_any, (QKV, QKV, QKV, MASK), "key mask"),
    (masked_fill_inf, (QKV, QKV, QKV, MASK), "key mask"),
    (masked_fill_min, (QKV, QKV, QKV, MASK), "key mask"),
    (split_scale, (QKV, QKV, QKV), "none"),
]


def _args(structs, fully_masked: bool, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s in structs:
        if s.dtype == jnp.bool_:
            m = rng.random(s.shape) < 0.7
            m[:, 0] = True
            if fully_masked:
                m[1] = False  # batch 1: every key masked
            out.append(jnp.asarray(m))
        else:
            out.append(jnp.asarray(rng.standard_normal(s.shape), jnp.float32))
    return out


@pytest.mark.parametrize("fn,structs,mask", POSITIVE, ids=[f.__name__ for f, *_ in POSITIVE])
def test_torch_spellings_are_rewritten(fn, structs, mask):
    exp = jax.export.export(jax.jit(fn))(*structs)
    new, report = fx.rewrite_and_explain(exp, kernel="blockwise")
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert report.rewrites[0].mask == mask, str(report)
    new = jax.export.deserialize(new.serialize(vjp_order=1))
    # Fully masked rows (where a mask is an input): the guard's zeros, or the
    # finite fill's uniform weights, exactly as the original.
    args = _args(structs, fully_masked=True)
    want = fn(*args)
    assert not np.isnan(np.asarray(want)).any()
    np.testing.assert_allclose(jax.jit(new.call)(*args), want, atol=2e-5)
    args = _args(structs, fully_masked=False, seed=1)

    def loss(f):
        return lambda q, k, v, *rest: jnp.sum(f(q, k, v, *rest) ** 2)

    got = jax.jit(jax.grad(loss(new.call), argnums=(0, 1, 2)))(*args)
    expected = jax.grad(loss(fn), argnums=(0, 1, 2))(*args)
    for g, w in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


# --------------------------------------------------------------------------- near misses


def guard_on_other_scores(q, k, v):
    raw = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), raw * SCALE, -jnp.inf)
    p = jax.nn.softmax(s, -1)
    rows = jnp.all(raw == -jnp.inf, axis=-1, keepdims=True)  # not the softmax's input
    return _out(jnp.where(rows, 0.0, p), v)


def guard_over_queries(q, k, v, mask):
    s = jnp.where(mask[:, None, None, :], _scores(q, k), -jnp.inf)
    p = jax.nn.softmax(s, -1)
    rows = jnp.all(s == -jnp.inf, axis=-2, keepdims=True)  # the wrong axis
    return _out(jnp.where(rows, 0.0, p), v)


def guard_fills_one(q, k, v, mask):
    s = jnp.where(mask[:, None, None, :], _scores(q, k), -jnp.inf)
    p = jax.nn.softmax(s, -1)
    rows = jnp.all(s == -jnp.inf, axis=-1, keepdims=True)
    return _out(jnp.where(rows, 1.0, p), v)  # not a zero


def guard_any_key_masked(q, k, v, mask):
    s = jnp.where(mask[:, None, None, :], _scores(q, k), -jnp.inf)
    p = jax.nn.softmax(s, -1)
    rows = jnp.any(s == -jnp.inf, axis=-1, keepdims=True)  # some key masked, not all
    return _out(jnp.where(rows, 0.0, p), v)


def guard_mixed_fills(q, k, v, mask):
    s = jnp.where(mask[:, None, None, :], _scores(q, k), NEG)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return _out(safe_softmax(s), v)


def guard_after_dense_bias(q, k, v, bias):
    return _out(safe_softmax(_scores(q, k) + bias), v)


NEGATIVE = [
    (guard_on_other_scores, (QKV, QKV, QKV), "other scores"),
    (guard_over_queries, (QKV, QKV, QKV, MASK), "did not mask the scores"),
    (guard_fills_one, (QKV, QKV, QKV, MASK), "non-zero value"),
    (guard_any_key_masked, (QKV, QKV, QKV, MASK), "did not mask the scores"),
    (guard_mixed_fills, (QKV, QKV, QKV, MASK), "both -inf and finite"),
    (
        guard_after_dense_bias,
        (QKV, QKV, QKV, jax.ShapeDtypeStruct((B, H, T, T), jnp.float32)),
        "dense score bias",
    ),
]


@pytest.mark.parametrize("fn,structs,reason", NEGATIVE, ids=[f.__name__ for f, *_ in NEGATIVE])
def test_near_misses_are_kept(fn, structs, reason):
    exp = jax.export.export(jax.jit(fn))(*structs)
    report = fx.explain(exp, kernel="blockwise")
    assert not report.rewrites, str(report)
    assert any(reason in f.reason for f in report.fallbacks), str(report)
