"""Per-row kv lengths: ``where(key < lengths[b], s, fill)`` becomes `KvLengths`.

A KV cache filled to a different length per batch row is masked with a
comparison of the key position against the row's length, in any of these
spellings (each a structured mask, recognised before a dense `Mask`)::

    jnp.arange(S)[None, :] < lengths[:, None]       # [B, S], broadcast later
    lax.broadcasted_iota(jnp.int32, (B, H, T, S), 3) < lengths[:, None, None, None]
    lengths[:, None] > jnp.arange(S)                # flipped operands
    jnp.arange(S) <= last[:, None]                  # <=: shift 1
    ~(jnp.arange(S) >= lengths[:, None])            # the negated form
    jnp.where(jnp.arange(S) >= lengths[:, None], fill, s)   # keep where False

Chunked prefill compares the key position with each query's own position
in the cache (``k_pos[None, None, :] <= q_pos[:, :, None]``, ``q_pos =
start[:, None] + arange(T)``): the "length" then varies over queries too, and
is kept as the program's ``[B, T]`` array (O(T), never ``T x S``).

The proof is structural: one operand must be affine in the indices with
coefficient exactly 1 along the key axis and 0 elsewhere (``j + c``, from
iotas; `common.affine`), the other an integer array that is broadcast along
the key axis (it varies over batch rows, heads and queries only).
Then ``keep == (j + c < L)`` (or ``<=``) for every index, which is
``KvLengths(shift=-c)`` (or ``1 - c``).  Near misses stay dense masks: a
length that varies over keys, a key coefficient other than 1, ``j > L``
(keeping the tail: left padding), float lengths, a fill that does not
exclude keys, a lengths dtype too narrow for ``S``.
"""

from __future__ import annotations

import numpy as np

from flashpass.spec import KvLengths, excludes

from .common import Profile, affine, broadcast_affine
from .masks import compose, mask_recogniser

_COMPARISONS = ("lt", "le", "gt", "ge")


@mask_recogniser(rank=10)
def kv_lengths(build, factor: Profile, keep_when: bool, fill: float) -> bool:
    """Add a `KvLengths` op for a key-length mask factor (see module doc)."""
    found = match_kv_lengths(build.scope, factor, build.roles, keep_when, fill)
    if found is None:
        return False
    lengths, shift = found
    dtype = build.scope.dtype(lengths.base)
    index, shape4 = build.add_extra(lengths, None, dtype)
    build.ops.append(KvLengths(index, shape4, fill, shift))
    return True


def match_kv_lengths(scope, factor: Profile, roles, keep_when: bool, fill: float):
    """``(lengths Profile against the scores, shift)`` if the boolean ``factor``
    keeps (where it equals ``keep_when``) exactly the keys ``j < L + shift``;
    else None."""
    if fill is None or not excludes(fill):
        return None
    base = scope.resolve(factor.base)
    node = scope.producer(base)
    while node is not None and node.prim == "not":  # elementwise: same axes
        keep_when = not keep_when
        base = scope.resolve(node.ins[0])
        node = scope.producer(base)
    if node is None or node.prim not in _COMPARISONS or len(node.ins) != 2:
        return None
    role_of = {a: roles[t] for t, a in enumerate(factor.axes) if a is not None}
    key_axes = [a for a, r in role_of.items() if r == "S"]
    if len(key_axes) != 1:
        return None
    key_axis = key_axes[0]
    rank = len(scope.shape(base))
    # The predicate reads ``small < big`` (or ``<=``).
    strict = node.prim in ("lt", "gt")
    small, big = node.ins if node.prim in ("lt", "le") else node.ins[::-1]
    offset = _key_offset(scope, small, rank, key_axis)
    if offset is not None:  # j + c (<|<=) L: keep where it holds
        if not keep_when:
            return None  # keeps j + c >= L: a tail (left padding), not a length
        length_side = big
    else:  # L (<|<=) j + c: keep where it fails, i.e. j + c (<=|<) L
        offset = _key_offset(scope, big, rank, key_axis)
        if offset is None or keep_when:
            return None
        length_side, strict = small, not strict
    dtype = np.dtype(scope.dtype(length_side))
    if not np.issubdtype(dtype, np.signedinteger):
        return None
    shift = -offset + (0 if strict else 1)
    kv_len = factor.target[list(roles).index("S")]
    if np.iinfo(dtype).max < kv_len + abs(shift) + 1 + abs(offset):
        return None  # the kernel's clip bound must fit the lengths' dtype
    lengths = compose(scope, Profile(base, factor.axes, factor.target), length_side)
    for t, a in enumerate(lengths.axes):
        if a is not None and roles[t] == "S":
            return None  # varies over keys: not a length
    return lengths, shift


def _key_offset(scope, atom, rank: int, key_axis: int) -> int | None:
    """``c`` if ``atom`` equals ``j + c`` (``j`` the index along ``key_axis``)
    at every index, proven from iotas or from its folded value; else None."""
    if not np.issubdtype(np.dtype(scope.dtype(atom)), np.signedinteger):
        return None
    found = affine(scope, atom)
    if found is not None:
        coef, const = broadcast_affine(found, rank)
        want = tuple(1 if a == key_axis else 0 for a in range(rank))
        return const if coef == want else None
    value = scope.fold(atom)
    if value is None:
        return None
    value = np.asarray(value)
    shape = scope.shape(atom)
    if value.ndim != rank or tuple(value.shape) != tuple(shape):
        return None
    n = shape[key_axis]
    line = np.arange(n).reshape([n if a == key_axis else 1 for a in range(rank)])
    const = int(value.reshape(-1)[0])
    return const if np.array_equal(value, np.broadcast_to(line + const, shape)) else None
