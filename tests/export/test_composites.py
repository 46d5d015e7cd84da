"""``stablehlo.composite`` in an artifact: JAX lowers ``lax.top_k`` to one (a
Mixture-of-Experts router beside every attention), and ``lax.erf``,
``jnp.sinh``, ``jnp.arcsin``, ... (``chlo.erf`` with a decomposition function),
and libraries wrap ops in their own.  A known one is lifted as its `lax`
function (values the artifact's, bit for bit, the gradient the function's), any
other as its ``decomposition``; an island of a composite carries that function
along (a module without it does not verify)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import flashpass.export as fx
from flashpass import compat
from flashpass.export import islands
from flashpass.export.lift import prepare
from flashpass.kernels.blockwise import BlockwiseKernel

KERNEL = BlockwiseKernel(block_q=16, block_k=16)
B, T, H, D, E = 2, 32, 2, 8, 4


def _args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, T, H * D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((H * D, E)) / 4, jnp.float32)
    return x, w


def _routed_attention(x, w):
    """Self-attention, then a top-2 router over its output (MoE-style)."""
    q = x.reshape(B, T, H, D)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, q) * D**-0.5
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), q).reshape(B, T, H * D)
    weights, experts = jax.lax.top_k(jax.nn.softmax(o @ w, axis=-1), 2)
    return o * jnp.sum(weights, -1, keepdims=True), experts


def _export(fn, *args):
    return jax.export.export(jax.jit(fn))(*args)


@pytest.mark.parametrize("route", ["lift", "splice"])
def test_top_k_beside_an_attention_is_lifted_and_the_site_rewritten(route):
    args = _args()
    exp = _export(_routed_attention, *args)
    assert "chlo.top_k" in exp.mlir_module()  # the composite this test is about
    new, report = fx.rewrite_and_explain(exp, route=route, kernel=KERNEL)
    assert report.route == route and len(report.rewrites) == 1, str(report)
    assert not report.islands, str(report)
    (out, experts), (want, want_experts) = new.call(*args), _routed_attention(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(want_experts))


def test_top_k_gradient_through_the_lifted_artifact():
    args = _args()
    new = fx.rewrite(_export(_routed_attention, *args), kernel=KERNEL, backward="lifted")

    def loss(call):
        return lambda x, w: jnp.sum(call(x, w)[0] ** 2)

    got = jax.jit(jax.grad(loss(new.call), argnums=(0, 1)))(*args)
    want = jax.grad(loss(_routed_attention), argnums=(0, 1))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-4, rtol=1e-4)


def _quick_gelu(y):
    return y * jax.nn.sigmoid(1.702 * y)


def _gelu_composite(x):
    # A library's own composite: a name no lowering knows, its decomposition the meaning.
    return jax.lax.composite(_quick_gelu, name="mylib.quick_gelu")(x)


def _attention_with_composite(x, w, gelu=_gelu_composite):
    q = gelu(x).reshape(B, T, H, D)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, q) * D**-0.5
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), q)


def test_an_unknown_composite_is_lifted_through_its_decomposition():
    args = _args()
    exp = _export(_attention_with_composite, *args)
    assert "mylib.quick_gelu" in exp.mlir_module()
    new, report = fx.rewrite_and_explain(exp, kernel=KERNEL, backward="lifted")
    assert len(report.rewrites) == 1 and not report.islands, str(report)
    np.testing.assert_allclose(
        np.asarray(new.call(*args)), np.asarray(_attention_with_composite(*args)), atol=2e-5
    )
    # Lifted, not an island: it has a derivative (JAX's composite has none; the
    # reference differentiates the decomposition itself).
    loss = lambda call: lambda x, w: jnp.sum(call(x, w) ** 2)  # noqa: E731
    got = jax.grad(loss(new.call))(*args)
    want = jax.grad(loss(lambda x, w: _attention_with_composite(x, w, _quick_gelu)))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-4, rtol=1e-4)


def test_an_island_of_a_composite_carries_its_decomposition():
    x = _args()[0]
    exp = _export(lambda y: jax.lax.top_k(y, 3), x)
    ir = compat.ir_module()
    ctx = compat.mlir_context()
    with ctx:
        module = compat.parse_module(exp.mlir_module(), ctx)
        funcs = {
            ir.StringAttr(f.attributes["sym_name"]).value: f
            for f in module.body.operations
            if f.operation.name == "func.func"
        }
        (op,) = [
            o
            for o in funcs["main"].regions[0].blocks[0].operations
            if o.operation.name == "stablehlo.composite"
        ]
        values, indices = islands.call_island(op, [x], ("cpu",), funcs)
    want_values, want_indices = jax.lax.top_k(x, 3)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))


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
