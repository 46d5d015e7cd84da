"""Loading every input form, opaque islands, artifacts kept with a reason."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from variants import VARIANTS

import flashpass.export as fx
from flashpass import compat


def _exported(fn, *structs, **kwargs):
    return jax.export.export(jax.jit(fn), **kwargs)(*structs)


@pytest.mark.parametrize("form", ["serialized", "artifact", "text", "text-bytes", "bytecode"])
def test_load_every_form(form):
    variant = VARIANTS[1]
    exp = _exported(variant.fn, *variant.structs())
    if form == "serialized":
        data = exp.serialize()
    elif form == "artifact":
        data = exp.mlir_module_serialized
    elif form == "text":
        data = exp.mlir_module()
    elif form == "text-bytes":
        data = exp.mlir_module().encode()
    else:
        module = compat.parse_module(exp.mlir_module(), compat.mlir_context())
        data = compat.module_bytecode(module)
    loaded = fx.load(data)
    assert [(a.shape, a.dtype) for a in loaded.in_avals] == [
        (a.shape, a.dtype) for a in exp.in_avals
    ]
    assert loaded.platforms == exp.platforms
    args = variant.args()
    np.testing.assert_allclose(loaded.call(*args), variant.fn(*args), atol=1e-6)
    assert len(fx.explain(loaded, kernel="blockwise").rewrites) == 1


def test_load_rejects_what_is_not_a_module():
    with pytest.raises(ValueError, match="neither"):
        fx.load(b"\xff\xfe\x00 junk")
    with pytest.raises(ValueError, match="could not parse"):
        fx.load("this is not MLIR")


def _attention_and_popcount(q, k, v, n):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    return o, lax.population_count(n)


def test_an_unknown_op_is_an_island_reported_and_kept():
    qkv = jax.ShapeDtypeStruct((1, 128, 2, 16), jnp.float32)
    n = jax.ShapeDtypeStruct((4,), jnp.int32)
    exp = _exported(_attention_and_popcount, qkv, qkv, qkv, n)
    assert "stablehlo.popcnt" not in fx.rule_names()
    new, report = fx.rewrite_and_explain(exp, kernel="blockwise")
    assert [i.op for i in report.islands] == ["stablehlo.popcnt"]
    assert "opaque island: stablehlo.popcnt" in str(report)
    assert report.to_dict()["islands"][0]["op"] == "stablehlo.popcnt"
    assert len(report.rewrites) == 1, str(report)  # the site next to it is rewritten
    args = [jnp.ones((1, 128, 2, 16))] * 3 + [jnp.arange(4, dtype=jnp.int32)]
    got = jax.jit(new.call)(*args)
    want = _attention_and_popcount(*args)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], atol=1e-6)


def test_a_custom_call_is_an_island():
    exp = _exported(jnp.linalg.cholesky, jax.ShapeDtypeStruct((4, 4), jnp.float32))
    new, report = fx.rewrite_and_explain(exp)
    assert report.islands and report.islands[0].op == "stablehlo.custom_call", str(report)
    a = jnp.eye(4) * 4.0 + 1.0
    np.testing.assert_allclose(new.call(a), jnp.linalg.cholesky(a), atol=1e-6)


def test_sort_is_lifted():
    exp = _exported(lambda x: jnp.sort(x), jax.ShapeDtypeStruct((8,), jnp.int32))
    new, report = fx.rewrite_and_explain(exp)
    assert report.route == "lift" and not report.islands, str(report)
    x = jnp.asarray([3, -7, 0, -1, 9, 2, 2, 1], jnp.int32)
    np.testing.assert_array_equal(new.call(x), exp.call(x))


def test_bitcast_convert_and_count_leading_zeros_are_lifted():
    """JAX 0.12 writes ``lax.lgamma`` with both (a software ``log``)."""

    def fn(x):
        bits = lax.bitcast_convert_type(x, jnp.int32)
        return lax.bitcast_convert_type(bits + lax.clz(bits), jnp.float32)

    exp = _exported(fn, jax.ShapeDtypeStruct((8,), jnp.float32))
    new, report = fx.rewrite_and_explain(exp)
    assert report.route == "lift" and not report.islands, str(report)
    x = jnp.asarray([0.0, -0.0, 1.5, -2.0, 3e-39, 7.0, -1e30, 0.25], jnp.float32)
    np.testing.assert_array_equal(new.call(x), exp.call(x))


def test_a_float_sort_on_two_keys_is_an_island_with_its_comparator():
    """JAX's float comparator (NaN and -0 made canonical, then a total order) on
    two keys has no rule and reads constants from around the sort: the island
    takes them as arguments.  (One key is lifted: tests/export/test_sort.py.)"""
    s = jax.ShapeDtypeStruct((8,), jnp.float32)
    exp = _exported(_two_key_sort, s, s)
    new, report = fx.rewrite_and_explain(exp)
    assert report.route == "lift", str(report)
    assert [i.op for i in report.islands] == ["stablehlo.sort"], str(report)
    x = jnp.asarray([3.0, -0.0, 0.0, -1.0, jnp.nan, 2.0, -jnp.inf, 1.0])
    y = jnp.asarray([0.0, 2.0, 1.0, 0.0, 1.0, 3.0, 1.0, 1.0])
    for got, want in zip(new.call(x, y), exp.call(x, y), strict=True):
        np.testing.assert_array_equal(got, want)


def _two_key_sort(x, y):
    return lax.sort((x, y), num_keys=2)


def test_an_op_with_regions_and_no_rule_is_an_island():
    """A sort on two keys (a comparator lax.sort's one-key rule does not read)
    is cloned with its comparator region into a module of its own."""
    s = jax.ShapeDtypeStruct((8,), jnp.int32)
    exp = _exported(_two_key_sort, s, s)
    new, report = fx.rewrite_and_explain(exp)
    assert report.route == "lift", str(report)
    assert [i.op for i in report.islands] == ["stablehlo.sort"], str(report)
    x = jnp.asarray([3, 1, 3, 0, 1, 2, 0, 3], jnp.int32)
    y = jnp.asarray([5, 4, 3, 2, 1, 0, 7, 6], jnp.int32)
    for got, want in zip(new.call(x, y), _two_key_sort(x, y), strict=True):
        np.testing.assert_array_equal(got, want)


_CASE = """
func.func public @main(%arg0: tensor<i32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
  %c = stablehlo.constant dense<2.0> : tensor<4xf32>
  %m = stablehlo.multiply %arg1, %c : tensor<4xf32>
  %0 = "stablehlo.case"(%arg0) ({
    stablehlo.return %m : tensor<4xf32>
  }, {
    %1 = stablehlo.add %m, %arg1 : tensor<4xf32>
    stablehlo.return %1 : tensor<4xf32>
  }) : (tensor<i32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""


def test_an_island_with_regions_reading_values_around_it():
    """An op with regions kept as an island: the values its regions read from
    around it (``%m`` and ``%arg1`` here) become arguments of its module."""
    from flashpass.export import islands

    module = compat.parse_module(_CASE, compat.mlir_context())
    main = next(iter(module.body.operations))
    case = next(op for op in main.regions[0].blocks[0].operations if "case" in op.operation.name)
    captured = islands.captured_values(case)
    assert len(captured) == 2  # %m and %arg1, each once
    x = jnp.arange(4, dtype=jnp.float32)
    for index, want in ((0, 2 * x), (1, 3 * x)):
        got = islands.call_island(
            case, [jnp.int32(index)], ("cpu",), {}, list(zip(captured, (2 * x, x), strict=True))
        )
        np.testing.assert_allclose(got[0], want)
    # The lifted module (case has a rule) agrees.
    new = fx.rewrite(fx.load(_CASE))
    np.testing.assert_allclose(new.call(jnp.int32(1), x), 3 * x)


def test_shape_polymorphic_artifacts_are_kept():
    (t,) = jax.export.symbolic_shape("t")
    exp = _exported(VARIANTS[0].fn, *[jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)] * 3)
    report = fx.explain(exp)
    assert report.route == "kept" and "shape-polymorphic" in report.kept_reason


def test_platform_option_is_platforms():
    exp = _exported(VARIANTS[0].fn, *VARIANTS[0].structs())
    with pytest.raises(TypeError, match="platforms="):
        fx.rewrite(exp, platform="cpu")
    with pytest.raises(ValueError, match="unknown platform"):
        fx.explain(exp, platforms=("vax",))


def _embed_and_attend(table, tokens, w):
    x = table[tokens]  # a gather
    q = k = v = (x @ w).reshape(1, tokens.shape[1], 2, 16)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def test_gather_is_lifted_and_differentiable():
    structs = (
        jax.ShapeDtypeStruct((50, 32), jnp.float32),
        jax.ShapeDtypeStruct((1, 128), jnp.int32),
        jax.ShapeDtypeStruct((32, 32), jnp.float32),
    )
    exp = jax.export.export(jax.jit(_embed_and_attend))(*structs)
    assert "stablehlo.gather" in exp.mlir_module()
    new, report = fx.rewrite_and_explain(exp, kernel="blockwise")
    assert not report.islands and len(report.rewrites) == 1, str(report)
    new = jax.export.deserialize(new.serialize(vjp_order=1))
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((50, 32)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 50, (1, 128)), jnp.int32)
    w = jnp.asarray(rng.standard_normal((32, 32)) * 0.2, jnp.float32)
    want = _embed_and_attend(table, tokens, w)
    np.testing.assert_allclose(jax.jit(new.call)(table, tokens, w), want, atol=2e-5)

    def loss(f):
        return lambda t, w: jnp.sum(f(t, tokens, w) ** 2)

    got = jax.grad(loss(new.call), argnums=(0, 1))(table, w)
    expected = jax.grad(loss(_embed_and_attend), argnums=(0, 1))(table, w)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-3, rtol=1e-4)


def _tokens_embedded_and_attended(tokens, table, wk, wv):
    x = table[tokens]  # [B, T, D]
    q, k, v = x[:, :, None, :], (x @ wk)[:, :, None, :], (x @ wv)[:, :, None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v), tokens.sum()


def _int64_tokens_export():
    structs = [jax.ShapeDtypeStruct((1, 128), jnp.int64)]
    structs += [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((50, 16), (16, 16), (16, 16))]
    with compat.x64_scope(True):  # as torch_xla's modules take their tokens
        return jax.export.export(jax.jit(_tokens_embedded_and_attended))(*structs)


@pytest.mark.parametrize("form", ["serialized", "text"])
def test_int64_inputs_without_x64(form):
    """An artifact taking int64 tokens is lifted and re-exported with x64 on
    (inside a scope): its avals stay 64-bit, and it is called as the original is."""
    assert not compat.x64_enabled()
    exp = _int64_tokens_export()
    exp = fx.load(exp.serialize() if form == "serialized" else exp.mlir_module())
    assert exp.in_avals[0].dtype == jnp.int64 and exp.out_avals[1].dtype == jnp.int64
    new, report = fx.rewrite_and_explain(exp, kernel="blockwise")
    assert not compat.x64_enabled()  # the scope does not leak
    assert report.route == "lift" and len(report.rewrites) == 1, str(report)
    assert new is not exp
    assert new.in_avals == exp.in_avals and new.out_avals == exp.out_avals
    new = jax.export.deserialize(new.serialize())
    assert new.in_avals == exp.in_avals and new.out_avals == exp.out_avals

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, (1, 128)).astype(np.int64)
    weights = [rng.standard_normal(s).astype(np.float32) for s in ((50, 16), (16, 16), (16, 16))]
    with compat.x64_scope(True):  # an int64 argument needs x64, for the original too
        got, want = new.call(tokens, *weights), exp.call(tokens, *weights)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    assert got[1].dtype == want[1].dtype == jnp.int64 and got[1] == want[1]
    # Without x64 an int64 argument arrives as int32: refused alike by both.
    for artifact in (exp, new):
        with pytest.raises(ValueError, match="expected int64"):
            artifact.call(jnp.asarray(tokens), *weights)


_CALLS = """
func.func private @helper(%a: tensor<4xf32>) -> tensor<4xf32> {
  %0 = call @inner(%a) : (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
func.func private @inner(%a: tensor<4xf32>) -> tensor<4xf32> {
  return %a : tensor<4xf32>
}
func.func private @unrelated(%a: tensor<4xf32>) -> tensor<4xf32> {
  return %a : tensor<4xf32>
}
func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.custom_call @with_body(%arg0) {called_computations = [@helper]}
    : (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""


def test_an_island_takes_the_functions_it_calls_along():
    """A custom call with a body (``called_computations``): its island module
    holds the functions it calls, transitively, and no other."""
    from flashpass.export import islands
    from flashpass.export.lift import _functions

    module = compat.parse_module(_CALLS, compat.mlir_context())
    functions = _functions(module)
    call = next(iter(functions["main"].regions[0].blocks[0].operations))
    text = str(islands._one_op_module(call, [], functions))
    assert "func.func private @helper" in text and "func.func private @inner" in text
    assert "@unrelated" not in text
    assert "called_computations = [@helper]" in text
