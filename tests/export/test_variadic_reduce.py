"""A general ``reduce`` of float and integer operands (what ``argmax`` and
``argmin`` lower to) lifted with a derivative: JAX's own JVP of a general
``lax.reduce`` fails on an integer operand's symbolic-zero tangent."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass.export as fx
from flashpass import compat

_X = jnp.asarray([[1.0, 3.0, 2.0, 3.0], [0.5, -1.0, 4.0, 0.0], [2.0, 1.0, -2.0, 0.0]], jnp.float32)


def _lifted(fn, *args):
    exp = jax.export.export(jax.jit(fn))(*args)
    module = fx.prepare(compat.parse_module(exp.mlir_module_serialized, compat.mlir_context()))
    return module.function(0, ("cpu",)), module


@pytest.mark.parametrize("arg", [jnp.argmax, jnp.argmin], ids=["argmax", "argmin"])
@pytest.mark.parametrize("axis", [0, 1])
def test_argmax_lifted_has_the_originals_gradient(arg, axis):
    def fn(x):
        i = arg(x * x, axis=axis)
        picked = jnp.take_along_axis(x, jnp.expand_dims(i, axis), axis=axis)
        return jnp.sum(picked**3) + jnp.sum(jnp.sin(x) * jnp.expand_dims(i, axis))

    lifted, module = _lifted(fn, _X)
    np.testing.assert_allclose(lifted(_X)[0], fn(_X), rtol=1e-6)
    got = jax.jit(jax.grad(lambda x: lifted(x)[0]))(_X)
    assert not module.islands
    np.testing.assert_allclose(got, jax.grad(fn)(_X), rtol=1e-6)


def _max_and_position(x):
    """A reduce whose float result is used too: the max and its first position."""

    def body(a, b):
        (va, ia), (vb, ib) = a, b
        take_a = (va > vb) | ((va == vb) & (ia < ib))
        return jnp.where(take_a, va, vb), jnp.where(take_a, ia, ib)

    positions = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    init = (jnp.float32(-jnp.inf), jnp.int32(0))
    return jax.lax.reduce((x, positions), init, body, (1,))


def test_the_float_result_of_a_mixed_reduce_has_its_derivative():
    lifted, _ = _lifted(_max_and_position, _X)
    values, positions = lifted(_X)
    np.testing.assert_array_equal(values, _X.max(axis=1))
    np.testing.assert_array_equal(positions, [1, 2, 0])
    grad = jax.grad(lambda x: jnp.sum(lifted(x)[0] * jnp.asarray([1.0, 2.0, 3.0])))(_X)
    want = np.zeros(_X.shape, np.float32)
    want[[0, 1, 2], [1, 2, 0]] = [1.0, 2.0, 3.0]
    np.testing.assert_array_equal(grad, want)
