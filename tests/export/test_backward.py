"""The rewritten artifact's derivative (``backward=``): by default the
artifact's own where it carries one, which keeps what its exporter
differentiated (``stop_gradient``: Whisper's frozen sinusoidal positions;
custom derivatives: torchax's embedding padding row), none of which StableHLO's
primal ops hold; ``backward="lifted"`` is the rewritten program's, the
kernels' own backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass.export as fx
from flashpass.kernels.blockwise import BlockwiseKernel

KERNEL = BlockwiseKernel(block_q=16, block_k=16)
B, T, D = 2, 32, 8


def _frozen_positions(x, pos):
    # Positions added under stop_gradient (frozen), then self-attention.
    h = x + jax.lax.stop_gradient(pos)
    s = jnp.einsum("bqd,bkd->bqk", h, h) * D**-0.5
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), h)


def _args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    return x, jnp.asarray(rng.standard_normal((T, D)), jnp.float32)


def _grad_pos(call, args):
    return jax.jit(jax.grad(lambda x, p: jnp.sum(call(x, p) ** 2), argnums=1))(*args)


def test_by_default_the_artifacts_own_derivative_keeps_stop_gradient():
    args = _args()
    exp = jax.export.export(jax.jit(_frozen_positions))(*args)
    new, report = fx.rewrite_and_explain(exp, kernel=KERNEL)
    assert len(report.rewrites) == 1 and report.backward == "artifact", str(report)
    assert "the artifact's own" in str(report)
    np.testing.assert_allclose(
        np.asarray(new.call(*args)), np.asarray(_frozen_positions(*args)), atol=2e-5
    )
    np.testing.assert_array_equal(np.asarray(_grad_pos(new.call, args)), 0.0)


def test_the_lifted_derivative_is_the_kernels_and_loses_stop_gradient():
    args = _args()
    exp = jax.export.export(jax.jit(_frozen_positions))(*args)
    new, report = fx.rewrite_and_explain(exp, kernel=KERNEL, backward="lifted")
    assert report.backward == "lifted", str(report)
    # StableHLO has no stop_gradient: the lifted program differentiates the add.
    assert float(jnp.max(jnp.abs(_grad_pos(new.call, args)))) > 1e-3
    # In the input it is exact, through the kernels' backward.
    want = jax.grad(lambda x, p: jnp.sum(_frozen_positions(x, p) ** 2))(*args)
    got = jax.grad(lambda x, p: jnp.sum(new.call(x, p) ** 2))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_an_artifact_without_a_derivative_gets_the_lifted_one():
    args = _args()
    exp = fx.load(jax.export.export(jax.jit(_frozen_positions))(*args).serialize())
    assert not exp.has_vjp()
    new, report = fx.rewrite_and_explain(exp, kernel=KERNEL)
    assert report.backward == "lifted" and new.has_vjp(), str(report)
    with pytest.raises(ValueError, match="carries no derivative"):
        fx.rewrite(exp, kernel=KERNEL, backward="artifact")


def test_a_serialized_artifact_with_its_derivative_keeps_it():
    args = _args()
    exp = jax.export.export(jax.jit(_frozen_positions))(*args)
    loaded = jax.export.deserialize(exp.serialize(vjp_order=1))
    new = jax.export.deserialize(fx.rewrite(loaded, kernel=KERNEL).serialize(vjp_order=1))
    np.testing.assert_array_equal(np.asarray(_grad_pos(new.call, args)), 0.0)


def test_a_bad_backward_is_refused():
    exp = jax.export.export(jax.jit(_frozen_positions))(*_args())
    with pytest.raises(ValueError, match="backward='kernels'"):
        fx.rewrite(exp, backward="kernels")
