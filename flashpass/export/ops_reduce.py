"""The lifting rules of contractions and reductions: ``dot_general``,
``reduce``, ``reduce_window``, ``sort``, ``scatter`` (`flashpass.export.ops`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass import compat

from .rules import RULES, NoRule, _attr, _aval, _fold, _i64s, _index_vector_last, _int, _rule
from .values import constant_value, materialize

# --------------------------------------------------------------------------- contractions


@_rule("stablehlo.dot_general")
def _dot_general(interp, op, operands):
    sh = compat.stablehlo_dialect()
    numbers = sh.DotDimensionNumbers(op.attributes["dot_dimension_numbers"])
    if _attr(op, "algorithm") is not None:
        raise NoRule  # an explicit dot algorithm: kept as written
    lhs, rhs = (materialize(x) for x in operands)
    dims = (
        (tuple(numbers.lhs_contracting_dimensions), tuple(numbers.rhs_contracting_dimensions)),
        (tuple(numbers.lhs_batching_dimensions), tuple(numbers.rhs_batching_dimensions)),
    )
    out = lax.dot_general(lhs, rhs, dims, preferred_element_type=_aval(op).dtype)
    return [_fold(out)]


@_rule("stablehlo.dot")
def _dot(interp, op, operands):
    lhs, rhs = (materialize(x) for x in operands)
    return [_fold(lax.dot(lhs, rhs, preferred_element_type=_aval(op).dtype))]


# Reductions whose body is one binary op, and the init that leaves it unchanged.
_MONOIDS = {
    "stablehlo.add": (lax.reduce_sum, lambda d: 0),
    "stablehlo.multiply": (lax.reduce_prod, lambda d: 1),
    "stablehlo.maximum": (lax.reduce_max, lambda d: _lowest(d)),
    "stablehlo.minimum": (lax.reduce_min, lambda d: _highest(d)),
    "stablehlo.and": (lax.reduce_and, lambda d: True),
    "stablehlo.or": (lax.reduce_or, lambda d: False),
}


def _lowest(dtype):
    if np.issubdtype(dtype, np.floating) or dtype == jax.numpy.bfloat16:
        return -np.inf
    return np.iinfo(dtype).min if dtype != np.dtype(bool) else False


def _highest(dtype):
    if np.issubdtype(dtype, np.floating) or dtype == jax.numpy.bfloat16:
        return np.inf
    return np.iinfo(dtype).max if dtype != np.dtype(bool) else True


def _single_op_body(op) -> str | None:
    """The combining op of a one-operand reduce body ``return op(a, b)``, else None."""
    block = op.regions[0].blocks[0]
    body = list(block.operations)
    if len(body) != 2 or len(list(block.arguments)) != 2:
        return None
    combine, ret = body
    args = list(block.arguments)
    if list(combine.operands) not in (args, args[::-1]):
        return None
    if list(ret.operands) != [combine.results[0]]:
        return None
    return combine.operation.name


@_rule("stablehlo.reduce")
def _reduce(interp, op, operands):
    dims = _i64s(op.attributes["dimensions"])
    n = len(operands) // 2
    inputs = [materialize(x) for x in operands[:n]]
    inits = operands[n:]
    combine = _single_op_body(op) if n == 1 else None
    if combine in _MONOIDS:
        reduce, identity = _MONOIDS[combine]
        out = reduce(inputs[0], dims)
        init = constant_value(inits[0])
        if init is None or init.reshape(()) != identity(init.dtype):
            out = RULES[combine](interp, op, [out, inits[0]])[0]
        return [_fold(out)]

    def computation(a, b):
        return tuple(interp.run_region(op.regions[0], [*a, *b]))

    init_values = [materialize(x) for x in inits]
    return list(lax.reduce(tuple(inputs), tuple(init_values), computation, dims))


def _padding_pairs(attr, rank: int) -> list:
    if attr is None:
        return [(0, 0)] * rank
    flat = np.array(compat.ir_module().DenseIntElementsAttr(attr)).reshape(-1)
    return [(int(flat[2 * i]), int(flat[2 * i + 1])) for i in range(rank)]


#: A reduce_window body of one op whose init is the identity: lax's monoid reducer
#: (``reduce_window_sum``, ..., what ``jnp.cumsum`` and pooling trace to).
_WINDOW_MONOIDS = {
    "stablehlo.add": lax.add,
    "stablehlo.maximum": lax.max,
    "stablehlo.minimum": lax.min,
}


@_rule("stablehlo.reduce_window")
def _reduce_window(interp, op, operands):
    n = len(operands) // 2
    inputs = [materialize(x) for x in operands[:n]]
    inits = operands[n:]
    rank = len(inputs[0].shape)
    window = _i64s(op.attributes["window_dimensions"])
    strides = _i64s(_attr(op, "window_strides")) or (1,) * rank
    base = _i64s(_attr(op, "base_dilations")) or (1,) * rank
    dilation = _i64s(_attr(op, "window_dilations")) or (1,) * rank
    padding = _padding_pairs(_attr(op, "padding"), rank)
    combine = _single_op_body(op) if n == 1 else None
    init = constant_value(inits[0]) if n == 1 else None
    if combine in _WINDOW_MONOIDS and init is not None:
        identity = _MONOIDS[combine][1](init.dtype)
        if init.reshape(()) == identity:
            out = lax.reduce_window(
                inputs[0],
                np.asarray(init.reshape(()), init.dtype),
                _WINDOW_MONOIDS[combine],
                window,
                strides,
                padding,
                base,
                dilation,
            )
            return [_fold(out)]

    def computation(a, b):
        a, b = (a, b) if n > 1 else ((a,), (b,))
        out = interp.run_region(op.regions[0], [*a, *b])
        return tuple(materialize(x) for x in out) if n > 1 else materialize(out[0])

    init_values = [materialize(x) for x in inits]
    out = lax.reduce_window(
        tuple(inputs) if n > 1 else inputs[0],
        tuple(init_values) if n > 1 else init_values[0],
        computation,
        window,
        strides,
        padding,
        base,
        dilation,
    )
    return list(out) if n > 1 else [out]


def _compare_of_args(op, first: int, second: int) -> tuple | None:
    """``(direction, compare_type)`` of a comparator body ``return compare(arg_first,
    arg_second)``, else None."""
    block = op.regions[0].blocks[0]
    body = list(block.operations)
    args = list(block.arguments)
    if len(body) != 2 or body[0].operation.name != "stablehlo.compare":
        return None
    compare, ret = body
    if list(compare.operands) != [args[first], args[second]]:
        return None
    if list(ret.operands) != [compare.results[0]]:
        return None
    sh = compat.stablehlo_dialect()
    direction = sh.ComparisonDirectionAttr(compare.attributes["comparison_direction"]).value
    kind = _attr(compare, "compare_type")
    return direction, "" if kind is None else str(kind)


@_rule("stablehlo.sort")
def _sort(interp, op, operands):
    # lax.sort's order: ascending, floats in total order, keyed on the first operand.
    found = _compare_of_args(op, 0, 1)
    if found is None or found[0] != "LT":
        raise NoRule
    inputs = [materialize(x) for x in operands]
    floating = jnp.issubdtype(inputs[0].dtype, jnp.floating)
    if floating and "TOTALORDER" not in found[1]:
        raise NoRule  # a partial float order (-0 == 0) is not lax.sort's
    dimension = _int(op.attributes["dimension"])
    stable = _attr(op, "is_stable")
    out = lax.sort(
        tuple(inputs),
        dimension=dimension,
        is_stable=stable is not None and str(stable) == "true",
        num_keys=1,
    )
    return [_fold(x) for x in out]


def _updated_value_body(op) -> str | None:
    """``"set"`` for a scatter body returning its update, the combining op's name
    for ``return op(current, update)``, else None."""
    block = op.regions[0].blocks[0]
    body = list(block.operations)
    args = list(block.arguments)
    if len(args) != 2:
        return None
    if len(body) == 1 and list(body[0].operands) == [args[1]]:
        return "set"
    return _single_op_body(op)


_SCATTERS = {
    "set": lax.scatter,
    "stablehlo.add": lax.scatter_add,
    "stablehlo.multiply": lax.scatter_mul,
    "stablehlo.maximum": lax.scatter_max,
    "stablehlo.minimum": lax.scatter_min,
}


@_rule("stablehlo.scatter")
def _scatter(interp, op, operands):
    if len(operands) != 3:
        raise NoRule  # several inputs: an island
    kind = _updated_value_body(op)
    if kind not in _SCATTERS:
        raise NoRule
    sh = compat.stablehlo_dialect()
    numbers = sh.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    x, indices, updates = (materialize(v) for v in operands)
    indices = _index_vector_last(indices, numbers.index_vector_dim)
    dims = lax.ScatterDimensionNumbers(
        update_window_dims=tuple(numbers.update_window_dims),
        inserted_window_dims=tuple(numbers.inserted_window_dims),
        scatter_dims_to_operand_dims=tuple(numbers.scattered_dims_to_operand_dims),
        operand_batching_dims=tuple(numbers.input_batching_dims),
        scatter_indices_batching_dims=tuple(numbers.scatter_indices_batching_dims),
    )
    sorted_, unique = _attr(op, "indices_are_sorted"), _attr(op, "unique_indices")
    out = _SCATTERS[kind](
        x,
        indices,
        updates,
        dims,
        indices_are_sorted=sorted_ is not None and str(sorted_) == "true",
        unique_indices=unique is not None and str(unique) == "true",
        # StableHLO skips out-of-bounds updates, as the lowering of this mode does.
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )
    return [_fold(out)]
