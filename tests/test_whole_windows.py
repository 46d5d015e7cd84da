"""Masks read through a window over the whole operand.

A ``dynamic_slice`` whose window is the operand's whole shape is an identity
whatever its start indices: a start is clamped to ``[0, extent - size]``,
here ``[0, 0]``.  So is a ``slice`` from 0 to each extent with unit strides.
haliax (Levanter's named-tensor library) materialises every attention mask
that way (``mask[QPos, dslice(0, QPos.size), KPos, dslice(0, KPos.size)]``):
the per-example padding it carries, ``[B, S]`` broadcast over the queries,
was read as a dense ``T x S`` operand instead of an O(B·S) key mask, and a
causal triangle inside it was not read as causal.  Read through the window,
both are descriptors; a window that really cuts the operand is not looked
through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import flashpass
from flashpass.testing import assert_same_function

B, T, H, D = 2, 32, 2, 8


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32) for _ in range(3))


def _padding():
    return jnp.arange(T)[None, :] < jnp.asarray([T, 20])[:, None]


def _attend(q, k, v, mask):
    """haliax's ``dot_product_attention``: a pre-scaled q, ``where(mask, s, -1e9)``."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q / jnp.sqrt(float(D)), k)
    s = jnp.where(mask, s, -1e9)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def _haliax_mask(padding, start, causal=True, window=lax.dynamic_slice):
    """``causal & padding`` as haliax lays it out, ``[Q, B, K]``, windowed over
    its whole extent, then broadcast over heads and moved to ``[B, H, Q, K]``."""
    full = jnp.broadcast_to(padding[None], (T, B, T))
    if causal:
        full = full & (jnp.arange(T)[:, None, None] >= jnp.arange(T)[None, None, :])
    if window is lax.dynamic_slice:
        full = lax.dynamic_slice(full, (start, start, start), full.shape)
    else:
        full = lax.slice(full, (0, 0, 0), full.shape)
    return jnp.transpose(jnp.broadcast_to(full[None], (H, T, B, T)), (2, 0, 1, 3))


def _ops(report):
    return [(op["op"], op.get("shape")) for op in report.rewrites[0].spec["score_ops"]]


def _assert_key_mask_and_causal(report, causal=True):
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    ops = _ops(report)
    assert (("causal", None) in ops) == causal, ops
    assert [shape for op, shape in ops if op == "mask"] == [[B, 1, 1, T]], ops  # O(B·S)
    assert "masks kept as dense arrays" not in str(report), str(report)


def test_whole_dynamic_slice_of_a_mask_is_read_through():
    def fn(q, k, v, padding):
        return _attend(q, k, v, _haliax_mask(padding, 0))

    args = (*_qkv(), _padding())
    opt = flashpass.optimize(fn, kernel="blockwise")
    _assert_key_mask_and_causal(opt.explain(*args))
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


def test_whole_dynamic_slice_at_a_traced_nonzero_start_is_the_operand():
    """The start is clamped to 0 whatever it is (here 5, traced): the window
    is still the whole mask, and the rewrite computes the original's values."""

    def fn(q, k, v, padding, start):
        return _attend(q, k, v, _haliax_mask(padding, start))

    args = (*_qkv(1), _padding(), jnp.int32(5))
    opt = flashpass.optimize(fn, kernel="blockwise")
    _assert_key_mask_and_causal(opt.explain(*args))
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


def test_whole_slice_of_a_mask_is_read_through():
    def fn(q, k, v, padding):
        return _attend(q, k, v, _haliax_mask(padding, 0, causal=False, window=lax.slice))

    args = (*_qkv(2), _padding())
    opt = flashpass.optimize(fn, kernel="blockwise")
    _assert_key_mask_and_causal(opt.explain(*args), causal=False)
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


def test_training_step_through_a_whole_window_is_forward_and_backward():
    def loss(q, k, v, padding):
        return jnp.sum(_attend(q, k, v, _haliax_mask(padding, 0)) ** 2)

    step = jax.value_and_grad(loss, argnums=(0, 1, 2))
    args = (*_qkv(3), _padding())
    opt = flashpass.optimize(step, kernel="blockwise")
    report = opt.explain(*args)
    _assert_key_mask_and_causal(report)
    assert report.rewrites[0].passes == "forward+backward", str(report)
    (got_l, got_g), (want_l, want_g) = jax.jit(opt)(*args), jax.jit(step)(*args)
    np.testing.assert_allclose(got_l, want_l, rtol=2e-5)
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_window_that_cuts_the_mask_is_not_looked_through():
    """A window of the last ``T`` of ``2T`` keys at a traced start selects
    keys the un-sliced mask does not line up with: it is not an identity, so
    the site reads the sliced mask (any structure it proves), never the
    operand's, and keeps the original's values."""

    def fn(q, k, v, wide, start):
        keys = lax.dynamic_slice(wide, (0, start), (B, T))
        mask = jnp.broadcast_to(keys[:, None, None, :], (B, H, T, T))
        return _attend(q, k, v, mask)

    wide = jnp.arange(2 * T)[None, :] < jnp.asarray([2 * T, T + 7])[:, None]
    args = (*_qkv(4), wide, jnp.int32(T))
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, str(report)
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))
