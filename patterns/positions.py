"""Masks on positions that are data: per-example prefix lengths, input positions.

Registered with `masks.mask_recogniser` (tried before a dense `Mask`):

* **Per-example prefix-LM** (`PrefixLengths`): ``(j <= i) | (j < L[b])`` with
  ``L`` an integer array (an input, or computed) that never varies over keys:
  the causal half-space is proven from iotas (`masks.halfspaces`), the
  length comparison as `KvLengths` proves it (`lengths.match_kv_lengths`).
* **Positions from inputs** (`PositionMask`): ``cmp(kv_pos[.., j] + a,
  q_pos[.., i] + b)`` with integer position arrays, the one on the left
  varying over keys and not queries, the other over queries and not keys
  (gemma's ``positions[:, None, :] > positions[:, :, None] - W``), ``a`` and
  ``b`` scalar constants added or subtracted.  Both arrays become O(T)
  extras; the op adds the constants in their dtype as the program does.
"""

from __future__ import annotations

import numpy as np

from flashpass.spec import Causal, PositionMask, PrefixLengths, excludes

from .common import Profile, scalar_value
from .lengths import match_kv_lengths
from .masks import classify, compose, halfspaces, mask_recogniser

_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}


def _carried(prof: Profile, roles) -> set:
    return {roles[t] for t, a in enumerate(prof.axes) if a is not None}


@mask_recogniser(rank=20)
def prefix_lengths(build, factor: Profile, keep_when: bool, fill: float) -> bool:
    """``(j <= i) | (j < L)`` with data ``L`` as `PrefixLengths`."""
    if not keep_when or not excludes(fill):
        return False
    scope, roles = build.scope, build.roles
    node = scope.producer(scope.resolve(factor.base))
    if node is None or node.prim != "or" or len(node.ins) != 2:
        return False
    sides = [compose(scope, factor, x) for x in node.ins]
    for causal, length in (sides, sides[::-1]):
        if not _is_causal(scope, causal, roles, fill):
            continue
        found = match_kv_lengths(scope, length, roles, True, fill)
        if found is None:
            continue
        lengths, shift = found
        if lengths.is_scalar and scope.fold(lengths.base) is not None:
            return False  # one static length: `structured.recognise_prefix`'s `Prefix`
        index, shape4 = build.add_extra(lengths, None, scope.dtype(lengths.base))
        build.ops.append(PrefixLengths(index, shape4, fill, shift))
        return True
    return False


def _is_causal(scope, prof: Profile, roles, fill) -> bool:
    """Whether ``prof`` keeps exactly ``j <= i``: one half-space ``i - j >= 0``
    from iotas, or a constant that `masks.classify` reads as causal."""
    halves = halfspaces(scope, prof.base)
    if halves is None or len(halves) != 1:
        found = classify(scope, prof, roles, keep_when=True, fill=fill)
        return isinstance(found, Causal) and found.offset == 0
    coef, const = halves[0]
    shape = scope.shape(prof.base)
    role_of = {a: roles[t] for t, a in enumerate(prof.axes) if a is not None}
    by_role = {}
    for axis, c in enumerate(coef):
        if c and shape[axis] > 1:
            if axis not in role_of:
                return False
            by_role[role_of[axis]] = c
    return by_role == {"T": 1, "S": -1} and const == 0


@mask_recogniser(rank=30)
def position_mask(build, factor: Profile, keep_when: bool, fill: float) -> bool:
    """``cmp(kv_pos + a, q_pos + b)`` with position arrays as `PositionMask`."""
    if not excludes(fill):
        return False
    scope, roles = build.scope, build.roles
    base = scope.resolve(factor.base)
    node = scope.producer(base)
    while node is not None and node.prim == "not":
        keep_when = not keep_when
        base = scope.resolve(node.ins[0])
        node = scope.producer(base)
    if node is None or node.prim not in _FLIP or len(node.ins) != 2:
        return False
    prof = Profile(base, factor.axes, factor.target)
    left, right = (_position_side(scope, compose(scope, prof, x), roles) for x in node.ins)
    if left is None or right is None:
        return False
    cmp = node.prim
    if left[2] == "T" and right[2] == "S":
        left, right, cmp = right, left, _FLIP[cmp]
    if (left[2], right[2]) != ("S", "T"):
        return False
    if not keep_when:
        cmp = _NEGATE[cmp]
    (k_pos, k_add, _), (q_pos, q_add, _) = left, right
    dtype = scope.dtype(k_pos.base)
    if dtype != scope.dtype(q_pos.base):
        return False
    q_index, _ = build.add_extra(q_pos, None, dtype)
    kv_index, _ = build.add_extra(k_pos, None, dtype)
    build.ops.append(PositionMask(q_index, kv_index, cmp, fill, k_add, q_add))
    return True


def _position_side(scope, prof: Profile, roles):
    """``(array Profile, added constant, "T" or "S")`` of one comparison side:
    a signed-integer array varying over exactly one of queries and keys,
    plus or minus scalar constants; else None."""
    add = 0
    while True:
        if not np.issubdtype(np.dtype(scope.dtype(prof.base)), np.signedinteger):
            return None
        node = scope.producer(scope.resolve(prof.base))
        if node is None or node.prim not in ("add", "sub") or len(node.ins) != 2:
            break
        parts = [compose(scope, prof, x) for x in node.ins]
        consts = [_int_scalar(scope, p) for p in parts]
        if node.prim == "add" and consts[0] is not None:
            parts, consts = parts[::-1], consts[::-1]
        if consts[1] is None:
            break
        c = consts[1] if node.prim == "add" else -consts[1]
        add, prof = _wrap(add + c, scope.dtype(prof.base)), parts[0]
    carried = _carried(prof, roles) & {"T", "S"}
    if len(carried) != 1:
        return None
    if scope.fold(prof.base) is not None:
        return None  # static positions: the structured readings' case (`structured`)
    return prof, add, carried.pop()


def _wrap(value: int, dtype) -> int:
    """``value`` modulo the dtype's range: integer adds wrap, so ``(x + a) + b``
    equals ``x + wrap(a + b)`` in the dtype."""
    info = np.iinfo(np.dtype(dtype))
    span = int(info.max) - int(info.min) + 1
    return (value - int(info.min)) % span + int(info.min)


def _int_scalar(scope, prof: Profile):
    if not prof.is_scalar:
        return None
    value = scalar_value(scope, prof.base)
    return None if value is None or value != int(value) else int(value)
