"""The lifting rules of contractions and reductions: ``dot_general``,
``reduce``, ``reduce_window``, ``sort``, ``scatter`` (`flashpass.export.ops`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass import compat

from .rules import RULES, NoRule, _attr, _aval, _fold, _i64s, _index_vector_last, _int, _rule
from .values import constant_value, dense_constant, materialize, tensor_aval

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


@_rule("stablehlo.convolution")
def _convolution(interp, op, operands):
    """``lax.conv_general_dilated`` (a ViT's or a speech model's patch and
    feature convolutions): every dimension number, stride, padding, dilation
    and group count read from the op, and its operands' precisions; a
    reversed window is kept as an island."""
    sh = compat.stablehlo_dialect()
    dn = sh.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    spatial = len(dn.input_spatial_dimensions)
    reversal = _attr(op, "window_reversal")
    if reversal is not None and any(str(x).lower() == "true" for x in _bools(reversal)):
        raise NoRule
    ones = (1,) * spatial
    padding = _attr(op, "padding")
    pads = [(0, 0)] * spatial
    if padding is not None:
        pads = [tuple(int(v) for v in row) for row in np.asarray(padding).reshape(spatial, 2)]
    numbers = lax.ConvDimensionNumbers(
        lhs_spec=(
            dn.input_batch_dimension,
            dn.input_feature_dimension,
            *dn.input_spatial_dimensions,
        ),
        rhs_spec=(
            dn.kernel_output_feature_dimension,
            dn.kernel_input_feature_dimension,
            *dn.kernel_spatial_dimensions,
        ),
        out_spec=(
            dn.output_batch_dimension,
            dn.output_feature_dimension,
            *dn.output_spatial_dimensions,
        ),
    )
    lhs, rhs = (materialize(x) for x in operands)
    out = lax.conv_general_dilated(
        lhs,
        rhs,
        window_strides=_i64s(_attr(op, "window_strides")) or ones,
        padding=pads,
        lhs_dilation=_i64s(_attr(op, "lhs_dilation")) or ones,
        rhs_dilation=_i64s(_attr(op, "rhs_dilation")) or ones,
        dimension_numbers=numbers,
        feature_group_count=_int(op.attributes["feature_group_count"]),
        batch_group_count=_int(op.attributes["batch_group_count"]),
        precision=_precision(op),
        preferred_element_type=_aval(op).dtype,
    )
    if out.shape != _aval(op).shape:
        raise NoRule  # a form this reading misses: kept as written
    return [_fold(out)]


def _precision(op):
    """The op's ``precision_config`` as lax's pair, or None (the default)."""
    config = _attr(op, "precision_config")
    if config is None:
        return None
    names = re.findall(r"precision\s+(\w+)", str(config))
    if len(names) != 2 or any(n not in ("DEFAULT", "HIGH", "HIGHEST") for n in names):
        raise NoRule
    return tuple(lax.Precision[n] for n in names)


def _bools(attr) -> list:
    ir = compat.ir_module()
    try:
        return list(ir.DenseBoolArrayAttr(attr))
    except (ValueError, TypeError):
        return list(np.asarray(attr).ravel())


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
        return tuple(materialize(x) for x in interp.run_region(op.regions[0], [*a, *b]))

    init_values = [materialize(x) for x in inits]
    inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in inputs]
    if any(inexact) and not all(inexact):
        return list(_mixed_reduce(computation, dims, inexact)(*inputs, *init_values))
    return list(lax.reduce(tuple(inputs), tuple(init_values), computation, dims))


def _mixed_reduce(computation, dims, inexact):
    """``lax.reduce`` of float and integer operands (an argmax: the values and
    their positions), with a derivative.  JAX's own JVP of a general reduce
    reshapes every operand's tangent, and an integer operand's is a symbolic
    zero, which fails; this one differentiates the same pairwise tree of the
    body (what JAX's rule does) in the float operands alone."""
    n = len(inexact)

    @jax.custom_jvp
    def reduce(*operands):
        xs, inits = operands[:n], operands[n:]
        return tuple(lax.reduce(tuple(xs), tuple(inits), computation, dims))

    @reduce.defjvp
    def jvp(primals, tangents):
        xs, inits = primals[:n], primals[n:]
        floats = [i for i in range(n) if inexact[i]]

        def tree(*float_xs):
            full = list(xs)
            for i, x in zip(floats, float_xs, strict=True):
                full[i] = x
            return _reduce_tree(computation, full, inits, dims)

        out = reduce(*primals)
        _, tangent = jax.jvp(tree, [xs[i] for i in floats], [tangents[i] for i in floats])
        return out, tuple(tangent)

    return reduce


def _reduce_tree(computation, xs, inits, dims):
    """The reduction of ``xs`` over ``dims`` as a pairwise tree of ``computation``
    (`lax`'s general reduce JVP, jax/_src/lax/lax.py ``_reduce_jvp``)."""
    shape = xs[0].shape
    rest = [d for d in range(len(shape)) if d not in dims]
    size = int(np.prod([shape[d] for d in dims]))
    flat = (size, *(shape[d] for d in rest))
    xs = [lax.reshape(x, flat, (*dims, *rest)) for x in xs]
    reducer = lambda *ab: computation(ab[: len(xs)], ab[len(xs) :])  # noqa: E731
    for _ in range(len(rest) + 1):
        reducer = jax.vmap(reducer)
    while xs[0].shape[0] > 1:
        half = (xs[0].shape[0] + 1) // 2
        first = [lax.slice_in_dim(x, 0, half) for x in xs]
        second = [lax.slice_in_dim(x, half, None) for x in xs]
        if second[0].shape[0] != half:
            pads = [(0, 1, 0)] + [(0, 0, 0)] * len(rest)
            second = [lax.pad(x, i, pads) for x, i in zip(second, inits, strict=True)]
        xs = list(reducer(*first, *second))
    if xs[0].shape[0] == 0:
        return tuple(lax.full(flat[1:], i, i.dtype) for i in inits)
    return tuple(lax.squeeze(x, (0,)) for x in xs)


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


def _owner(value, name: str):
    """The op defining ``value`` where it is a ``name`` op, else None."""
    owner = value.owner
    if hasattr(owner, "operation") and owner.operation.name == name:
        return owner.operation
    return None


def _constant_of(value) -> np.ndarray | None:
    """The value of a ``stablehlo.constant`` (a comparator's ``0.0`` or NaN), else None."""
    owner = _owner(value, "stablehlo.constant")
    if owner is None:
        return None
    return constant_value(dense_constant(owner.attributes["value"], tensor_aval(value.type)))


def _direction(op) -> str:
    sh = compat.stablehlo_dialect()
    return sh.ComparisonDirectionAttr(op.attributes["comparison_direction"]).value


def _is_compare(op, direction: str, lhs, rhs) -> bool:
    return (
        op is not None
        and _direction(op) == direction
        and list(op.operands) == [lhs, rhs]
        and "TOTALORDER" not in str(_attr(op, "compare_type"))
    )


def _comparator_operand(value, args: list) -> tuple | None:
    """``(i, canonical)`` where ``value`` is the comparator's argument ``i``
    (``canonical=False``) or JAX's canonical form of it for sorting floats,
    ``select(x != x, NaN, select(x == 0, 0, x))`` (every NaN one NaN, -0 equal
    to 0; ``canonical=True``); else None."""
    if value in args:
        return args.index(value), False
    outer = _owner(value, "stablehlo.select")
    if outer is None:
        return None
    is_nan, nan, inner = outer.operands
    inner_op = _owner(inner, "stablehlo.select")
    if inner_op is None:
        return None
    is_zero, zero, x = inner_op.operands
    if x not in args:
        return None
    nan_value, zero_value = _constant_of(nan), _constant_of(zero)
    if nan_value is None or zero_value is None or nan_value.size != 1 or zero_value.size != 1:
        return None
    if not np.isnan(nan_value).all() or not (zero_value == 0).all():
        return None
    if not _is_compare(_owner(is_nan, "stablehlo.compare"), "NE", x, x):
        return None
    if not _is_compare(_owner(is_zero, "stablehlo.compare"), "EQ", x, zero):
        return None
    return args.index(x), True


def _sort_order(op) -> tuple | None:
    """``(key, descending, canonical, compare_type)`` of a comparator that orders by operand
    ``key`` alone: ``return compare(LT or GT, f(a_key), f(b_key))`` with ``f``
    the identity or JAX's canonical float form (`_comparator_operand`), either
    argument first; else None."""
    block = op.regions[0].blocks[0]
    args = list(block.arguments)
    body = [o for o in block.operations if o.operation.name != "stablehlo.constant"]
    ret = body[-1]
    if len(ret.operands) != 1:
        return None
    compare = _owner(ret.operands[0], "stablehlo.compare")
    if compare is None or _direction(compare) not in ("LT", "GT"):
        return None
    lhs, rhs = (_comparator_operand(v, args) for v in compare.operands)
    if lhs is None or rhs is None or lhs[1] != rhs[1]:
        return None
    first, second = lhs[0], rhs[0]
    if first // 2 != second // 2 or first == second:
        return None
    canonical = lhs[1]
    if len(body) != 2 + (8 if canonical else 0):
        return None  # the comparator computes something besides (another key)
    swapped = first % 2 == 1  # compare(b, a): the other direction
    descending = (_direction(compare) == "GT") != swapped
    kind = _attr(compare, "compare_type")
    return first // 2, descending, canonical, "" if kind is None else str(kind)


def _total_order_bits(x):
    """Integers ordered as ``x``'s floats are in IEEE total order (-NaN < -inf
    < ... < -0 < 0 < ... < inf < NaN, every bit pattern its own rank)."""
    width = jnp.dtype(x.dtype).itemsize * 8
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"int{width}"))
    magnitude = np.asarray(np.iinfo(bits.dtype).max, bits.dtype)
    return lax.select(bits < 0, lax.bitwise_xor(bits, lax.full_like(bits, magnitude)), bits)


def _canonical(x):
    """JAX's canonical float for sorting: every NaN one NaN, -0 as 0."""
    zero, nan = lax.full_like(x, 0), lax.full_like(x, np.nan)
    return lax.select(lax.ne(x, x), nan, lax.select(lax.eq(x, zero), zero, x))


@_rule("stablehlo.sort")
def _sort(interp, op, operands):
    """A sort keyed on one operand, ascending or descending: `lax.sort`.

    lax.sort orders floats as JAX's comparator does (canonical NaN and 0, then
    total order, ascending).  Any other order of one key (the raw IEEE total
    order, which tells -0 from 0 and NaNs apart, or descending, as
    ``chlo.top_k``'s decomposition sorts) sorts on an integer key of the same
    order, prepended to the operands, which are carried along unchanged: the
    values are the module's bit for bit and their derivative is the
    permutation's."""
    found = _sort_order(op)
    if found is None:
        raise NoRule
    key, descending, canonical, kind = found
    inputs = [materialize(x) for x in operands]
    dtype = jnp.dtype(inputs[key].dtype)
    floating = jnp.issubdtype(dtype, jnp.floating)
    if floating and "TOTALORDER" not in kind:
        raise NoRule  # a partial float order (NaN unordered) is no strict weak order
    if not floating:
        signed = jnp.issubdtype(dtype, jnp.signedinteger)
        if canonical or not (
            signed or jnp.issubdtype(dtype, jnp.unsignedinteger) or dtype.kind == "b"
        ):
            raise NoRule
        if kind and kind.rstrip(">").split()[-1] != ("SIGNED" if signed else "UNSIGNED"):
            raise NoRule  # e.g. signed integers compared unsigned: another order
    dimension = _int(op.attributes["dimension"])
    stable = _attr(op, "is_stable")
    is_stable = stable is not None and str(stable) == "true"
    if not descending and (canonical or not floating):
        # lax.sort's own order: the key first, the others after it.
        order = [key] + [i for i in range(len(inputs)) if i != key]
        out = lax.sort(
            tuple(inputs[i] for i in order), dimension=dimension, is_stable=is_stable, num_keys=1
        )
        results = [None] * len(inputs)
        for i, x in zip(order, out, strict=True):
            results[i] = x
        return [_fold(x) for x in results]
    k = inputs[key]
    if floating:
        k = _total_order_bits(_canonical(k) if canonical else k)
    if descending:
        k = lax.bitwise_not(k)  # reverses an integer order exactly
    out = lax.sort((k, *inputs), dimension=dimension, is_stable=is_stable, num_keys=1)
    return [_fold(x) for x in out[1:]]


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
