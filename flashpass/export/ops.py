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

The rules of elementwise ops and shapes are here; those of contractions and
reductions in `flashpass.export.ops_reduce`, of control flow and annotations
in `flashpass.export.ops_flow`; the registry (`RULES`), folding and the
helpers the rules share in `flashpass.export.rules`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass import compat

from . import ops_flow, ops_reduce  # noqa: F401 - their rules register in RULES
from .rules import (
    RULES,
    NoRule,
    _attr,
    _aval,
    _fold,
    _i64s,
    _index_vector_last,
    _int,
    _rule,
    as_output,
    fold,
    foldable,
)
from .values import LiftError, Splat, dense_constant, materialize

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
    "count_leading_zeros": lax.clz,
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

for _name, _fn in {**_UNARY, **_BINARY}.items():
    RULES[f"stablehlo.{_name}"] = _elementwise(_fn)
RULES["chlo.erf"] = _elementwise(lax.erf)


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


@_rule("stablehlo.bitcast_convert")
def _bitcast_convert(interp, op, operands):
    aval = _aval(op)
    (x,) = operands
    if np.dtype(x.dtype).itemsize != np.dtype(aval.dtype).itemsize:
        raise NoRule  # a change of width changes the shape: not covered
    if isinstance(x, Splat):
        return [Splat(np.asarray(x.value).view(aval.dtype), aval.shape)]
    return [_fold(lax.bitcast_convert_type(x, aval.dtype))]


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


def rule_names() -> list[str]:
    """The ops the lifter knows (``func.call`` and the returns besides)."""
    return sorted(RULES)


__all__ = [
    "RULES",
    "LiftError",
    "NoRule",
    "as_output",
    "fold",
    "foldable",
    "materialize",
    "rule_names",
]
