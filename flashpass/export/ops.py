"""The lifting rules: one StableHLO op to the `lax` op a traced JAX program holds.

A rule takes ``(interpreter, op, operands)`` and returns the results.  Operands
are tracers, numpy constants or `Splat`s; ops whose operands are all constant
are folded (the result is a constant again), so the platform-index arithmetic
of a multi-platform module, and scalar constants, never reach the jaxpr.
A rule raises `NoRule` for a variant it does not cover; the op then becomes
an island.

Folding happens on the host (`fold`, under `compat.compile_time_eval`), never
inside the trace the lift runs in: a ``sqrt`` of a splat constant bound while
tracing would be a tracer, which numpy cannot read back.  ``iota`` is not
folded: it stays the op a traced program holds, so positions built from it
(causal and window masks) reach the matcher as JAX code would give them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass import compat

from . import sharded
from .values import LiftError, Splat, constant_value, dense_constant, materialize, tensor_aval


class NoRule(Exception):
    """This rule does not cover this form of the op."""


def _aval(op, i: int = 0):
    return tensor_aval(op.results[i].type)


def _attr(op, name: str):
    return op.attributes[name] if name in op.attributes else None


def _i64s(attr) -> tuple[int, ...]:
    if attr is None:
        return ()
    ir = compat.ir_module()
    try:
        return tuple(ir.DenseI64ArrayAttr(attr))
    except (ValueError, TypeError):
        return tuple(int(x) for x in np.array(ir.DenseIntElementsAttr(attr)).reshape(-1))


def _int(attr) -> int:
    return compat.ir_module().IntegerAttr(attr).value


def _fold(result):
    """A concrete result (all operands were constants) back to numpy."""
    return result if compat.is_tracer(result) else np.asarray(result)


#: Results with more elements than this are not folded: a large constant
#: computation stays staged, as it was in the program the module came from.
FOLD_LIMIT = 1 << 16

#: Ops with regions whose constant operands are folded (their body is pure).
_FOLDABLE_REGIONS = ("stablehlo.reduce", "stablehlo.reduce_window")


def _is_constant(x) -> bool:
    return isinstance(x, Splat | np.ndarray | np.generic)


def foldable(op, name: str, operands: list) -> bool:
    """Whether ``op`` reads only constants and is folded on the host."""
    if not operands or not all(_is_constant(x) for x in operands):
        return False
    if name not in RULES or name.startswith("sdy.") or name == "stablehlo.custom_call":
        return False
    if len(op.regions) and name not in _FOLDABLE_REGIONS:
        return False
    if all(isinstance(x, Splat) for x in operands) and not len(op.regions):
        return True  # an elementwise or shape op of splats is a splat again
    sizes = [int(np.prod(tensor_aval(r.type).shape)) for r in op.results]
    return sum(sizes) <= FOLD_LIMIT


def fold(interp, op, name: str, operands: list) -> list | None:
    """``op`` evaluated on constant ``operands`` on the host: numpy arrays or
    `Splat`s; None where its rule does not cover this form (an island then)."""
    with compat.compile_time_eval():
        try:
            results = RULES[name](interp, op, operands)
        except NoRule:
            return None
        out = []
        for r in results:
            if isinstance(r, Splat):
                out.append(r)
                continue
            if compat.is_tracer(r):
                raise LiftError(f"{name}: its constant operands did not fold (a lifting bug)")
            out.append(np.asarray(r))
    return out


def as_output(x, aval):
    """A lifted value as an output of the function (constants materialised)."""
    if isinstance(x, Splat):
        return x.array()
    return x


# --------------------------------------------------------------------------- elementwise


def _elementwise(fn):
    def rule(interp, op, operands):
        aval = _aval(op)
        if all(isinstance(x, Splat) for x in operands):
            with compat.compile_time_eval():  # on the host, not in the trace
                value = np.asarray(fn(*[x.value for x in operands]), aval.dtype)
            return [Splat(value, aval.shape)]
        if fn in (lax.mul, lax.div) and _is_one(operands[1]):
            return [operands[0]]  # x * 1 and x / 1 are x, bit for bit
        if fn is lax.mul and _is_one(operands[0]):
            return [operands[1]]
        # A splat next to an array is a scalar operand, as ``x / 8.0`` traces.
        args = [x.value if isinstance(x, Splat) else x for x in operands]
        if not any(getattr(a, "shape", ()) == aval.shape for a in args):
            args = [materialize(x) for x in operands]
        return [_fold(fn(*args))]

    return rule


def _is_one(x) -> bool:
    return isinstance(x, Splat) and jnp.issubdtype(x.dtype, jnp.floating) and float(x.value) == 1.0


_UNARY = {
    "abs": lax.abs,
    "ceil": lax.ceil,
    "cosine": lax.cos,
    "exponential": lax.exp,
    "exponential_minus_one": lax.expm1,
    "floor": lax.floor,
    "is_finite": lax.is_finite,
    "log": lax.log,
    "log_plus_one": lax.log1p,
    "logistic": lax.logistic,
    "negate": lax.neg,
    "not": lax.bitwise_not,
    "round_nearest_even": lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN),
    "round_nearest_afz": lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
    "rsqrt": lax.rsqrt,
    "sign": lax.sign,
    "sine": lax.sin,
    "sqrt": lax.sqrt,
    "cbrt": lax.cbrt,
    "tan": lax.tan,
    "tanh": lax.tanh,
}
_BINARY = {
    "add": lax.add,
    "and": lax.bitwise_and,
    "atan2": lax.atan2,
    "divide": lax.div,
    "maximum": lax.max,
    "minimum": lax.min,
    "multiply": lax.mul,
    "or": lax.bitwise_or,
    "power": lax.pow,
    "remainder": lax.rem,
    "shift_left": lax.shift_left,
    "shift_right_arithmetic": lax.shift_right_arithmetic,
    "shift_right_logical": lax.shift_right_logical,
    "subtract": lax.sub,
    "xor": lax.bitwise_xor,
}
_COMPARE = {"EQ": lax.eq, "NE": lax.ne, "LT": lax.lt, "LE": lax.le, "GT": lax.gt, "GE": lax.ge}

RULES: dict = {}
for _name, _fn in {**_UNARY, **_BINARY}.items():
    RULES[f"stablehlo.{_name}"] = _elementwise(_fn)
RULES["chlo.erf"] = _elementwise(lax.erf)


def _rule(name):
    def register(fn):
        RULES[name] = fn
        return fn

    return register


@_rule("stablehlo.compare")
def _compare(interp, op, operands):
    sh = compat.stablehlo_dialect()
    direction = sh.ComparisonDirectionAttr(op.attributes["comparison_direction"]).value
    kind = _attr(op, "compare_type")
    if kind is not None and "TOTALORDER" in str(kind):
        raise NoRule  # a total order on floats is not lax's comparison
    return _elementwise(_COMPARE[direction])(interp, op, operands)


@_rule("stablehlo.convert")
def _convert(interp, op, operands):
    aval = _aval(op)
    (x,) = operands
    if isinstance(x, Splat):
        return [Splat(np.asarray(x.value).astype(aval.dtype), aval.shape)]
    return [_fold(lax.convert_element_type(x, aval.dtype))]


@_rule("stablehlo.select")
def _select(interp, op, operands):
    pred, on_true, on_false = operands
    if isinstance(pred, Splat):
        return [on_true if bool(pred.value) else on_false]
    return [_fold(lax.select(pred, materialize(on_true), materialize(on_false)))]


@_rule("stablehlo.clamp")
def _clamp(interp, op, operands):
    low, x, high = (materialize(v) if not isinstance(v, Splat) else v.value for v in operands)
    return [_fold(lax.clamp(low, materialize(x), high))]


# --------------------------------------------------------------------------- shapes


@_rule("stablehlo.constant")
def _constant(interp, op, operands):
    return [dense_constant(op.attributes["value"], _aval(op))]


@_rule("stablehlo.iota")
def _iota(interp, op, operands):
    aval = _aval(op)
    return [lax.broadcasted_iota(aval.dtype, aval.shape, _int(op.attributes["iota_dimension"]))]


@_rule("stablehlo.broadcast_in_dim")
def _broadcast_in_dim(interp, op, operands):
    aval = _aval(op)
    (x,) = operands
    if isinstance(x, Splat):
        return [x.reshaped(aval.shape)]
    dims = _i64s(op.attributes["broadcast_dimensions"])
    return [_fold(lax.broadcast_in_dim(x, aval.shape, dims))]


@_rule("stablehlo.reshape")
def _reshape(interp, op, operands):
    aval = _aval(op)
    (x,) = operands
    if isinstance(x, Splat):
        return [x.reshaped(aval.shape)]
    return [_fold(lax.reshape(x, aval.shape))]


@_rule("stablehlo.transpose")
def _transpose(interp, op, operands):
    aval = _aval(op)
    (x,) = operands
    if isinstance(x, Splat):
        return [x.reshaped(aval.shape)]
    return [_fold(lax.transpose(x, _i64s(op.attributes["permutation"])))]


@_rule("stablehlo.concatenate")
def _concatenate(interp, op, operands):
    dim = _int(op.attributes["dimension"])
    return [_fold(lax.concatenate([materialize(x) for x in operands], dim))]


@_rule("stablehlo.slice")
def _slice(interp, op, operands):
    start = _i64s(op.attributes["start_indices"])
    limit = _i64s(op.attributes["limit_indices"])
    strides = _i64s(op.attributes["strides"])
    return [_fold(lax.slice(materialize(operands[0]), start, limit, strides))]


@_rule("stablehlo.dynamic_slice")
def _dynamic_slice(interp, op, operands):
    x, *starts = (materialize(v) for v in operands)
    sizes = _i64s(op.attributes["slice_sizes"])
    return [_fold(lax.dynamic_slice(x, [s.reshape(()) for s in starts], sizes))]


@_rule("stablehlo.dynamic_update_slice")
def _dynamic_update_slice(interp, op, operands):
    x, update, *starts = (materialize(v) for v in operands)
    return [_fold(lax.dynamic_update_slice(x, update, [s.reshape(()) for s in starts]))]


@_rule("stablehlo.pad")
def _pad(interp, op, operands):
    x, value = operands
    low = _i64s(op.attributes["edge_padding_low"])
    high = _i64s(op.attributes["edge_padding_high"])
    inner = _i64s(op.attributes["interior_padding"])
    value = value.value if isinstance(value, Splat) else value
    config = list(zip(low, high, inner, strict=True))
    return [_fold(lax.pad(materialize(x), value, config))]


@_rule("stablehlo.reverse")
def _reverse(interp, op, operands):
    return [_fold(lax.rev(materialize(operands[0]), _i64s(op.attributes["dimensions"])))]


@_rule("stablehlo.optimization_barrier")
def _barrier(interp, op, operands):
    return list(lax.optimization_barrier(tuple(materialize(x) for x in operands)))


@_rule("stablehlo.reduce_precision")
def _reduce_precision(interp, op, operands):
    exponent = _int(op.attributes["exponent_bits"])
    mantissa = _int(op.attributes["mantissa_bits"])
    return [_fold(lax.reduce_precision(materialize(operands[0]), exponent, mantissa))]


def _index_vector_last(indices, vector: int):
    """``indices`` with StableHLO's index vector axis moved last (added when it
    is the implicit trailing one), the layout lax.gather and lax.scatter take."""
    rank = len(indices.shape)
    if vector == rank:
        return lax.expand_dims(indices, (rank,))
    if vector != rank - 1:
        return lax.transpose(indices, [a for a in range(rank) if a != vector] + [vector])
    return indices


@_rule("stablehlo.gather")
def _gather(interp, op, operands):
    sh = compat.stablehlo_dialect()
    numbers = sh.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    x, indices = (materialize(v) for v in operands)
    indices = _index_vector_last(indices, numbers.index_vector_dim)
    dims = lax.GatherDimensionNumbers(
        offset_dims=tuple(numbers.offset_dims),
        collapsed_slice_dims=tuple(numbers.collapsed_slice_dims),
        start_index_map=tuple(numbers.start_index_map),
        operand_batching_dims=tuple(getattr(numbers, "operand_batching_dims", ())),
        start_indices_batching_dims=tuple(getattr(numbers, "start_indices_batching_dims", ())),
    )
    sorted_ = _attr(op, "indices_are_sorted")
    out = lax.gather(
        x,
        indices,
        dims,
        _i64s(op.attributes["slice_sizes"]),
        indices_are_sorted=sorted_ is not None and str(sorted_) == "true",
        # StableHLO clamps start indices so that every slice is in bounds.
        mode=lax.GatherScatterMode.CLIP,
    )
    return [_fold(out)]


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


# --------------------------------------------------------------------------- control flow


@_rule("stablehlo.while")
def _while(interp, op, operands):
    cond_region, body_region = op.regions
    trips = _counted_loop(interp, op, operands)
    if trips is not None:
        # A loop counting one carry up by 1 to a constant bound (what `lax.scan`
        # and a static `fori_loop` lower to) is a scan again: reverse-differentiable,
        # where a `while_loop` is not.
        def step(carry, _):
            out = interp.run_region(body_region, list(carry))
            return tuple(materialize(x) for x in out), None

        init = tuple(materialize(x) for x in operands)
        out, _ = lax.scan(step, init, None, length=trips)
        return list(out)

    def cond(carry):
        return interp.run_region(cond_region, list(carry))[0].reshape(())

    def body(carry):
        return tuple(materialize(x) for x in interp.run_region(body_region, list(carry)))

    return list(lax.while_loop(cond, body, tuple(materialize(x) for x in operands)))


def _static_value(interp, value):
    """The constant behind ``value`` (a constant op, or a constant of the
    enclosing function), else None."""
    owner = value.owner
    if hasattr(owner, "operation") and owner.operation.name == "stablehlo.constant":
        return constant_value(dense_constant(owner.attributes["value"], tensor_aval(value.type)))
    env = interp.envs[-1] if interp.envs else {}
    return constant_value(env[value]) if value in env else None


def _counted_loop(interp, op, operands) -> int | None:
    """The trip count of a ``while`` whose condition is ``carry[i] < N`` (N a
    constant), whose body returns ``carry[i] + 1`` and whose ``carry[i]`` starts
    at a constant; else None."""
    cond_region, body_region = op.regions
    if len(list(cond_region.blocks)) != 1 or len(list(body_region.blocks)) != 1:
        return None
    cond = cond_region.blocks[0]
    body_ops = list(cond.operations)
    if len(body_ops) != 2 or body_ops[0].operation.name != "stablehlo.compare":
        return None
    compare, ret = body_ops
    if list(ret.operands) != [compare.results[0]]:
        return None
    sh = compat.stablehlo_dialect()
    if sh.ComparisonDirectionAttr(compare.attributes["comparison_direction"]).value != "LT":
        return None
    counter, limit = compare.operands
    args = list(cond.arguments)
    if counter not in args:
        return None
    i = args.index(counter)
    if not jnp.issubdtype(tensor_aval(counter.type).dtype, jnp.integer):
        return None
    bound, start = _static_value(interp, limit), constant_value(operands[i])
    if bound is None or start is None or bound.size != 1 or start.size != 1:
        return None
    block = body_region.blocks[0]
    returned = list(block.operations)[-1].operands[i]
    step_op = returned.owner
    if not hasattr(step_op, "operation") or step_op.operation.name != "stablehlo.add":
        return None
    lhs, rhs = step_op.operation.operands
    own = list(block.arguments)[i]
    other = rhs if lhs == own else lhs if rhs == own else None
    if other is None:
        return None
    one = _static_value(interp, other)
    if one is None or one.size != 1 or int(one.reshape(())) != 1:
        return None
    return max(int(bound.reshape(())) - int(start.reshape(())), 0)


@_rule("stablehlo.case")
def _case(interp, op, operands):
    index = constant_value(operands[0])
    regions = list(op.regions)
    if index is not None:  # e.g. the platform index: resolved while lifting
        i = int(np.clip(index.reshape(()), 0, len(regions) - 1))
        return interp.run_region(regions[i], [])
    branches = [_branch(interp, r) for r in regions]
    return list(lax.switch(operands[0].reshape(()), branches))


def _branch(interp, region):
    return lambda: tuple(materialize(x) for x in interp.run_region(region, []))


@_rule("stablehlo.if")
def _if(interp, op, operands):
    pred = constant_value(operands[0])
    on_true, on_false = op.regions
    if pred is not None:
        return interp.run_region(on_true if bool(pred.reshape(())) else on_false, [])

    branches = (_branch(interp, on_true), _branch(interp, on_false))
    return list(lax.cond(operands[0].reshape(()), *branches))


# Annotations a single-device program may carry; they do not change values.
_IDENTITY_CUSTOM_CALLS = ("Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape")


@_rule("stablehlo.custom_call")
def _custom_call(interp, op, operands):
    ir = compat.ir_module()
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    if target in _IDENTITY_CUSTOM_CALLS and len(operands) == 1 and len(op.results) == 1:
        if interp.lifted.meshes:
            raise LiftError(f"custom_call @{target} in a multi-device artifact is not reproduced")
        return operands
    raise NoRule


@_rule("sdy.sharding_constraint")
def _sharding_constraint(interp, op, operands):
    (x,) = operands
    if not interp.lifted.meshes or isinstance(x, Splat):  # one device, or a splat constant:
        return operands  # the constraint changes no value
    return [sharded.constrain(materialize(x), str(op.attributes["sharding"]), interp.lifted.meshes)]


def rule_names() -> list[str]:
    """The ops the lifter knows (``func.call`` and the returns besides)."""
    return sorted(RULES)


__all__ = ["RULES", "LiftError", "NoRule", "as_output", "materialize", "rule_names"]
