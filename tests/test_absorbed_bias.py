"""One bias that is an additive mask plus a term its fill absorbs (BLOOM).

Hugging Face BLOOM adds ``select(mask > 0, 0, finfo.min) + alibi`` to the
scores: a padding-and-causal mask from an int32 attention mask, plus ALiBi
``[B, H, 1, S]`` computed from the mask's cumulative sum.  ``finfo.min + a``
rounds back to ``finfo.min`` for every ``a`` the program can compute (its
interval, from the int32 mask, `patterns.bounds`), so the bias is read as the
mask's descriptors plus ``a`` kept O(S) (patterns/absorbed.py), and the rows
the mask empties (a fully padded row) are ``s + finfo.min``, as written.

Rewritten on the first call under ``jax.jit``, no ``T x S`` kernel operand,
forward and gradient equal to the original's; a training step leaves no
``T x S`` array.  Near misses stay dense and exact: a fill too small to absorb
the term, a term with no provable bound (a float input).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from t_by_s import (
    assert_no_t_by_s,
    kernel_operand_shapes,
    optimized_step,
    t_by_s_shapes,
)

import flashpass
from flashpass.graph import Scope
from flashpass.patterns.bounds import absorbs, interval
from flashpass.testing import assert_same_function

B, H, T, D = 3, 4, 128, 16
MIN = float(np.finfo(np.float32).min)


def _qkv(rng):
    return tuple(jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32) for _ in range(3))


def _mask():
    """``[B, T]`` int32: row 0 whole, row 1 right-padded by 37, row 2 left-padded
    by 50 (its first query rows keep no key under the causal mask)."""
    m = np.ones((B, T), np.int32)
    m[1, T - 37 :] = 0
    m[2, :50] = 0
    return jnp.asarray(m)


def _slopes():
    return jnp.asarray(2.0 ** (-8.0 * np.arange(1, H + 1) / H), jnp.float32)


def _alibi(mask):
    # As BLOOM builds it: positions from the cumulative sum of the mask.
    positions = ((jnp.cumsum(mask, axis=-1) - 1) * mask)[:, None, :]
    return (_slopes()[:, None] * positions)[:, :, None, :]  # [B, H, 1, S]


def _attention(q, k, v, bias):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5 + bias
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def _keep(mask):
    causal = jnp.tril(jnp.ones((T, T), bool))
    return (mask[:, None, None, :] > 0) & causal


def bloom(q, k, v, mask, fill=MIN):
    keep = _keep(mask)
    bias = jax.lax.select(keep, jnp.zeros(keep.shape, jnp.float32), jnp.full(keep.shape, fill))
    return _attention(q, k, v, bias + _alibi(mask))


def bloom_term_first(q, k, v, mask):
    # The term on the left of the sum, and a where in place of the select.
    keep = _keep(mask)
    return _attention(q, k, v, _alibi(mask) + jnp.where(keep, 0.0, MIN))


def _baddbmm_scores(q, k, mask):
    # Torch's BLOOM: alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(d)) over B * H
    # batches, viewed back as [B, H, T, S]: the term is added to the scores.
    q3, k3 = (x.reshape(B * H, T, D) for x in (q, k))
    alibi = _alibi(mask).reshape(B * H, 1, T)
    scores = 1.0 * alibi + D**-0.5 * jnp.einsum("ntd,nsd->nts", q3, k3)
    return scores.reshape(B, H, T, T)


def _weights_times_v(s, v):
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def bloom_torch(q, k, v, mask, fill=MIN):
    # ... then the additive mask added to that sum.
    keep = _keep(mask)
    return _weights_times_v(_baddbmm_scores(q, k, mask) + jnp.where(keep, 0.0, fill), v)


def mask_then_term(q, k, v, mask):
    # The mask added to the scores first, the term after it.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5 + jnp.where(_keep(mask), 0.0, MIN)
    return _weights_times_v(s + _alibi(mask), v)


POSITIVE = {
    "bloom": bloom,
    "term_first": bloom_term_first,
    "torch": bloom_torch,
    "mask_then_term": mask_then_term,
}


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_mask_and_term_become_descriptors(name, rng):
    fn = POSITIVE[name]
    args = (*_qkv(rng), _mask())
    opt = flashpass.optimize(fn, kernel="blockwise")
    got = jax.jit(opt)(*args)  # the first call
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert not report.rewrites[0].dense, str(report)
    np.testing.assert_allclose(got, fn(*args), rtol=2e-5, atol=2e-5)
    assert_no_t_by_s(
        kernel_operand_shapes(opt.rewritten_jaxpr(*args), constants=False, qkv=False), T, T
    )
    assert_same_function(fn, flashpass.optimize(fn, kernel="blockwise"), *args, argnums=(0, 1, 2))


@pytest.mark.parametrize("fn", [bloom, bloom_torch], ids=lambda f: f.__name__)
def test_training_step_leaves_no_t_by_s(fn, rng):
    args = (*_qkv(rng), _mask())
    report, rewritten, original = optimized_step(fn, args)
    assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)
    assert_no_t_by_s(rewritten, T, T, control=original)


def test_absorbs_only_below_a_quarter_unit():
    ulp = 2.0 ** (127 - 23)
    assert absorbs(MIN, (-ulp / 4 * 0.99, ulp / 4 * 0.99), np.float32)
    assert not absorbs(MIN, (0.0, ulp / 4), np.float32)
    assert not absorbs(-1e4, (-1e5, 1e5), np.float32)
    assert not absorbs(MIN, None, np.float32)
    assert not absorbs(float("-inf"), (0.0, 1.0), np.float32)
    # fill + a really does round back to fill at the bound, either sign.
    for a in (ulp / 4 * 0.99, -ulp / 4 * 0.99):
        assert np.float32(MIN) + np.float32(a) == np.float32(MIN)


def _bounds(fn, *args):
    scope = Scope(jax.make_jaxpr(fn)(*args))
    return [interval(scope, out) for out in scope.outputs]


def test_intervals_are_proven_from_dtypes_and_operations():
    m = jnp.ones((2, 8), jnp.int32)
    x = jnp.ones((2, 8), jnp.float32)
    whole = (float(np.iinfo(np.int32).min), float(np.iinfo(np.int32).max))
    found = _bounds(
        lambda m, x: (
            m,  # an int input: its dtype's range
            jnp.cumsum((m > 0).astype(jnp.int32), axis=-1),  # 8 terms of [0, 1]
            jnp.cumsum(m, axis=-1),  # may wrap: the dtype's range
            (m > 0).astype(jnp.float32) * -3.0 + 1.0,
            jnp.abs(jnp.arange(8) - 3),
            x,  # a float input: unbounded
            x * 0.0,  # still unbounded (x may be infinite)
            jnp.exp((m > 0).astype(jnp.float32)),  # no rule: unbounded
        ),
        m,
        x,
    )
    assert found[0] == whole and found[2] == whole
    assert found[1] == (0.0, 8.0)
    lo, hi = found[3]
    assert -2.0 - 1e-5 < lo <= -2.0 and 1.0 <= hi < 1.0 + 1e-5  # widened by rounding
    assert found[4] == (0.0, 4.0)  # folded: by value
    assert found[5:] == [None, None, None]


def bloom_small_term(q, k, v, mask):
    # A fill of -1e9 absorbs |a| <= 5 (below a quarter unit, 16).
    keep = _keep(mask)
    term = (10.0 * _slopes()[:, None] * (mask > 0)[:, None, :])[:, :, None, :]
    return _attention(q, k, v, jnp.where(keep, 0.0, -1e9) + term)


def test_empty_rows_leave_the_absorbed_term_out(rng):
    # Scores about as large as -fill, equal along the keys: an empty row is
    # s + f, small numbers that the term would shift (a uniform row, in the
    # original; the term added after the fill would tilt it toward the keys
    # it raises).
    q, _, v = _qkv(rng)
    q = q.at[..., 0].set(2e5 + 10.0 * q[..., 0])
    k = jnp.zeros((B, H, T, D), jnp.float32).at[..., 0].set(2e4)
    args = (q, k, v, _mask())
    got = _rewritten_without_t_by_s(bloom_small_term, args)
    want = bloom_small_term(*args)
    uniform = np.broadcast_to(np.mean(v[2], axis=1, keepdims=True), (H, 50, D))
    np.testing.assert_allclose(want[2, :, :50], uniform, rtol=1e-5, atol=1e-6)  # as said
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def torch_large_term(q, k, v, mask):
    # The term (up to 250, on the keys the mask keeps) added to the scores
    # before a -1e9 mask (a unit of 64 there): the fill does not absorb it,
    # but it still excludes every key it fills (-1e9 + 250 is far below any
    # kept score).
    keep = _keep(mask)
    term = (1e3 * _slopes()[:, None] * (mask > 0)[:, None, :])[:, :, None, :]
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5 + term
    return _weights_times_v(s + jnp.where(keep, 0.0, -1e9), v)


def test_empty_rows_keep_a_term_added_before_the_mask(rng):
    # An empty row is (s + a) + f in the original: f's rounding keeps the
    # term's steps, so the row's weights go to the keys it raises (not the
    # uniform row of s + f).  The filled call adds the term before the fill.
    args = (*_qkv(rng), _mask())
    got = _rewritten_without_t_by_s(torch_large_term, args)
    want = torch_large_term(*args)
    v = args[2]
    uniform = np.broadcast_to(np.mean(v[2], axis=1, keepdims=True), (H, 50, D))
    assert not np.allclose(want[2, :, :50], uniform, atol=1e-3)  # the term counts there
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    optimized = flashpass.optimize(torch_large_term, kernel="blockwise")
    assert_same_function(torch_large_term, optimized, *args, argnums=(0, 1, 2))


# --------------------------------------------------------------------------- near misses


def small_fill(q, k, v, mask):
    # -1e4 cannot absorb a term up to 1e5: the sum stays one dense bias.
    keep = _keep(mask)
    term = (1e5 * _slopes()[:, None] * mask[:, None, :])[:, :, None, :]
    return _attention(q, k, v, jnp.where(keep, 0.0, -1e4) + term)


def float_term(q, k, v, mask, term):
    # A float input has no bound: it could be anything.
    return _attention(q, k, v, jnp.where(_keep(mask), 0.0, MIN) + term)


def torch_wide_term(q, k, v, mask):
    # Torch's order, but ALiBi from an int32 cumsum may spread over 2**32
    # quarter-units (0.25 * 2**32 > 1e9): a -1e9 mask beside it may no longer
    # exclude a key.
    return bloom_torch(q, k, v, mask, fill=-1e9)


def torch_float_term(q, k, v, mask, term):
    # A float input added to the scores before the mask: no bound.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5 + term
    return _weights_times_v(s + jnp.where(_keep(mask), 0.0, MIN), v)


NEAR_MISSES = [small_fill, float_term, torch_wide_term, torch_float_term]


@pytest.mark.parametrize("fn", NEAR_MISSES, ids=lambda f: f.__name__)
def test_near_misses_stay_dense_and_exact(fn, rng):
    args = (*_qkv(rng), _mask())
    if fn in (float_term, torch_float_term):
        args = (*args, jnp.asarray(rng.standard_normal((B, H, 1, T)), jnp.float32))
    opt = flashpass.optimize(fn, kernel="blockwise")
    got = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    operands = kernel_operand_shapes(opt.rewritten_jaxpr(*args), constants=False, qkv=False)
    assert t_by_s_shapes(operands, T, T), operands  # the sum, one dense bias
    np.testing.assert_allclose(got, fn(*args), rtol=2e-5, atol=2e-5)


def _rewritten_without_t_by_s(fn, args):
    """``fn``'s optimized output, first called under jit, after checking its one
    site is rewritten with no dense operand and no T x S kernel operand."""
    opt = flashpass.optimize(fn, kernel="blockwise")
    got = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.rewrites[0].dense, str(report)
    assert_no_t_by_s(
        kernel_operand_shapes(opt.rewritten_jaxpr(*args), constants=False, qkv=False), T, T
    )
    return got
