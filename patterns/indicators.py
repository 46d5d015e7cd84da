"""Masks written as arithmetic, normalised to a conjunction of boolean factors.

Libraries rarely hand the scores a plain boolean: they add a bias built from
one (``where(m, 0, NEG)``, ``(1 - m) * -1e9``, ``lax.select(m, zeros,
full(NEG))``), combine int masks (``minimum(causal, window)``, ``causal *
sliding``, ``a & b`` of int casts) and read them back (``m > 0``, ``m == 1``,
``m.astype(bool)``).  `two_valued` reads such a value *by value*: it proves

    value == where(f_1 & f_2 & ... , v_true, v_false)     (elementwise)

for boolean factors ``f_k`` of the program and two scalars, by following the
value back through casts, scalar-constant arithmetic, comparisons with a
scalar constant and selects between scalar constants, and by evaluating each
operation on the two values in the program's own dtype (NumPy, so ``1 - m``
in int32 and ``0 * -1e9 == -0.0`` are what the program computes).  Two
two-valued operands combine only when the operation is an AND of them on
those values (``op(a, b)`` equals ``v_false`` unless both are true: min or
product of 0/1, ``&``), checked on all four combinations.  Anything else
(an OR, a value from an input with more than two values, a traced scalar)
is not two-valued: the caller keeps it dense.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .common import Profile, profile, scalar_value

#: Comparison primitives as NumPy functions (also `masks`' and `structured`'s).
COMPARISONS = {
    "ge": np.greater_equal,
    "gt": np.greater,
    "le": np.less_equal,
    "lt": np.less,
    "eq": np.equal,
    "ne": np.not_equal,
}

#: A comparison with its operands swapped (``c < x`` is ``x > c``).
SWAPPED = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt", "eq": "eq", "ne": "ne"}

_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    **COMPARISONS,
}


@dataclasses.dataclass(frozen=True)
class TwoValued:
    """``value == where(all(factors), when_true, when_false)`` elementwise."""

    factors: tuple  # boolean Profiles against the value's target
    when_false: object  # NumPy scalars in the value's dtype
    when_true: object


def compose(scope, prof: Profile, operand) -> Profile:
    """Profile of ``operand`` (an input of ``prof.base``'s equation, same shape)
    against ``prof``'s target."""
    sub = profile(scope, operand, scope.shape(prof.base))
    axes = tuple(None if a is None else sub.axes[a] for a in prof.axes)
    return type(prof)(sub.base, axes, prof.target)


def _scalar(scope, prof: Profile, dtype):
    """The scalar ``prof`` broadcasts, in ``dtype``: through dtype conversions
    of the broadcast (``jnp.full(shape, 0.0).astype(dtype)``, Hugging Face
    Flax's attention bias), each a rounding to ``dtype`` numpy repeats."""
    while not prof.is_scalar:
        node = scope.producer(prof.base)
        if node is None or node.prim != "convert_element_type":
            return None
        prof = compose(scope, prof, node.ins[0])
    value = scalar_value(scope, prof.base)
    return None if value is None else np.asarray(value).astype(dtype)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()  # -0.0 != 0.0; NaN == NaN


def two_valued(scope, prof: Profile, depth: int = 0) -> TwoValued | None:
    """``prof``'s value as `TwoValued` (see the module doc), or None."""
    if depth > 32:
        return None
    dtype = np.dtype(scope.dtype(prof.base))
    node = scope.producer(prof.base)
    leaf = TwoValued((prof,), np.False_, np.True_) if dtype == np.bool_ else None
    if node is None:
        return leaf
    prim = node.prim

    def sub(x):
        return two_valued(scope, compose(scope, prof, x), depth + 1)

    if prim == "convert_element_type":
        inner = sub(node.ins[0])
        if inner is None:
            return leaf
        return TwoValued(inner.factors, *(np.asarray(v).astype(dtype) for v in _values(inner)))
    if prim in ("neg", "not"):
        # A boolean ``~m`` of a two-valued ``m`` swaps its two values, so
        # ``where(~(a & b), NEG, 0)`` (PyTorch's ``masked_fill(~mask, -inf)``)
        # is read through to the factors of ``a & b``; one read through
        # nothing is its own factor.
        inner = sub(node.ins[0])
        if inner is None:
            return leaf
        fn = np.negative if prim == "neg" else np.invert
        return TwoValued(inner.factors, *map(fn, _values(inner)))
    if prim == "select_n" and len(node.ins) == 3:
        cases = [_scalar(scope, compose(scope, prof, x), dtype) for x in node.ins[1:]]
        pred = sub(node.ins[0])
        if pred is None or any(c is None for c in cases):
            return leaf
        # select_n picks cases[pred]: map pred's two values through it.
        if not all(int(v) in (0, 1) and int(v) == v for v in _values(pred)):
            return leaf
        pick = [cases[int(v)] for v in _values(pred)]
        return TwoValued(pred.factors, *pick)
    if prim in _BINARY and len(node.ins) == 2:
        found = _binary(scope, prof, node, dtype, sub)
        return leaf if found is None else found
    return leaf


def _values(tv: TwoValued):
    return tv.when_false, tv.when_true


def _binary(scope, prof, node, dtype, sub):
    fn = _BINARY[node.prim]
    sides = [compose(scope, prof, x) for x in node.ins]
    in_dtype = np.dtype(scope.dtype(node.ins[0]))
    consts = [_scalar(scope, s, in_dtype) for s in sides]
    if consts[0] is not None and consts[1] is not None:
        return None
    with np.errstate(all="ignore"):
        for k in (0, 1):
            if consts[1 - k] is None:
                continue
            inner = sub(node.ins[k])
            if inner is None:
                return None
            c = consts[1 - k]
            out = [fn(v, c) if k == 0 else fn(c, v) for v in _values(inner)]
            return TwoValued(inner.factors, *(np.asarray(v).astype(dtype) for v in out))
        a, b = sub(node.ins[0]), sub(node.ins[1])
        if a is None or b is None:
            return None
        table = {(x, y): fn(_values(a)[x], _values(b)[y]) for x in (0, 1) for y in (0, 1)}
    low = table[(0, 0)]
    if not (_same(table[(0, 1)], low) and _same(table[(1, 0)], low)):
        return None  # not an AND of the two (an OR, a sum of masks...)
    values = (np.asarray(low).astype(dtype), np.asarray(table[(1, 1)]).astype(dtype))
    return TwoValued(a.factors + b.factors, *values)


def boolean_factors(scope, prof: Profile):
    """A boolean ``prof`` as a conjunction of other boolean factors
    (``m > 0`` of ``minimum(int(a), int(b))`` is ``a & b``), or None when it
    is not read through anything (it is its own factor)."""
    found = two_valued(scope, prof)
    if found is None or (len(found.factors) == 1 and found.factors[0] == prof):
        return None
    if not (found.when_false == np.False_ and found.when_true == np.True_):
        return None
    return list(found.factors)
