"""Checks and array helpers shared by the adapters of library attention kernels.

Input checks (shapes, dtypes, extras), kv-length reasons, keep-masks and
segment-id arrays for the kernels' own masks, and the mean-of-v fill of rows
no key survives.  The rewrite of a spec into the libraries' one form is
`_linear`; what the two Pallas TPU adapters share is `_tpu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flashpass.ops import KeepOp
from flashpass.ops import valid_lengths as op_valid_lengths
from flashpass.spec import AttentionSpec, Bias, KvLengths, Mask, Segments, excludes

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def broadcastable(shape, full) -> bool:
    """Whether ``shape`` is 4-D with every axis 1 or the size in ``full``."""
    return len(shape) == 4 and all(d in (1, f) for d, f in zip(shape, full, strict=True))


def check_arrays(kernel: str, spec: AttentionSpec, q, k, v, extras=None) -> None:
    """Raise a ValueError naming ``kernel`` when q/k/v (and ``extras``, if
    given) do not have the shapes ``spec`` says."""
    for label, x, want in (("q", q, spec.q_shape), ("k", k, spec.k_shape), ("v", v, spec.v_shape)):
        if tuple(x.shape) != want:
            raise ValueError(f"{kernel}: {label} has shape {tuple(x.shape)}, the spec says {want}")
    if extras is None:
        return
    for op in spec.ops:
        if not callable(getattr(op, "extras_read", None)):
            raise TypeError(f"{kernel}: unknown score op {op!r}: not a flashpass.ops score op")
    used = [i for op in spec.ops for i in op.extras_read()]
    if used and max(used) >= len(extras):
        raise ValueError(
            f"{kernel}: score ops use extras[{max(used)}] but only {len(extras)} were given"
        )
    full = (spec.batch, spec.heads, spec.q_len, spec.kv_len)
    key = spec.dropout.index if spec.dropout is not None else None
    for i, x in enumerate(extras):
        if i == key:  # a dropout key's data, `Dropout.shape`
            if tuple(x.shape) != spec.dropout.shape:
                raise ValueError(f"{kernel}: the dropout key has shape {tuple(x.shape)}")
            continue
        if not broadcastable(tuple(x.shape), full):
            raise ValueError(
                f"{kernel}: extras[{i}] has shape {tuple(x.shape)}; each axis must be 1 or "
                f"match [B, H, T, S] = {list(full)}"
            )


def extra_reasons(spec: AttentionSpec) -> list[str]:
    """Bias/Mask ops whose extras are missing, not 4-D broadcastable or not real."""
    reasons: list[str] = []
    full = (spec.batch, spec.heads, spec.q_len, spec.kv_len)
    for op in spec.ops:
        if not isinstance(op, Bias | Mask):
            continue
        kind = "bias" if isinstance(op, Bias) else "mask"
        if not 0 <= op.index < len(spec.extras):
            reasons.append(f"{kind} refers to extra #{op.index}, which the spec lacks")
            continue
        extra = spec.extras[op.index]
        shape = tuple(extra.shape)
        if not broadcastable(shape, full):
            reasons.append(f"{kind} extra of shape {shape} is not broadcastable to {full}")
        dtype = np.dtype(extra.dtype)
        real = dtype == np.bool_ or bool(
            jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
        )
        if not real:
            reasons.append(f"{kind} extra of dtype {dtype.name} is not real-valued")
    return reasons


# --------------------------------------------------------------------------- kv lengths


def without_lengths(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` without its `KvLengths` ops (for `linear_form`, which rejects
    them; removing a ``where`` changes no other op's final fill)."""
    if not spec.ops_of(KvLengths):
        return spec
    ops = tuple(op for op in spec.ops if not isinstance(op, KvLengths))
    return spec.with_ops(ops)


def lengths_reasons(spec: AttentionSpec, takes: str) -> list[str]:
    """Why the spec's `KvLengths` ops cannot be a kernel's one valid key count
    per batch row (``takes`` says how the kernel takes it, in words)."""
    if not spec.ops_of(KvLengths):
        return []
    reasons = []
    for position, op in enumerate(spec.ops):
        if not isinstance(op, KvLengths):
            continue
        if not 0 <= op.index < len(spec.extras):
            reasons.append(f"kv lengths refer to extra #{op.index}, which the spec lacks")
            continue
        extra = spec.extras[op.index]
        shape, dtype = tuple(extra.shape), np.dtype(extra.dtype)
        rows = len(shape) == 4 and shape[0] in (1, spec.batch) and shape[2:] == (1, 1)
        if not rows or shape[1] not in (1, spec.heads):
            reasons.append(
                f"kv lengths extra of shape {shape} is not [B|1, H|1, 1, 1] with "
                f"B={spec.batch}, H={spec.heads}"
            )
        elif shape[1] != 1:
            reasons.append(
                f"per-row kv lengths of shape {shape} vary over heads; {takes}: use the "
                "'blockwise' kernel"
            )
        bound = spec.kv_len + abs(op.shift) + 1
        if not np.issubdtype(dtype, np.signedinteger) or np.iinfo(dtype).max < bound:
            reasons.append(
                f"kv lengths of dtype {dtype.name} cannot be clipped to +-{bound} (the "
                "valid count clip(L + shift, 0, kv_len) needs a signed integer dtype that "
                "holds it)"
            )
        final = spec.final_fill(position, op.fill)
        if not excludes(final):
            reasons.append(
                f"kv lengths fill {op.fill} ends as score {final:.6g} after the ops that "
                "follow it, which does not exclude keys: keys past a row's length would keep "
                "a non-zero weight; use the 'blockwise' kernel"
            )
    return reasons + shared_fill_reasons(
        spec, "per-row kv lengths (a length of 0, or with the other masks)"
    )


def valid_lengths(spec: AttentionSpec, extras):
    """``[b]`` int32 (``b`` 1 or B): each batch row's valid key count, the
    minimum of ``clip(L + shift, 0, S)`` over the `KvLengths` ops (None
    without one)."""
    n = None
    for op in spec.ops_of(KvLengths):
        count = op_valid_lengths(op, extras[op.index], spec.kv_len)[:, 0, 0, 0]
        n = count if n is None else jnp.minimum(n, count)
    return n


def input_reasons(spec: AttentionSpec, kernel: str) -> list[str]:
    """What every library adapter checks first: empty arrays, dtypes, extras."""
    return empty_reasons(spec) + float_dtype_reasons(spec, kernel) + extra_reasons(spec)


def empty_reasons(spec: AttentionSpec) -> list[str]:
    if min(spec.batch, spec.heads, spec.q_len, spec.kv_len, spec.head_dim, spec.v_head_dim) <= 0:
        return ["empty q/k/v (a zero-sized dimension) is not supported"]
    return []


def is_key_mask(spec: AttentionSpec, index: int) -> bool:
    """Whether extra ``index`` only varies over keys (and batch/heads): ``[b, h, 1, S]``."""
    shape = tuple(spec.extras[index].shape)
    return len(shape) == 4 and shape[2] == 1


def kernel_dtype(spec: AttentionSpec, narrow: tuple = (BF16,)) -> np.dtype:
    """One dtype for q, k, v: a narrow one (from ``narrow``) only where the spec
    keeps no more precision, else float32.

    Narrow when the spec computes in it (its q/k/p/out are rounded to it anyway)
    or when q, k, v, p and the output all are it.  Upcasts are exact.
    """
    if spec.compute_dtype in narrow:
        return spec.compute_dtype
    dtypes = {spec.q_dtype, spec.k_dtype, spec.v_dtype, spec.p_dtype, spec.out_dtype}
    if len(dtypes) == 1 and spec.q_dtype in narrow:
        return spec.q_dtype
    return F32


def float_dtype_reasons(spec: AttentionSpec, kernel: str, allowed=(BF16, F16, F32)) -> list[str]:
    """q/k/v and compute/p/out dtypes the kernel cannot honour (float64, ints)."""
    reasons = []
    names = ", ".join(np.dtype(d).name for d in allowed)
    for name in ("q_dtype", "k_dtype", "v_dtype"):
        dtype = getattr(spec, name)
        if dtype not in allowed:
            reasons.append(
                f"{name[0]} has dtype {dtype.name}; {kernel} takes {names} "
                "(float64 would be silently downcast)"
            )
    for name in ("compute_dtype", "p_dtype", "out_dtype"):
        dtype = getattr(spec, name)
        if dtype not in (BF16, F16, F32):
            reasons.append(
                f"{name} is {dtype.name}; {kernel} computes in float32 at most "
                "(disable jax_enable_x64 for this attention or use another kernel)"
            )
    return reasons


def pad_axis(x, axis: int, size: int, *, front: int = 0, value=0):
    """Pad ``x`` along ``axis`` to ``size`` (``front`` entries before, the rest after)."""
    back = size - x.shape[axis] - front
    if front == 0 and back == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (front, back)
    return jnp.pad(x, widths, constant_values=value)


def causal_keep(spec: AttentionSpec, offset: int) -> np.ndarray:
    """``[1, 1, T, S]`` numpy keep-mask of ``Causal(offset)``."""
    rows = np.arange(spec.q_len)[:, None]
    cols = np.arange(spec.kv_len)[None, :]
    return (cols <= rows + offset)[None, None]


def combined_keep(spec: AttentionSpec, masks, extras, *, offset: int | None = None):
    """``(keep, empty)`` for the keep-masks ``extras[i]``, ``i`` in ``masks``.

    ``keep``: their AND (broadcast shapes kept), or None without masks.
    ``empty``: ``[b, h, T, 1]``, the rows in which the masks and the causal
    mask (``offset``, if any) keep no key, or None.  A kernel whose online
    softmax would turn such a row into NaN (skipped blocks: ``l == 0``) must
    compute ``keep | empty`` instead; `fill_empty_rows` replaces their output.
    """
    keep = None
    for index in masks:
        mask = extras[index].astype(bool)
        keep = mask if keep is None else keep & mask
    if keep is None:
        return None, None
    if offset is None:
        empty = ~jnp.any(keep, axis=-1, keepdims=True)
    elif keep.shape[2] == 1:
        # Key masks: row i is empty when the first kept key comes after i + offset.
        first = jnp.where(jnp.any(keep, axis=-1), jnp.argmax(keep, axis=-1), spec.kv_len)
        rows = np.arange(spec.q_len)[:, None]
        empty = first[..., None] > rows + offset  # [b, h, 1, 1] vs [T, 1]: [b, h, T, 1]
    else:
        seen = jnp.cumsum(jnp.broadcast_to(keep, (*keep.shape[:2], spec.q_len, spec.kv_len)), -1)
        last = np.minimum(np.arange(spec.q_len) + offset, spec.kv_len - 1)
        seen = jnp.take_along_axis(seen, jnp.asarray(last)[None, None, :, None], axis=-1)
        empty = seen == 0
    return keep, empty


def segment_arrays(spec, op: Segments, extras, keep=None, offset=None, kv_len=None):
    """``(q_ids [b, T], kv_ids [b, kv_len], empty [b, 1, T, 1])`` int32 for a
    kernel's ``SegmentIds`` from a `Segments` op (ids shared by the heads).

    Keys ``keep`` (``[b|1, 1, 1, S]``, key masks) excludes and padded keys
    (up to ``kv_len``) get an id no query has (one above the largest query
    id, or below the smallest at the top of the range), so one segment-id
    comparison applies both.  ``empty``: rows
    whose id meets no kept key ``j <= i + offset``, found in O(S log S) from the
    ids sorted stably (the first kept key of the row's id): `fill_empty_rows`.
    """
    q_ids = extras[op.q_index][:, 0, :, 0].astype(jnp.int32)
    kv_ids = extras[op.kv_index][:, 0, 0, :].astype(jnp.int32)
    b = max(q_ids.shape[0], kv_ids.shape[0], 1 if keep is None else keep.shape[0])
    q_ids = jnp.broadcast_to(q_ids, (b, spec.q_len))
    kv_ids = jnp.broadcast_to(kv_ids, (b, spec.kv_len))
    top = jnp.max(q_ids)
    outside = jnp.where(top < np.iinfo(np.int32).max, top + 1, jnp.min(q_ids) - 1)
    if keep is not None:
        kv_ids = jnp.where(keep[:, 0, 0, :], kv_ids, outside)
    order = jnp.argsort(kv_ids, axis=-1, stable=True)
    ids_sorted = jnp.take_along_axis(kv_ids, order, axis=-1)
    at = jax.vmap(jnp.searchsorted)(ids_sorted, q_ids)
    at = jnp.minimum(at, spec.kv_len - 1)
    found = jnp.take_along_axis(ids_sorted, at, axis=-1) == q_ids
    if offset is not None:
        first = jnp.take_along_axis(order, at, axis=-1)  # the id's first kept key
        found = found & (first <= np.arange(spec.q_len) + offset)
    pad = (kv_len or spec.kv_len) - spec.kv_len
    kv_ids = jnp.concatenate([kv_ids, jnp.broadcast_to(outside, (b, pad))], axis=-1)
    return q_ids, kv_ids, ~found[:, None, :, None]


def fill_empty_rows(spec: AttentionSpec, out, v, empty):
    """Replace the output rows in ``empty`` by the mean of ``v`` over all keys.

    That is the reference's result for a row whose every key is excluded with
    one common finite fill (all its scores equal, so the softmax is uniform),
    e.g. ``where(mask, s, -1e9)`` on a fully padded example; gradients are
    that mean's (zero for ``q`` and ``k``).  ``out``: ``[B, H, T, Dv]``.
    """
    if empty is None:
        return out
    mean = jnp.mean(v.astype(jnp.float32), axis=2, keepdims=True)  # [B, Hkv, 1, Dv]
    if spec.groups > 1:
        mean = jnp.repeat(mean, spec.groups, axis=1)
    return jnp.where(empty, mean.astype(out.dtype), out)


def shared_fill_reasons(spec: AttentionSpec, what: str) -> list[str]:
    """Why rows ``what`` may leave with no key would not be the mean of ``v``.

    In such a row every key is excluded, and the reference's softmax weighs the
    keys by the scores their fills end with (`AttentionSpec.final_fill`): the
    mean of ``v`` that `fill_empty_rows` gives is its result only when every
    excluding op ends with one score (NaN for ``-inf``, the documented
    difference).  An adapter whose ``what`` (segment ids, a window with a mask)
    can empty rows the spec's ops do not prove non-empty checks this.
    """
    finals = set()
    for position, op in enumerate(spec.ops):
        if isinstance(op, KeepOp):
            finals.add(spec.final_fill(position, op.fill))
    if len(finals) <= 1:
        return []
    scores = ", ".join(f"{value:.6g}" for value in sorted(finals))
    return [
        f"{what} can leave a query row with no key to attend to; the reference computes "
        "such a row from the scores its excluded keys end with, which differ between "
        f"this attention's masks ({scores}), so it is not the mean of v the kernel gives: "
        "exclude keys with one fill (e.g. combine the masks with & in one where), or use "
        "the 'blockwise' kernel"
    ]
