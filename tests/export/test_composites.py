"""``stablehlo.composite``: what `jax.export` writes for ``lax.erf``, ``jnp.sinh``,
``jnp.arcsin``, ... (a composite ``chlo.erf`` with a decomposition function).
A known one is lifted as its `lax` function, any other as its decomposition;
values are the artifact's, bit for bit, and the gradient is the function's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from flashpass import compat
from flashpass.export.lift import prepare

SHAPE = (4, 8)
POINTS = np.array([0.0, 1e-3, -1e-3, 0.25, -0.5, 0.5, 0.9, -0.95, 0.7, -0.3, 0.1, -0.85])


def _points(values):
    return jnp.asarray(np.resize(values, SHAPE), jnp.float32)


def _lifted(fn):
    exp = jax.export.export(jax.jit(fn))(jax.ShapeDtypeStruct(SHAPE, jnp.float32))
    module = compat.parse_module(exp.mlir_module_serialized, compat.mlir_context())
    lifted = prepare(module)
    return exp, lifted, lambda x: lifted.function()(x)[0]


def _grad(fn):
    return jax.jit(jax.grad(lambda x: jnp.sum(fn(x))))


@pytest.mark.parametrize(
    "fn",
    [lax.erf, lax.erfc, jnp.sinh, jnp.cosh, jnp.arcsin, jnp.arccos, jnp.arcsinh, jnp.arctanh],
)
def test_a_composite_is_lifted_as_its_function(fn):
    """``jax.export`` writes these as ``stablehlo.composite "chlo.erf"`` with a
    decomposition function: lifted as the `lax` function (not an island)."""
    x = _points(POINTS)
    exp, module, lifted = _lifted(fn)
    if "stablehlo.composite" not in exp.mlir_module():
        pytest.skip("this JAX expands it (0.10: erfc; 0.12: arcsin)")
    np.testing.assert_array_equal(jax.jit(lifted)(x), exp.call(x))
    assert not module.islands  # not an island (whose clone lacked the decomposition)
    np.testing.assert_allclose(_grad(lifted)(x), _grad(fn)(x), rtol=1e-6)


def test_an_unknown_composite_is_its_decomposition():
    def fn(x):
        return lax.composite(lambda x: jnp.sin(x) * 2.0, name="my.twice_sin")(x)

    x = _points(POINTS)
    exp, module, lifted = _lifted(fn)
    assert 'stablehlo.composite "my.twice_sin"' in exp.mlir_module()
    np.testing.assert_array_equal(jax.jit(lifted)(x), exp.call(x))
    np.testing.assert_allclose(_grad(lifted)(x), 2.0 * jnp.cos(x), rtol=1e-6)
