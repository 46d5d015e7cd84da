"""Masks built outside the ``scan`` or ``remat`` body that attends with them.

A stack of layers run as a ``lax.scan`` (Levanter's ``Stacked``), or a layer
under ``jax.checkpoint``, receives the attention mask built once outside as a
body operand: a scan's loop-invariant constant, a remat's operand.  Inside
the body the mask is an input with no producer, so it was read as one dense
``T x S`` array; built in the same scope as the attention, the same mask is
causal plus an O(B·S) key mask.  The mask is now read where it is built
(`Scope.outside`), and its small pieces (the ``[B, S]`` padding) are
threaded into the body as new operands of the scan or remat.  Only an
operand that holds the same value on every iteration is followed: a mask
that is a scan carry or a scanned slice is per-iteration data and stays a
dense operand of the body.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from t_by_s import kernel_operand_shapes, t_by_s_shapes
from test_whole_windows import B, D, H, T, _attend, _padding  # haliax's spelling, sizes

import flashpass
from flashpass import compat
from flashpass.testing import assert_same_function

L = 2


def _x(seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32)


def _w(seed=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((L, 3, D, D)) / np.sqrt(D), jnp.float32)


def _mask(padding, heads=1):
    """``padding & causal``, ``[B, heads, T, T]``."""
    causal = jnp.tril(jnp.ones((T, T), bool))
    return jnp.broadcast_to(padding[:, None, None, :], (B, heads, T, T)) & causal


def _layer(h, w, mask):
    q, k, v = (jnp.einsum("bhtd,de->bhte", h, w[i]) for i in range(3))
    return h + jnp.tanh(_attend(q, k, v, mask))


def _scanned(x, w, padding):
    """Layers as a scan over their weights; the mask built outside, a constant."""
    mask = _mask(padding)

    def body(h, wl):
        return _layer(h, wl, mask), None

    return lax.scan(body, x, w)[0]


def _haliax_scanned(x, w, padding):
    """haliax's layout: ``[Q, B, K]`` built outside, windowed and moved inside."""
    outside = jnp.broadcast_to(padding[None], (T, B, T))
    outside = outside & (jnp.arange(T)[:, None, None] >= jnp.arange(T)[None, None, :])

    def body(h, wl):
        e = lax.dynamic_slice(outside, (0, 0, 0), outside.shape)
        mask = jnp.transpose(jnp.broadcast_to(e[None], (H, T, B, T)), (2, 0, 1, 3))
        return _layer(h, wl, mask), None

    return lax.scan(body, x, w)[0]


def _rematted(x, w, padding):
    """A checkpointed layer; the per-head mask built outside, its operand."""
    mask = _mask(padding, heads=H)
    return jax.checkpoint(_layer)(x, w[0], mask)


def _remat_scanned(x, w, padding):
    """Both: a scan of checkpointed layers (Levanter's ``Stacked`` with remat)."""
    mask = _mask(padding)

    def body(h, wl):
        return jax.checkpoint(_layer)(h, wl, mask), None

    return lax.scan(body, x, w)[0]


def _assert_read_outside(report, sites=1):
    assert len(report.rewrites) == sites and not report.fallbacks, str(report)
    for rewrite in report.rewrites:
        ops = [(op["op"], op.get("shape")) for op in rewrite.spec["score_ops"]]
        assert ("causal", None) in ops, ops
        assert [shape for op, shape in ops if op == "mask"] == [[B, 1, 1, T]], ops  # O(B·S)


def _assert_no_dense_operand(opt, *args):
    shapes = kernel_operand_shapes(opt.rewritten_jaxpr(*args), qkv=False)
    assert shapes and not t_by_s_shapes(shapes, T, T), shapes


FORWARDS = [_scanned, _haliax_scanned, _rematted, _remat_scanned]


def _check_forward(fn, seed):
    args = (_x(seed), _w(seed + 1), _padding())
    opt = flashpass.optimize(fn, kernel="blockwise")
    _assert_read_outside(opt.explain(*args))
    _assert_no_dense_operand(opt, *args)
    assert_same_function(fn, opt, *args, argnums=(0, 1))
    # The first call under jit: the pass runs while jit traces.
    fresh = flashpass.optimize(fn, kernel="blockwise")
    np.testing.assert_allclose(jax.jit(fresh)(*args), jax.jit(fn)(*args), rtol=2e-5, atol=2e-5)


def test_scan_reads_a_mask_built_outside_its_body():
    _check_forward(_scanned, 0)


def test_scan_reads_haliax_layout_built_outside_its_body():
    _check_forward(_haliax_scanned, 2)


def test_remat_reads_a_mask_passed_as_its_operand():
    _check_forward(_rematted, 4)


def test_scan_of_remat_reads_the_mask_two_bodies_out():
    _check_forward(_remat_scanned, 6)


def test_scan_reads_segment_ids_built_outside_its_body():
    """Packed sequences: the segment mask built outside is read as segments,
    its ``[B, T]`` ids threaded into the body, whatever descriptor it is."""

    def fn(x, w, segments):
        same = segments[:, None, :, None] == segments[:, None, None, :]
        mask = same & jnp.tril(jnp.ones((T, T), bool))

        def body(h, wl):
            return _layer(h, wl, mask), None

        return lax.scan(body, x, w)[0]

    segments = jnp.asarray(np.repeat([[0, 1, 2, 3], [0, 0, 1, 1]], T // 4, axis=1), jnp.int32)
    args = (_x(8), _w(9), segments)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    ops = [op["op"] for op in report.rewrites[0].spec["score_ops"]]
    assert "mask" not in ops and "causal" in ops, ops
    _assert_no_dense_operand(opt, *args)
    assert_same_function(fn, opt, *args, argnums=(0, 1))


def _check_training(fn, seed, sites=1):
    def loss(x, w, padding):
        return jnp.sum(fn(x, w, padding) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    args = (_x(seed), _w(seed + 1), _padding())
    opt = flashpass.optimize(step, kernel="blockwise")
    report = opt.explain(*args)
    _assert_read_outside(report, sites)
    # A remat's forward copy outside runs alone; its body recomputes it and
    # runs the backward (docs/how-it-works.md, Training steps).
    passes = sorted(r.passes for r in report.rewrites)
    assert passes == (["forward+backward"] if sites == 1 else ["forward", "forward+backward"])
    _assert_no_dense_operand(opt, *args)
    fresh = jax.jit(flashpass.optimize(step, kernel="blockwise"))
    (got_l, got_g), (want_l, want_g) = fresh(*args), step(*args)
    np.testing.assert_allclose(got_l, want_l, rtol=2e-5)
    for a, b in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_training_step_of_a_scan_with_a_mask_built_outside():
    _check_training(_scanned, 10)


def test_training_step_of_a_remat_with_a_mask_operand():
    _check_training(_rematted, 12, sites=2)


def test_training_step_of_a_scan_of_remat():
    _check_training(_remat_scanned, 14, sites=2)


def _dense_mask(report):
    assert len(report.rewrites) == 1, str(report)
    ops = [(op["op"], op.get("shape")) for op in report.rewrites[0].spec["score_ops"]]
    return [shape for op, shape in ops if op == "mask"]


def test_a_mask_carried_by_the_scan_is_not_read_outside():
    """A carry is per-iteration data (here rolled along the keys each
    iteration): the body reads it as the dense operand it is.  (A carry passed
    on unchanged is no carry: ``lax.scan`` makes it a constant.)"""

    def fn(x, w, padding):
        def body(carry, wl):
            h, mask = carry
            return (_layer(h, wl, mask), jnp.roll(mask, 1, axis=-1)), None

        return lax.scan(body, (x, _mask(padding)), w)[0][0]

    args = (_x(20), _w(21), _padding())
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert _dense_mask(opt.explain(*args)) == [[B, 1, T, T]]
    assert_same_function(fn, opt, *args, argnums=(0, 1))


def test_a_scanned_mask_slice_is_not_read_outside():
    """A mask per layer, scanned over: each iteration gets a different slice."""

    def fn(x, w, padding):
        masks = jnp.stack([_mask(padding), _mask(padding[:, ::-1])])

        def body(h, xs):
            wl, mask = xs
            return _layer(h, wl, mask), None

        return lax.scan(body, x, (w, masks))[0]

    args = (_x(22), _w(23), _padding())
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert _dense_mask(opt.explain(*args)) == [[B, 1, T, T]]
    assert_same_function(fn, opt, *args, argnums=(0, 1))


def test_a_mask_operand_with_no_structure_outside_stays_as_is():
    """A mask that is a plain input outside too: reading it there finds nothing
    smaller, so the body keeps its operand and nothing is threaded in."""

    def fn(x, w, mask):
        def body(h, wl):
            return _layer(h, wl, mask), None

        return lax.scan(body, x, w)[0]

    mask = np.random.default_rng(3).random((B, 1, T, T)) < 0.8
    mask[..., 0] = True
    args = (_x(24), _w(25), jnp.asarray(mask))
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert _dense_mask(opt.explain(*args)) == [[B, 1, T, T]]
    assert_same_function(fn, opt, *args, argnums=(0, 1))
    scan = next(e for e in opt.rewritten_jaxpr(*args).jaxpr.eqns if e.primitive.name == "scan")
    assert compat.scan_counts(scan.params)[0] == 1  # the mask, not more


def test_a_float_operand_is_not_read_outside():
    """An additive bias built outside stays the body's operand (its reading
    outside would thread a floating value, which a gradient may flow to)."""

    def fn(x, w, bias):
        bias4 = jnp.broadcast_to(bias[:, None, None, :], (B, 1, T, T))

        def body(h, wl):
            q, k, v = (jnp.einsum("bhtd,de->bhte", h, wl[i]) for i in range(3))
            s = jnp.einsum("bhqd,bhkd->bhqk", q / jnp.sqrt(float(D)), k) + bias4
            return h + jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v), None

        return lax.scan(body, x, w)[0]

    bias = jnp.asarray(np.random.default_rng(5).standard_normal((B, T)), jnp.float32)
    args = (_x(26), _w(27), bias)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, str(report)
    ops = [(op["op"], op.get("shape")) for op in report.rewrites[0].spec["score_ops"]]
    assert ("bias", [B, 1, T, T]) in ops, ops  # the body's own operand
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))
