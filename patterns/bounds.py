"""Intervals that bound a value whatever the program's inputs are.

`interval(scope, atom)` is ``(lo, hi)`` with every element of ``atom`` in
``[lo, hi]`` for every input, or None when that cannot be proven.  It is read
from the value's producers: constants (by value), integer and boolean values
(their dtype's range at least: integer arithmetic wraps, so a wrapped result
still lies in it), and through ``add``, ``sub``, ``mul``, ``neg``, ``abs``,
``min``, ``max``, ``select_n``, ``cumsum``, conversions and moves
(broadcast, reshape, transpose, slice, concatenate...).  Anything else of a
float dtype is unbounded (None): an input, a division, an ``exp``...

Float results are widened outward by a few units in the last place of their
dtype (each operation rounds to nearest, at most half a unit away from the
exact result), and a float bound past the dtype's largest finite value is
None (the operation may overflow to infinity).  The arithmetic on the bounds
is float64; its own roundings are far inside that widening.
"""

from __future__ import annotations

import math

import numpy as np

#: Operations that move or copy elements and create none (the result's
#: values are among the first operand's).
_MOVES = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "slice",
        "dynamic_slice",
        "rev",
        "copy",
        "copy_p",
        "pvary",
    }
)

#: Larger bounds than this are not tracked through integer arithmetic (float64
#: holds every integer below it exactly); the dtype's range is used instead.
_EXACT = float(2**52)

_DEPTH = 64


def interval(scope, atom, depth: int = 0) -> tuple[float, float] | None:
    """``(lo, hi)`` bounding every element of ``atom`` for every input, or
    None (see the module doc).  Never a bound it cannot prove."""
    dtype = np.dtype(scope.dtype(atom))
    whole = _dtype_range(dtype)
    found = None if depth > _DEPTH else _computed(scope, atom, dtype, depth)
    if whole is None:  # a float
        return None if found is None else _rounded(found, dtype)
    if found is None or not (whole[0] <= found[0] and found[1] <= whole[1]):
        return whole  # wrapped, or not followed: anywhere in the dtype's range
    if max(abs(found[0]), abs(found[1])) > _EXACT:
        return whole
    return (math.floor(found[0]), math.ceil(found[1]))


def absorbs(fill: float, bound: tuple[float, float] | None, dtype) -> bool:
    """Whether ``fill + a`` rounds back to ``fill`` in ``dtype`` for every
    ``a`` in ``bound``: ``|a|`` below a quarter of ``fill``'s unit in the last
    place, so ``fill + a`` lies nearer ``fill`` than either neighbour (the one
    toward zero may be half a unit away when ``fill`` is a power of two; past
    the largest finite value, IEEE rounds to infinity only from a full unit's
    half-way point).  ``fill`` must be a finite normal number of ``dtype``."""
    if bound is None:
        return False
    info = _finfo(dtype)
    if info is None or not math.isfinite(fill) or abs(fill) < float(info.tiny):
        return False
    if float(np.asarray(fill, dtype)) != fill:
        return False  # not a value of the dtype: not what the program adds
    largest = max(abs(bound[0]), abs(bound[1]))
    exponent = math.floor(math.log2(abs(fill)))
    if 2.0**exponent > abs(fill):  # log2's rounding just below a power of two
        exponent -= 1
    return largest < 2.0 ** (exponent - info.nmant - 2)


def _finfo(dtype):
    try:
        import jax.numpy as jnp

        if not jnp.issubdtype(dtype, jnp.floating):
            return None
        return jnp.finfo(dtype)
    except (TypeError, ValueError):
        return None


def _dtype_range(dtype) -> tuple[float, float] | None:
    """An integer or boolean dtype's whole range; None for any other."""
    if dtype == np.bool_:
        return (0.0, 1.0)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return (float(info.min), float(info.max))
    return None


def _rounded(bound, dtype) -> tuple[float, float] | None:
    """``bound`` widened by what rounding to ``dtype`` may add; None past the
    dtype's finite range (or for a dtype that is no float)."""
    info = _finfo(dtype)
    if info is None:
        return None
    lo, hi = bound
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    eps, tiny = float(info.eps), float(info.smallest_subnormal)
    lo, hi = lo - 2 * eps * abs(lo) - tiny, hi + 2 * eps * abs(hi) + tiny
    big = float(info.max)
    if lo < -big or hi > big:
        return None
    return (lo, hi)


def _computed(scope, atom, dtype, depth):
    """The bound read from ``atom``'s value or producer, before the dtype's
    own range and rounding are applied; None when not followed."""
    value = scope.fold(atom)
    if value is not None:
        x = np.asarray(value, np.float64)
        if x.size == 0 or not np.all(np.isfinite(x)):
            return None
        return (float(x.min()), float(x.max()))
    node = scope.producer(atom)
    if node is None or len(node.outs) != 1 or node.eqn.effects:
        return None

    def of(i):
        return interval(scope, node.ins[i], depth + 1)

    prim = node.prim
    if prim in _MOVES or prim == "convert_element_type":
        return of(0)
    if prim == "concatenate":
        parts = [of(i) for i in range(len(node.ins))]
        if any(p is None for p in parts):
            return None
        return (min(p[0] for p in parts), max(p[1] for p in parts))
    if prim == "iota":
        return (0.0, float(max(node.params["shape"][node.params["dimension"]] - 1, 0)))
    if prim in ("add", "add_any", "sub", "mul", "max", "min"):
        a, b = of(0), of(1)
        if a is None or b is None:
            return None
        return _binary(prim, a, b)
    if prim == "neg":
        a = of(0)
        return None if a is None else (-a[1], -a[0])
    if prim == "abs":
        a = of(0)
        if a is None:
            return None
        if a[0] >= 0:
            return a
        return (0.0 if a[1] >= 0 else -a[1], max(-a[0], a[1]))
    if prim == "select_n":
        cases = [of(i) for i in range(1, len(node.ins))]
        if any(c is None for c in cases):
            return None
        return (min(c[0] for c in cases), max(c[1] for c in cases))
    if prim == "cumsum":
        a = of(0)
        if a is None:
            return None
        n = scope.shape(node.ins[0])[node.params["axis"]]
        # A running sum of k <= n terms, each in [lo, hi] (k = 1 at the first).
        return _summed(a, 1, n, dtype)
    if prim == "reduce_window_sum":
        a = of(0)
        if a is None:
            return None
        # Each window sums at most its size of terms (fewer where it overlaps
        # the padding, down to none).
        return _summed(a, 0, math.prod(node.params["window_dimensions"]), dtype)
    return None


def _summed(a, least: int, most: int, dtype):
    """The bound of a sum of ``least`` to ``most`` terms, each in ``a``; for a
    float, widened by what its partial sums' roundings may add (each at most
    one unit in the last place of a partial sum, itself within ``most`` terms'
    bound), whatever order the additions run in."""
    lo = min(least * a[0], most * a[0], 0.0 if least == 0 else a[0])
    hi = max(least * a[1], most * a[1], 0.0 if least == 0 else a[1])
    info = _finfo(dtype)
    if info is not None:
        slack = most * float(info.eps) * max(abs(lo), abs(hi))
        lo, hi = lo - slack, hi + slack
    return (lo, hi)


def _binary(prim, a, b):
    if prim in ("add", "add_any"):
        return (a[0] + b[0], a[1] + b[1])
    if prim == "sub":
        return (a[0] - b[1], a[1] - b[0])
    if prim == "max":
        return (max(a[0], b[0]), max(a[1], b[1]))
    if prim == "min":
        return (min(a[0], b[0]), min(a[1], b[1]))
    corners = [x * y for x in a for y in b]
    return (min(corners), max(corners))
