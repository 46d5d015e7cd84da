"""Masked scores shifted by a constant: ``where(keep, s, s - 1e9)``.

Keras' ``Attention`` layer (and code written like it) does not replace the
masked scores with a fill: it shifts them, ``where(mask, s, s - 1e9)``.  That
is the additive mask ``s + where(mask, 0, -1e9)``, exactly, value and
gradient, in every row (a row with every key masked computes the original's
``softmax(s - 1e9)``).  The reading: a ``select`` whose other branch is the
scores plus an excluding scalar constant is that additive mask, read as
descriptors (a key mask stays O(B·S), a triangle is causal).  Near misses
(a shift that does not exclude, a branch that is other scores) are kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.testing import assert_same_function

B, T, H, D = 2, 32, 2, 8


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))


def _attend(q, k, v, keep, shift=-1e9, other=None):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    masked = (s if other is None else other(s)) + shift
    p = jax.nn.softmax(jnp.where(keep, s, masked), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _key_mask(lengths):
    return (jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None])[:, None, None, :]


@pytest.mark.parametrize("lengths", [(T, 20), (T, 0)], ids=["padded", "an empty example"])
def test_key_mask_shift_is_an_additive_key_mask(lengths):
    """A key mask from the inputs reaches the kernel as an O(B·S) mask; an
    example with no key at all computes the original's shifted softmax."""

    def fn(q, k, v, keep):
        return _attend(q, k, v, keep)

    args = (*_qkv(), _key_mask(lengths))
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    ops = [op["op"] for op in report.rewrites[0].spec["score_ops"]]
    assert "mask" in ops and "emptyrows" in ops, ops
    masks = [op["shape"] for op in report.rewrites[0].spec["score_ops"] if op["op"] == "mask"]
    assert all(shape[2] == 1 for shape in masks), masks  # [B, 1, 1, S], never T x S
    assert not report.rewrites[0].dense, str(report)
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


def test_causal_shift_is_causal():
    def fn(q, k, v):
        return _attend(q, k, v, jnp.tril(jnp.ones((T, T), bool)), shift=-1e4)

    args = _qkv(1)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and report.rewrites[0].causal, str(report)
    assert_same_function(fn, opt, *args)


def test_shift_subtracted_from_a_broadcast_constant_side():
    """``s - c`` read with the constant as the subtrahend; ``c - s`` is no shift."""

    def fn(q, k, v, keep):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = jax.nn.softmax(jnp.where(keep, s, s - jnp.float32(1e9)), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    args = (*_qkv(2), _key_mask((T, 9)))
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert len(opt.explain(*args).rewrites) == 1
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


@pytest.mark.parametrize(
    ("shift", "other"),
    [
        pytest.param(-1.0, None, id="a shift that does not exclude"),
        pytest.param(-1e9, lambda s: 2.0 * s, id="the shifted branch is other scores"),
        pytest.param(-1e9, lambda s: -s, id="negated scores shifted"),
    ],
)
def test_near_misses_are_kept(shift, other):
    def fn(q, k, v, keep):
        return _attend(q, k, v, keep, shift=shift, other=other)

    args = (*_qkv(3), _key_mask((T, 20)))
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert not report.rewrites and len(report.fallbacks) == 1, str(report)
    np.testing.assert_array_equal(np.asarray(opt(*args)), np.asarray(jax.jit(fn)(*args)))


def test_training_step_keeps_no_t_by_s():
    """The shifted key mask in a gradient: the backward is the kernel's too."""
    from t_by_s import assert_no_t_by_s, jaxpr_shapes

    def loss(q, k, v, keep):
        return jnp.sum(jnp.square(_attend(q, k, v, keep)))

    args = (*_qkv(4), _key_mask((T, 20)))
    grad = jax.grad(loss, argnums=(0, 1, 2))
    opt = flashpass.optimize(grad, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and report.rewrites[0].backward, str(report)
    shapes = jaxpr_shapes(opt.rewritten_jaxpr(*args), outside_kernels=True)
    assert_no_t_by_s(shapes, T, T, control=jaxpr_shapes(jax.make_jaxpr(grad)(*args)))
    for a, b in zip(opt(*args), grad(*args), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
