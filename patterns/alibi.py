"""ALiBi: a bias ``slope[h] * (j - i)`` (or ``slope[h] * j``) becomes `Alibi`.

Read on an additive bias (`masks.bias_recogniser`) that is a product of two
factors: the *slopes*, which vary over batch rows and heads only (a constant
such as ``2 ** (-8 h / H)`` or an input), and the *distance*, a float value
affine in the query and key indices with key coefficient ±1 and query
coefficient 0 or ∓1 (``j - i``, ``i - j``, ``j``; any constant offset).
The distance is proven affine symbolically (integer iotas converted to
float, `common.affine`) or, when the program captured it as a constant, by
value.  The slopes become an O(H) extra; the kernel computes the distance
per tile.  Near misses stay a dense `Bias`: slopes that vary over queries or
keys, a distance that is not affine (``|j - i|``, clipped), a key
coefficient other than ±1, a bias below float32 (the product would round
differently).
"""

from __future__ import annotations

import numpy as np

from flashpass.site import Transform
from flashpass.spec import Alibi

from .common import Profile, affine
from .masks import bias_recogniser, compose

#: Distances a float32 holds exactly (and the kernel then computes exactly).
_EXACT = 1 << 24


@bias_recogniser(rank=10)
def alibi(build, prof: Profile, sign: int) -> bool:
    """Add an `Alibi` op for a bias ``slopes * distance`` (see module doc)."""
    scope, roles = build.scope, build.roles
    dtype = np.dtype(scope.dtype(prof.base))
    if dtype not in (np.float32, np.float64):
        return False
    node = scope.producer(scope.resolve(prof.base))
    if node is None or node.prim != "mul" or len(node.ins) != 2:
        return False
    t_len, s_len = build.layout.sizes["T"], build.layout.sizes["S"]
    if max(t_len, s_len) >= _EXACT:
        return False
    sides = [compose(scope, prof, x) for x in node.ins]
    for slopes, dist in (sides, sides[::-1]):
        carried = {roles[t] for t, a in enumerate(slopes.axes) if a is not None}
        if not carried or carried & {"T", "S"}:
            continue
        if not np.issubdtype(np.dtype(scope.dtype(slopes.base)), np.floating):
            continue
        found = distance(scope, dist, roles)
        if found is None:
            continue
        q_coef, k_coef, const = found
        if k_coef not in (1, -1) or q_coef not in (0, -k_coef):
            continue
        # slope * k_coef * (j + q_coef / k_coef * i + const / k_coef)
        negate = (sign * k_coef) < 0
        index, shape4 = build.add_extra(slopes, Transform.NEG if negate else None, dtype)
        build.ops.append(Alibi(index, shape4, abs(q_coef), const * k_coef))
        return True
    return False


def distance(scope, prof: Profile, roles) -> tuple[int, int, int] | None:
    """``(q_coef, k_coef, const)`` with ``prof``'s value ``q_coef * i + k_coef
    * j + const`` at every index (constant over every other axis), else None."""
    base = scope.resolve(prof.base)
    at = {roles[t]: a for t, a in enumerate(prof.axes) if a is not None}
    if "S" not in at or set(at) - {"T", "S"}:
        return None
    shape = scope.shape(base)
    rank = len(shape)
    found = _symbolic(scope, base, rank)
    if found is None:
        found = _by_value(scope, base)
    if found is None:
        return None
    coef, const = found
    carried = {a: coef[a] for a in range(rank) if coef[a] and shape[a] > 1}
    by_axis = {at.get("T"): "T", at["S"]: "S"}
    if any(a not in by_axis for a in carried):
        return None  # varies along an axis that is not the query's or key's
    role_coef = {by_axis[a]: c for a, c in carried.items()}
    return role_coef.get("T", 0), role_coef.get("S", 0), const


def _symbolic(scope, atom, rank):
    """`common.affine` of an integer value seen through float conversions."""
    while True:
        node = scope.producer(scope.resolve(atom))
        if node is None or node.prim != "convert_element_type":
            break
        atom = node.ins[0]
        if np.issubdtype(np.dtype(scope.dtype(atom)), np.integer):
            found = affine(scope, atom)
            if found is None or len(found[0]) != rank:
                return None
            return found
    return None


def _by_value(scope, atom):
    """``(coef per axis, const)`` of a constant affine in its indices, with
    integer coefficients, by value; else None."""
    value = scope.fold(atom)
    if value is None:
        return None
    x = np.asarray(value, np.float64)
    if x.size == 0 or not np.all(np.isfinite(x)):
        return None
    const = x.reshape(-1)[0]
    coef = []
    for a in range(x.ndim):
        if x.shape[a] < 2:
            coef.append(0)
            continue
        step = np.take(x, 1, axis=a).reshape(-1)[0] - const
        coef.append(step)
    if any(c != round(c) for c in [*coef, const]):
        return None
    idx = np.indices(x.shape, sparse=True)
    expect = const + sum(c * i for c, i in zip(coef, idx, strict=True))
    if not np.array_equal(x, np.broadcast_to(expect, x.shape)):
        return None
    return tuple(int(c) for c in coef), int(const)
