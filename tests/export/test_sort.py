"""``stablehlo.sort`` lifted exactly, values and derivative: JAX's own sorts
(its canonical float comparator, ascending), descending and raw IEEE
total-order comparators (``chlo.top_k``'s decomposition, PyTorch's
``topk``/``sort``), integer keys; and islands of integers only inside a
differentiated program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import flashpass.export as fx
from flashpass import compat


def _lifted(module_or_exp):
    text = module_or_exp if isinstance(module_or_exp, str) else None
    data = text if text is not None else module_or_exp.mlir_module_serialized
    lifted = fx.prepare(compat.parse_module(data, compat.mlir_context()))
    return lifted.function(0, ("cpu",)), lifted


def _bits(x):
    x = np.asarray(x)
    return x.view(f"uint{x.dtype.itemsize * 8}") if np.issubdtype(x.dtype, np.floating) else x


# NaNs of both signs, both zeros, infinities, ties.
_FLOATS = np.array(
    [3.0, -0.0, 0.0, -1.0, np.nan, 2.0, -np.inf, 1.0, -np.nan, 2.0, np.inf, 0.0, -0.0, 2.0],
    np.float32,
)
_INTS = np.array([3, -7, 0, -1, 9, 2, 2, 1, -7, 2, 0, 5, 3, 3], np.int32)

_JAX_SORTS = {
    "sort": jnp.sort,
    "sort_descending": lambda x: jnp.sort(x, descending=True),
    "argsort": jnp.argsort,
    "argsort_descending": lambda x: jnp.argsort(x, descending=True),
    "sort_carrying": lambda x: lax.sort((x, jnp.arange(x.shape[0]) * 1.5), num_keys=1),
    "sort_2d": lambda x: jnp.sort(x.reshape(2, 7), axis=0),
}


@pytest.mark.parametrize("values", [_FLOATS, _INTS], ids=["float32", "int32"])
@pytest.mark.parametrize("name", sorted(_JAX_SORTS))
def test_jax_sorts_are_lifted_bit_for_bit(name, values):
    fn = _JAX_SORTS[name]
    exp = jax.export.export(jax.jit(fn))(values)
    lifted, module = _lifted(exp)
    outs = lifted(values)
    assert not module.islands, module.islands
    for got, want in zip(
        jax.tree_util.tree_leaves(outs), jax.tree_util.tree_leaves(fn(values)), strict=True
    ):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def _weighted(fn):
    def loss(x):
        outs = jax.tree_util.tree_leaves(fn(x))
        floats = [o for o in outs if jnp.issubdtype(o.dtype, jnp.floating)]
        return sum(
            jnp.sum(jnp.nan_to_num(o) * jnp.arange(1, o.size + 1).reshape(o.shape)) for o in floats
        )

    return loss


@pytest.mark.parametrize("name", ["sort", "sort_descending", "sort_carrying", "sort_2d"])
def test_a_lifted_float_sort_has_the_originals_gradient(name):
    fn = _JAX_SORTS[name]
    x = _FLOATS
    exp = jax.export.export(jax.jit(fn))(x)
    lifted, _ = _lifted(exp)
    got = jax.grad(_weighted(lambda x: lifted(x)))(jnp.asarray(x))
    want = jax.grad(_weighted(fn))(jnp.asarray(x))
    np.testing.assert_array_equal(got, want)


def _sort_module(dtype: str, direction: str, kind: str, key_last: bool = False) -> str:
    """A stable sort of ``x`` carrying its positions, the comparator written
    as an exporter other than JAX writes it (no canonical form)."""
    a, b = ("%arg3", "%arg4") if key_last else ("%arg1", "%arg2")
    order = "(%1, %0)" if key_last else "(%0, %1)"
    types = f"tensor<14x{dtype}>, tensor<14xi32>"
    if key_last:
        types = f"tensor<14xi32>, tensor<14x{dtype}>"
    scalars = "tensor<i32>, tensor<i32>" if key_last else f"tensor<{dtype}>, tensor<{dtype}>"
    other = f"tensor<{dtype}>, tensor<{dtype}>" if key_last else "tensor<i32>, tensor<i32>"
    results = "%2#1, %2#0" if key_last else "%2#0, %2#1"
    return f"""
func.func public @main(%0: tensor<14x{dtype}>) -> (tensor<14x{dtype}>, tensor<14xi32>) {{
  %1 = stablehlo.iota dim = 0 : tensor<14xi32>
  %2:2 = "stablehlo.sort"{order} <{{dimension = 0 : i64, is_stable = true}}> ({{
  ^bb0(%arg1: {scalars.split(", ")[0]}, %arg2: {scalars.split(", ")[1]},
       %arg3: {other.split(", ")[0]}, %arg4: {other.split(", ")[1]}):
    %c = stablehlo.compare {direction}, {a}, {b}, {kind}
      : (tensor<{dtype}>, tensor<{dtype}>) -> tensor<i1>
    stablehlo.return %c : tensor<i1>
  }}) : ({types}) -> ({types})
  return {results} : tensor<14x{dtype}>, tensor<14xi32>
}}
"""


def _reference(values, descending: bool, key):
    """A stable sort's permutation under the order ``key`` gives (numpy)."""
    keys = [key(v) for v in values]
    return (
        sorted(range(len(values)), key=lambda i: keys[i], reverse=False)
        if not descending
        else (sorted(range(len(values)), key=lambda i: tuple(-k for k in keys[i])))
    )


def _total_order(v):
    """IEEE total order of a float32 as a sortable tuple."""
    bits = int(np.asarray(v, np.float32).view(np.int32))
    return (bits ^ 0x7FFFFFFF if bits < 0 else bits,)


@pytest.mark.parametrize("key_last", [False, True], ids=["key_first", "key_last"])
@pytest.mark.parametrize("direction", ["LT", "GT"])
def test_a_raw_total_order_float_sort_is_lifted_exactly(direction, key_last):
    """``compare LT/GT ..., TOTALORDER`` without JAX's canonical form: -NaN
    first, -0 before 0, stable among ties; the key may be any operand."""
    text = _sort_module("f32", direction, "TOTALORDER", key_last)
    lifted, info = _lifted(text)
    x = jnp.asarray(_FLOATS)
    values, positions = lifted(x)
    assert not info.islands, info.islands
    perm = _reference(_FLOATS, direction == "GT", _total_order)
    np.testing.assert_array_equal(positions, perm)
    np.testing.assert_array_equal(_bits(values), _bits(_FLOATS[perm]))
    # The module run as written agrees (XLA's sort with this comparator).
    original = fx.load(text).call(x)
    np.testing.assert_array_equal(positions, original[1])
    np.testing.assert_array_equal(_bits(values), _bits(original[0]))
    # The derivative is the permutation's.
    w = jnp.arange(1.0, 15.0)
    grad = jax.grad(lambda x: jnp.sum(jnp.nan_to_num(lifted(x)[0]) * w))(x)
    want = np.zeros(14, np.float32)
    want[np.asarray(perm)] = np.where(np.isfinite(_FLOATS[perm]), w, 0.0)
    finite = np.isfinite(_FLOATS)
    np.testing.assert_array_equal(np.asarray(grad)[finite], want[finite])


@pytest.mark.parametrize("dtype", ["i32", "ui32"])
@pytest.mark.parametrize("direction", ["LT", "GT"])
def test_an_integer_sort_is_lifted_both_ways(direction, dtype):
    kind = "SIGNED" if dtype == "i32" else "UNSIGNED"
    text = _sort_module(dtype, direction, kind)
    lifted, info = _lifted(text)
    np_dtype = np.int32 if dtype == "i32" else np.uint32
    x = jnp.asarray(_INTS.astype(np_dtype))
    got = lifted(x)
    assert not info.islands, info.islands
    want = fx.load(text).call(x)
    perm = _reference(list(np.asarray(x).tolist()), direction == "GT", lambda v: (v,))
    np.testing.assert_array_equal(got[1], perm)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_partial_float_order_stays_an_island():
    text = _sort_module("f32", "GT", "FLOAT")
    lifted, info = _lifted(text)
    lifted(jnp.asarray(_FLOATS))
    assert list(info.islands) == ["stablehlo.sort"]


def _popcount_in_a_loop(x):
    def body(i, carry):
        y, n = carry
        n = lax.population_count(n + jnp.floor(y[:3]).astype(jnp.int32))
        return y * 1.5 + n.sum().astype(y.dtype), n

    y, _ = lax.fori_loop(0, 3, body, (x, jnp.zeros(3, jnp.int32)))
    return jnp.sum(y**2)


def test_an_island_of_integers_does_not_block_the_gradient():
    """``popcnt`` has no rule (an island, which has no derivative); its operands
    are integers, so no derivative flows through it and jax.grad of the lifted
    program, inside a lifted loop, is the original's."""
    x = jnp.arange(4.0) / 3
    exp = jax.export.export(jax.jit(_popcount_in_a_loop))(x)
    lifted, info = _lifted(exp)
    got = jax.jit(jax.grad(lambda x: lifted(x)[0]))(x)
    assert list(info.islands) == ["stablehlo.popcnt"]
    np.testing.assert_allclose(got, jax.grad(_popcount_in_a_loop)(x), rtol=1e-6)
    # An explicit (float0) tangent for an integer input as well.
    n = jnp.arange(4, dtype=jnp.int32) * 5
    g = lambda x, n: x * lax.population_count(n).astype(x.dtype)  # noqa: E731
    exp = jax.export.export(jax.jit(g))(x, n)
    lifted, _ = _lifted(exp)
    zero = np.zeros(4, jax.dtypes.float0)
    _, tangent = jax.jvp(lambda x, n: lifted(x, n)[0], (x, n), (jnp.ones(4), zero))
    np.testing.assert_array_equal(tangent, lax.population_count(n).astype(x.dtype))
