"""Elementwise functions a lowering expanded (`flashpass.export.expansions`):
the lifted program's values are the artifact's, bit for bit, and its gradient
is the original function's (JAX's JVP rule), finite where the expansion's own
ops give NaN (0 · inf in an untaken branch).  A subgraph that is no known
function is lifted op by op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from flashpass import compat
from flashpass.export import expansions, ops_flow
from flashpass.export.lift import prepare

SHAPE = (4, 8)
#: Zero (where erfc's and the Bessel functions' expansions divide by x or x²),
#: tiny values, both signs, and values on each side of the expansions' branches.
POINTS = np.array(
    [0.0, 1e-3, -1e-3, 1e-6, 0.25, -0.5, 0.5, 0.9, -0.95, 1.5, -1.5, 2.5, 3.0, -4.0, 6.0, 9.0]
)
UNIT = np.array([0.0, 1e-6, 1e-3, -1e-3, 0.25, -0.5, 0.5, 0.9, -0.95, 0.99, -0.3, 0.7])
POSITIVE = np.array([0.05, 0.3, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.5, 7.0, 11.0, -0.5, -1.5, -2.25])


def _points(values):
    return jnp.asarray(np.resize(values, SHAPE), jnp.float32)


def _lifted(fn):
    exp = jax.export.export(jax.jit(fn))(jax.ShapeDtypeStruct(SHAPE, jnp.float32))
    module = compat.parse_module(exp.mlir_module_serialized, compat.mlir_context())
    lifted = prepare(module).function()
    return exp, lambda x: lifted(x)[0]


def _custom_jvps(fn, x) -> int:
    return str(jax.make_jaxpr(fn)(x)).count("custom_jvp_call")


def _sigmoid(x):  # what another frontend may lower a sigmoid to
    return 1.0 / (1.0 + jnp.exp(-x))


EXPANDED = {
    "erfc": (lax.erfc, POINTS),
    "erf_inv": (lax.erf_inv, UNIT),
    "lgamma": (lax.lgamma, POSITIVE),
    "digamma": (lax.digamma, POSITIVE),
    "bessel_i0e": (lax.bessel_i0e, POINTS),
    "bessel_i1e": (lax.bessel_i1e, POINTS),
    "softplus": (jax.nn.softplus, POINTS),
    "logistic": (_sigmoid, POINTS),
    "gelu": (lambda x: jax.nn.gelu(x, approximate=False), POINTS),
}


def _grad(fn):
    return jax.jit(jax.grad(lambda x: jnp.sum(fn(x))))


@pytest.fixture(autouse=True)
def _composites_as_decompositions(monkeypatch):
    """Each function arrives as its expansion: JAX 0.12 writes erfc as a
    composite (lifted as `lax.erfc` itself, `tests/export/test_composites.py`)
    whose decomposition is the expansion JAX 0.10 writes in place."""
    monkeypatch.setattr(ops_flow, "_COMPOSITES", {})


@pytest.mark.parametrize("name", list(EXPANDED))
def test_an_expanded_function_is_identified(name):
    fn, points = EXPANDED[name]
    x = _points(points)
    exp, lifted = _lifted(fn)
    if name == "lgamma" and "call @" in exp.mlir_module():
        pytest.skip("JAX 0.12 writes lgamma with calls to helper functions: not identified")
    assert _custom_jvps(lifted, x) == 1, f"{name} not identified"
    np.testing.assert_array_equal(jax.jit(lifted)(x), exp.call(x))  # the artifact's values
    want = _grad(fn)(x)
    if name == "logistic":  # 1 / (1 + exp(-x)) itself: the gradient of lax.logistic
        want = _grad(lax.logistic)(x)
    got = _grad(lifted)(x)
    assert np.all(np.isfinite(got) == np.isfinite(want)), (got, want)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_the_expansion_alone_gives_nan(monkeypatch):
    """Why: erfc's expansion differentiated op by op (nothing identified)."""
    monkeypatch.setattr(expansions, "KNOWN", ())
    _, lifted = _lifted(lax.erfc)
    got = _grad(lifted)(_points(POINTS))
    assert np.isnan(got[0, 0]), got  # at 0: 0 · inf in the untaken branch


@pytest.mark.parametrize(
    "fn",
    [
        # tanh's Padé approximant, clipped: close to tanh, but not within 16 ulps
        lambda x: jnp.clip(x * (27.0 + x * x) / (27.0 + 9.0 * x * x), -1.0, 1.0),
        # erfc's inputs scaled: erfc(x / 2) is no function of the table
        lambda x: lax.erfc(x * 0.5) * 3.0 + 1.0,
        # a piecewise function of one input
        lambda x: jnp.where(x > 0, x * x * 0.5 + x, 1.0 / (x * x + 1.0)),
    ],
    ids=["pade_tanh", "scaled_erfc", "piecewise"],
)
def test_a_subgraph_that_is_no_known_function_is_left_alone(fn):
    x = _points(POINTS)
    exp, lifted = _lifted(fn)
    inner = 1 if "erfc" in str(jax.make_jaxpr(fn)(x)) else 0  # erfc's own region only
    assert _custom_jvps(lifted, x) == inner
    np.testing.assert_array_equal(jax.jit(lifted)(x), exp.call(x))
    np.testing.assert_allclose(_grad(lifted)(x), _grad(fn)(x), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_narrow_dtype_expansion_is_identified(dtype):
    """A 16-bit erfc computes in float32 inside and rounds: still erfc."""

    def gelu(x):
        return jax.nn.gelu(x, approximate=False)

    x = _points(POINTS).astype(dtype)
    exp = jax.export.export(jax.jit(gelu))(jax.ShapeDtypeStruct(SHAPE, dtype))
    module = compat.parse_module(exp.mlir_module_serialized, compat.mlir_context())
    lifted = prepare(module).function()
    assert _custom_jvps(lambda x: lifted(x)[0], x) == 1
    np.testing.assert_array_equal(jax.jit(lifted)(x)[0], exp.call(x))
    got = _grad(lambda x: lifted(x)[0].astype(jnp.float32))(x)
    want = _grad(lambda x: gelu(x).astype(jnp.float32))(x)
    np.testing.assert_array_equal(got, want)
