"""Attention inside a user's ``shard_map`` body is rewritten there (8 CPU devices).

The body is a tensor-parallel layer: per-device attention over the local
heads, then a ``psum`` over the head axis (as a row-parallel projection
does), with ``check_vma=True`` (JAX's default).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from sharded_testing import (
    P,
    assert_like_original,
    collectives,
    mesh,
    normal,
    put,
    run,
    unsharded,
)
from test_ring import _in_body
from test_sharded_jit import mha

import flashpass

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")

SPEC = P("data", None, "model")


def layer(q, k, v):
    o = mha(q, k, v)
    return o + jax.lax.psum(jnp.mean(o, axis=2, keepdims=True), "model")


def model(m, q, k, v):
    return jax.shard_map(layer, mesh=m, in_specs=SPEC, out_specs=SPEC)(q, k, v)


def unsharded_model(n_model, q, k, v):
    """`model` on one device: the per-device head means summed over the model axis."""
    o = mha(q, k, v)
    b, t, h, d = o.shape
    means = o.reshape(b, t, n_model, h // n_model, d).mean(axis=3)
    return o + means.sum(axis=2, keepdims=True)


BLOCKWISE = ("blockwise", (2, 4), (2, 64, 8, 16))
PALLAS = ("pallas_tpu", (2, 2), (2, 128, 2, 32))  # one batch element and head per device


@pytest.mark.parametrize(
    "kernel, mesh_shape, qshape, explicit",
    [
        pytest.param(*BLOCKWISE, True, id="blockwise-explicit_axes"),
        pytest.param(*BLOCKWISE, False, id="blockwise-auto_axes"),
        pytest.param(*PALLAS, False, id="pallas_tpu-auto_axes"),
        # The same per-device path as with Auto axes; -m slow runs it.
        pytest.param(*PALLAS, True, id="pallas_tpu-explicit_axes", marks=pytest.mark.slow),
    ],
)
def test_site_inside_shard_map(kernel, mesh_shape, qshape, explicit):
    m = mesh(mesh_shape, ("data", "model"), explicit=explicit)
    fn = functools.partial(model, m)
    args = [put(m, SPEC, normal(i, qshape)) for i in range(3)]
    opt = flashpass.optimize(fn, kernel=kernel, interpret=kernel == "pallas_tpu")
    with jax.set_mesh(m):
        report = opt.explain(*args)
        assert report.kernels == [kernel], str(report)
        assert report.rewrites[0].scope.startswith("shard_map body"), report.rewrites[0].scope
        got, orig = run(opt, args), run(fn, args)
    ref = run(functools.partial(unsharded_model, mesh_shape[1]), unsharded(args))
    assert_like_original(got, orig, ref)


@pytest.mark.parametrize(
    "kernel, mesh_shape, qshape, explicit",
    [
        pytest.param(*BLOCKWISE, True, id="blockwise-explicit_axes"),
        pytest.param(*BLOCKWISE, False, id="blockwise-auto_axes"),
        pytest.param(*PALLAS, False, id="pallas_tpu-auto_axes"),
    ],
)
def test_optimized_function_called_inside_shard_map(kernel, mesh_shape, qshape, explicit):
    """The user's shard_map calls the optimized layer (not the other way round):
    the pass sees per-shard shapes with varying manual axes and rewrites there."""
    m = mesh(mesh_shape, ("data", "model"), explicit=explicit)
    opt_layer = flashpass.optimize(layer, kernel=kernel, interpret=kernel == "pallas_tpu")

    def opt_model(q, k, v):
        return jax.shard_map(opt_layer, mesh=m, in_specs=SPEC, out_specs=SPEC)(q, k, v)

    args = [put(m, SPEC, normal(i, qshape)) for i in range(3)]
    with jax.set_mesh(m):
        got, orig = run(opt_model, args), run(functools.partial(model, m), args)
    (report,) = opt_layer.reports
    assert report.kernels == [kernel] and not report.fallbacks and not report.errors, str(report)
    b, t, h, d = qshape
    local = (b // mesh_shape[0], t, h // mesh_shape[1], d)
    assert report.rewrites[0].q_shape == local  # per-shard shapes
    ref = run(functools.partial(unsharded_model, mesh_shape[1]), unsharded(args))
    assert_like_original(got, orig, ref)


def test_train_step_in_shard_map_with_gathered_kv():
    """A train step inside the user's shard_map (check_vma) whose k and v are
    all-gathered over the sequence axis and masked causally on axis_index
    positions: rewritten forward and backward as a ring (the gathers' backward,
    reduce-scatters, is proven from the local k and v and replaced), no
    all-gather or reduce-scatter left, gradients equal the original's."""
    m = mesh((4,), ("seq",))
    spec = P(None, "seq")
    args = [put(m, spec, normal(i, (2, 32, 2, 16))) for i in range(3)]
    attend = _in_body(causal=True)

    def body(q, k, v):
        loss = lambda *a: jnp.sum(attend(*a) ** 2)  # noqa: E731
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
        return jax.lax.psum(value, "seq"), grads

    step = jax.shard_map(body, mesh=m, in_specs=spec, out_specs=(P(), (spec,) * 3))
    opt = flashpass.optimize(step, kernel="blockwise")
    with jax.set_mesh(m):
        report = opt.explain(*args)
        got, want = jax.jit(opt)(*args), jax.jit(step)(*args)
        hlo = jax.jit(opt).lower(*args).compile().as_text()
    assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)
    assert report.kernels == ["ring"], str(report)
    kinds = {kind for kind, _, _ in collectives(hlo)}
    assert "collective-permute" in kinds and not kinds & {"all-gather", "reduce-scatter"}, kinds
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = max(1.0, float(jnp.abs(w).max()))
        assert float(jnp.abs(g - w).max()) <= 2e-5 * scale
