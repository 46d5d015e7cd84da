"""Structured masks as O(T) descriptors: windows, chunks, prefix-LM, segment ids.

Registered with `masks.mask_recogniser`, so each runs on a mask factor that is
not a plain constant causal mask, before it would become a dense `Mask`.  Each
*proves* its descriptor equals the factor for every index, or declines:

* **Diagonal masks** (`Window`, and `Causal` in spellings the causal classifier
  does not read: ``tril - tril``, XOR of trils, ``abs(i - j) < w``...).  The
  factor is evaluated symbolically as a function of ``d = j - i`` alone: a
  vector over the ``T + S - 1`` diagonals, built from iotas, scalar constants,
  affine arithmetic, comparisons, logic and selects (`diagonal`).  Any size,
  O(T) work.  Constant masks that fold are also read by value (Toeplitz check).
* **Chunks** (`Chunk`): ``f[i] == g[j]`` with ``f`` and ``g`` constant vectors
  over queries and keys (``arange(T) // C``) whose runs are the chunks.
* **Prefix-LM** (`Prefix`): ``(j <= i) | (j < L)`` with a static ``L``, as two
  half-spaces, or by value.
* **Segment ids** (`Segments`): ``q_ids[b, i] == kv_ids[b, j]`` structurally,
  with integer ids computed by the program (inputs, a cumsum over EOS tokens...):
  the two id arrays become extras, never ``T x S``.

A descriptor is added like a causal op (`SiteBuilder.add_causal` with the
factor as its `CausalSource`): if a later op undoes its fill's exclusion, the
builder puts the literal dense mask back.
"""

from __future__ import annotations

import numpy as np

from flashpass.graph import Const
from flashpass.spec import Causal, Chunk, Prefix, Segments, Window, excludes

from .common import (
    affine,
    folded_matrix,
    query_key_axes,
    scalar_value,
    score_sizes,
    unit_reshape_map,
)
from .indicators import COMPARISONS as _CMP
from .masks import compose, halfspaces, mask_recogniser

_LOGIC = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}
_ARITH = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum}
_ARITH["min"] = np.minimum
_UNARY = {"not": lambda x: ~x if x.dtype == np.bool_ else np.invert(x), "neg": np.negative}
_UNARY["abs"] = np.abs


# --------------------------------------------------------------------------- diagonals


def diagonal(scope, atom, tax, sax, t_len, s_len, depth=0):
    """``atom`` as a function of ``d = j - i`` alone: a numpy vector ``v`` with
    ``atom[..., i, ..., j, ...] == v[j - i + t_len - 1]`` for every index, or
    None.  ``tax``/``sax`` are the atom's query/key axes (None: not carried)."""
    if depth > 48:
        return None
    atom = scope.resolve(atom)
    shape = scope.shape(atom)
    if not shape:  # a rank-0 operand of an elementwise op broadcasts over every axis
        tax = sax = None
    dtype = scope.dtype(atom)
    n = t_len + s_len - 1
    d = np.arange(n) - (t_len - 1)
    if isinstance(atom, Const) or scope.producer(atom) is None or (tax is None and sax is None):
        value = scalar_value(scope, atom) if (not shape or np.prod(shape) < 1 << 16) else None
        if value is None:
            return None
        return np.full(n, value, dtype)
    if np.issubdtype(dtype, np.integer):
        aff = affine(scope, atom)
        if aff is not None:
            coef, const = aff
            others = [c for a, c in enumerate(coef) if a not in (tax, sax)]
            ct = coef[tax] if tax is not None else 0
            cs = coef[sax] if sax is not None else 0
            if not any(others) and ct == -cs:
                return (const + cs * d).astype(dtype)  # ct*i + cs*j == cs*d
            return None
    node = scope.producer(atom)
    prim = node.prim

    def sub(x, t=tax, s=sax):
        return diagonal(scope, x, t, s, t_len, s_len, depth + 1)

    if prim in _CMP or prim in _LOGIC or prim in _ARITH:
        if prim in _CMP and all(np.issubdtype(scope.dtype(x), np.integer) for x in node.ins):
            # Affine operands compare as one affine difference (``i >= j``).
            diff = _affine_diff(scope, node.ins, tax, sax, len(shape))
            if diff is not None:
                return _CMP[prim](diff[0] + diff[1] * d, 0)
        parts = [sub(x) for x in node.ins]
        if any(p is None for p in parts):
            return None
        fn = {**_CMP, **_LOGIC, **_ARITH}[prim]
        return np.asarray(fn(*parts)).astype(dtype)
    if prim in _UNARY:
        inner = sub(node.ins[0])
        return None if inner is None else np.asarray(_UNARY[prim](inner)).astype(dtype)
    if prim == "convert_element_type":
        inner = sub(node.ins[0])
        return None if inner is None else inner.astype(dtype)
    if prim == "select_n":
        parts = [sub(x) for x in node.ins]
        if any(p is None for p in parts):
            return None
        pred, *cases = parts
        return np.choose(pred.astype(np.int32), cases).astype(dtype)
    if prim == "broadcast_in_dim":
        src = node.ins[0]
        src_shape = scope.shape(src)
        dims = node.params["broadcast_dimensions"]

        def back(axis):
            if axis is None or axis not in dims:
                return None
            k = dims.index(axis)
            return k if src_shape[k] == shape[axis] else None

        return sub(src, back(tax), back(sax))
    if prim == "reshape" and node.params.get("dimensions") is None:
        mapped = unit_reshape_map(scope.shape(node.ins[0]), shape)
        if mapped is None:
            return None
        return sub(node.ins[0], mapped.get(tax), mapped.get(sax))
    return None


def _affine_diff(scope, ins, tax, sax, rank):
    """``(const, cs)`` with ``a - b == const + cs * d`` for affine int operands."""
    parts = [affine(scope, x) for x in ins]
    if any(p is None for p in parts):
        return None
    coefs = []
    for coef, const in parts:
        coefs.append((coef if len(coef) == rank else (0,) * rank, const))
    coef = [x - y for x, y in zip(coefs[0][0], coefs[1][0], strict=True)]
    const = coefs[0][1] - coefs[1][1]
    ct = coef[tax] if tax is not None else 0
    cs = coef[sax] if sax is not None else 0
    if any(c for a, c in enumerate(coef) if a not in (tax, sax)) or ct != -cs:
        return None
    return const, cs


def _interval(keep: np.ndarray) -> tuple[int, int] | None:
    """``(first, last)`` index of a non-empty contiguous run of True, else None."""
    idx = np.flatnonzero(keep)
    if idx.size == 0 or idx[-1] - idx[0] + 1 != idx.size:
        return None
    return int(idx[0]), int(idx[-1])


def band_op(keep: np.ndarray, t_len: int, s_len: int, fill: float):
    """The `Causal`/`Window` op keeping the diagonals ``keep`` (indexed by
    ``d + T - 1``), "all", or None.  Every query row must keep a key."""
    if keep.all():
        return "all"
    run = _interval(keep)
    if run is None:
        return None
    lo, hi = run[0] - (t_len - 1), run[1] - (t_len - 1)  # kept: lo <= j - i <= hi
    lower = run[0] > 0
    upper = run[1] < keep.size - 1
    # Row i keeps [i + lo, i + hi] within [0, S): non-empty for i = 0 and T - 1.
    if (upper and hi < 0) or (lower and t_len - 1 + lo > s_len - 1):
        return None
    if not lower:
        return Causal(hi, fill)
    return Window(-lo, hi if upper else None, fill)


@mask_recogniser(rank=40)
def recognise_diagonal(build, factor, keep_when, fill) -> bool:
    """A mask that depends on ``j - i`` only, as `Window` (or `Causal`)."""
    axes = query_key_axes(build, factor, fill)
    if axes is None:
        return False
    t_len, s_len = score_sizes(build)
    scope = build.scope
    vec = diagonal(scope, factor.base, axes["T"], axes["S"], t_len, s_len)
    if vec is not None:
        keep = vec.astype(bool) == keep_when
    else:
        mat = folded_matrix(scope, factor, axes)
        if mat is None:
            return False
        keep = _toeplitz(mat == keep_when)
        if keep is None:
            return False
    op = band_op(keep, t_len, s_len, fill)
    if op is None or op == "all":
        return op == "all"
    return build.add_descriptor(op, factor, keep_when, fill)


def _toeplitz(keep: np.ndarray) -> np.ndarray | None:
    """The diagonal vector of a Toeplitz boolean matrix, else None."""
    t_len, s_len = keep.shape
    vec = np.concatenate([keep[::-1, 0], keep[0, 1:]])  # d = -(T-1) .. S-1
    i = np.arange(t_len)[:, None]
    j = np.arange(s_len)[None, :]
    if not np.array_equal(vec[j - i + t_len - 1], keep):
        return None
    return vec


# --------------------------------------------------------------------------- prefix-LM


@mask_recogniser(rank=50)
def recognise_prefix(build, factor, keep_when, fill) -> bool:
    """``(j <= i) | (j < L)`` with a static ``L`` (symbolic or by value)."""
    axes = query_key_axes(build, factor, fill)
    if axes is None or not keep_when:
        return False
    t_len, s_len = score_sizes(build)
    scope = build.scope
    length = _symbolic_prefix(scope, factor.base, axes)
    if length is None:
        mat = folded_matrix(scope, factor, axes)
        if mat is None or not mat.any():
            return False
        length = int(mat[0].sum())
        i = np.arange(t_len)[:, None]
        j = np.arange(s_len)[None, :]
        if not np.array_equal(mat.astype(bool), (j <= i) | (j < length)):
            return False
    if length <= 1 or length >= s_len:
        return False  # plain causal or everything: other readings take it
    return build.add_descriptor(Prefix(length, fill), factor, keep_when, fill)


def _symbolic_prefix(scope, base, axes) -> int | None:
    node = scope.producer(base)
    if node is None or node.prim != "or" or len(node.ins) != 2:
        return None
    causal, length = False, None
    for operand in node.ins:
        halves = halfspaces(scope, operand)
        if halves is None or len(halves) != 1:
            return None
        coef, const = halves[0]
        nonzero = {a: c for a, c in enumerate(coef) if c}
        if nonzero == {axes["T"]: 1, axes["S"]: -1} and const == 0:
            causal = True  # i - j >= 0
        elif nonzero == {axes["S"]: -1}:
            length = const + 1  # const - j >= 0: j < const + 1
        else:
            return None
    return length if causal else None


# --------------------------------------------------------------------------- chunks, segments


def _separable(build, factor, keep_when):
    """``(q side, kv side)`` profiles of ``q[.., i] == kv[.., j]`` (against the
    scores), or None."""
    scope = build.scope
    node = scope.producer(factor.base)
    want = "eq" if keep_when else "ne"
    if node is None or node.prim != want or len(node.ins) != 2:
        return None
    sides = [compose(scope, factor, x) for x in node.ins]
    roles = [{build.roles[t] for t, a in enumerate(p.axes) if a is not None} for p in sides]
    for qi, ki in ((0, 1), (1, 0)):
        if "T" in roles[qi] and "S" not in roles[qi] and "S" in roles[ki] and "T" not in roles[ki]:
            return sides[qi], sides[ki]
    return None


def _vector(scope, prof, roles, role):
    """A constant side as a 1-D vector over ``role`` (equal over other axes)."""
    value = scope.fold(prof.base)
    if value is None:
        return None
    arr = np.asarray(value)
    axis = next(a for t, a in enumerate(prof.axes) if a is not None and roles[t] == role)
    arr = np.moveaxis(arr, axis, -1).reshape(-1, arr.shape[axis])
    if not np.all(arr == arr[:1]):
        return None
    return arr[0]


def chunk_size(f: np.ndarray, g: np.ndarray) -> int | None:
    """``C`` if ``(f[i] == g[j]) == (i // C == j // C)`` for all i, j."""
    if f.size == 0 or g.size == 0:
        return None
    change = np.flatnonzero(f[1:] != f[:-1])
    size = int(change[0]) + 1 if change.size else f.size
    if size < 1:
        return None
    labels = {}
    for vec in (f, g):
        chunks = np.arange(vec.size) // size
        for c in np.unique(chunks):
            values = np.unique(vec[chunks == c])
            if values.size != 1:
                return None
            if labels.setdefault(int(c), values[0]) != values[0]:
                return None
    values = list(labels.values())
    if len(set(values)) != len(values):
        return None
    return size


@mask_recogniser(rank=60)
def recognise_chunk_or_segments(build, factor, keep_when, fill) -> bool:
    """``q[.., i] == kv[.., j]``: `Chunk` for constant chunk ids, else `Segments`."""
    if not excludes(fill):
        return False
    found = _separable(build, factor, keep_when)
    if found is None:
        return False
    q_side, kv_side = found
    scope, roles = build.scope, build.roles
    dtype = scope.dtype(q_side.base)
    if dtype != scope.dtype(kv_side.base) or not (
        np.issubdtype(dtype, np.integer) or dtype == np.bool_
    ):
        return False
    t_len, s_len = score_sizes(build)
    f, g = _vector(scope, q_side, roles, "T"), _vector(scope, kv_side, roles, "S")
    if f is not None and g is not None:
        size = chunk_size(f, g)
        # Every row keeps a key: its chunk has keys (T <= S covers it).
        if size is not None and (t_len - 1) // size <= (s_len - 1) // size:
            if size >= max(t_len, s_len):
                return True  # one chunk: keeps everything
            return build.add_descriptor(Chunk(size, fill), factor, keep_when, fill)
    q_index, _ = build.add_extra(q_side, None, dtype)
    kv_index, _ = build.add_extra(kv_side, None, dtype)
    same = t_len == s_len and _one_array(scope, q_side, kv_side, roles)
    return build.add_descriptor(Segments(q_index, kv_index, fill, same), factor, keep_when, fill)


def _one_array(scope, q_side, kv_side, roles) -> bool:
    """Whether both sides read one array, the query side at the query position
    and the key side at the key position, and every other axis alike."""
    if scope.resolve(q_side.base) != scope.resolve(kv_side.base):
        return False
    at = {r: t for t, r in enumerate(roles)}
    if q_side.axes[at["T"]] != kv_side.axes[at["S"]]:
        return False
    return all(
        q_side.axes[t] == kv_side.axes[t] for t, r in enumerate(roles) if r not in ("T", "S")
    )
