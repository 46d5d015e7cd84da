"""Static spec analysis shared by the adapters of library attention kernels.

Library kernels (splash, cuDNN, the Pallas GPU kernel, tokamax) compute::

    logits = C * (q @ k^T) + sum_i m_i * bias_i      (C: one scale)
    logits = cap * tanh(logits / cap)                (optional soft-cap)
    logits = where(keep, logits, very negative)      (masks, causal)
    out    = softmax(logits) @ v

`linear_form` rewrites a spec's ordered score ops into that form when it can,
exactly, and says in words why not when it cannot.  Moving a Scale that
follows a Softcap in front of it is exact algebra:
``c * cap * tanh(x / cap) == (c * cap) * tanh(c * x / (c * cap))``.

Also here: the checks and array helpers the adapters share, and what the two
Pallas TPU adapters share (block sizes, `TpuKernel`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flashpass.spec import (
    EXCLUDING_FILL,
    AttentionSpec,
    Bias,
    Causal,
    Chunk,
    KvLengths,
    Mask,
    Prefix,
    Scale,
    Segments,
    Sink,
    Softcap,
    Window,
    excludes,
)

from .base import CheckContext, Kernel
from .reference import kv_valid_lengths

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

#: The Pallas TPU kernels (flash attention, splash): key blocks are multiples of
#: the lane width, 128 (their MIN_BLOCK_SIZE), as are head dims above it.
TPU_LANES = 128
#: Query lengths are padded to a multiple of this.  Besides sublane tiling, an
#: even block_q sidesteps an off-by-one in the TPU flash kernel's causal block
#: skipping, ``(r + 1) * block_q - 1 > c * block_k``: a block whose last row
#: equals the first key is skipped (e.g. block_q == 1 with several key blocks
#: loses row 0).
TPU_Q_MULTIPLE = 16
#: Default largest block (VMEM-friendly on every TPU generation).  Query
#: lengths up to the largest block are one block, padded to `TPU_Q_MULTIPLE` only.
TPU_MAX_BLOCK = 512


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def largest_block(length: int, max_block: int) -> int:
    """Largest power-of-two multiple of 128, at most ``max_block``, dividing
    ``length`` (a multiple of 128)."""
    block = TPU_LANES
    while block * 2 <= max_block and length % (block * 2) == 0:
        block *= 2
    return block


def tpu_query_tiling(q_len: int, max_block: int, multiple: int = TPU_Q_MULTIPLE):
    """``(padded q_len, block_q)`` for the Pallas TPU kernels: one block padded
    to ``multiple`` up to ``max_block``, else blocks of `largest_block`."""
    if q_len <= max_block:
        padded = round_up(q_len, multiple)
        return padded, padded
    padded = round_up(q_len, TPU_LANES)
    return padded, largest_block(padded, max_block)


def tpu_head_dim(d: int) -> int:
    """A head dim as the Pallas TPU kernels take it: above 128, a multiple of 128."""
    return round_up(d, TPU_LANES) if d > TPU_LANES else d


@dataclasses.dataclass(frozen=True)
class LinearForm:
    """A spec as ``where(keep, softcap(scale * qk + sum(m * bias)), -big)``."""

    scale: float
    #: (extra index, multiplier): bias ``i`` enters the logits as ``m * extras[i]``.
    biases: tuple[tuple[int, float], ...]
    softcap: float | None
    #: extra indices of the boolean keep-masks.
    masks: tuple[int, ...]
    #: causal offset (keys ``j <= i + offset`` kept); None when no key is excluded.
    causal_offset: int | None
    #: why the spec does not have this form (empty: it does).
    reasons: tuple[str, ...]
    #: the structured ops (`Window`, `Chunk`, `Prefix`, `Segments`) the caller
    #: accepted (``linear_form(structured=...)``), checked to exclude keys.
    structured: tuple = ()


def exclusion_reasons(spec: AttentionSpec, position: int) -> list[str]:
    """Why the Mask or Causal op at ``position`` does not exclude keys the way a
    kernel's own masking does (exactly zero weight), or leaves rows empty."""
    op = spec.score_ops[position]
    reasons = []
    value = spec.final_fill(position, op.fill)
    if not excludes(value):
        kind = _STRUCTURED_WORDS.get(type(op), "mask" if isinstance(op, Mask) else "causal mask")
        reasons.append(
            f"{kind} fill {op.fill} ends as score {value:.6g} after the ops that "
            f"follow it, which does not exclude keys (needs <= {EXCLUDING_FILL} or "
            "-inf; a soft-cap after the mask turns any fill into about -cap): masked "
            "keys would keep a non-zero weight; use a fill such as -1e9 or -inf "
            "applied after the soft-cap, or the 'blockwise' kernel"
        )
    if isinstance(op, Causal) and op.offset < 0:
        reasons.append(f"causal offset {op.offset} < 0 leaves query rows with no key to attend to")
    return reasons


def linear_form(
    spec: AttentionSpec, structured: frozenset = frozenset(), *, sinks: bool = False
) -> LinearForm:
    """Rewrite ``spec.score_ops`` as a `LinearForm` (see module doc); the
    structured op types in ``structured`` are kept (the caller maps them to
    its own masks) instead of rejected; with ``sinks`` the caller applies a
    `Sink` op itself (it is not part of the form)."""
    reasons: list[str] = []
    scale = 1.0
    biases: list[list] = []
    cap = None
    post = 1.0  # product of the Scales after the Softcap
    masks: list[int] = []
    offsets: list[int] = []
    kept: list = []
    for position, op in enumerate(spec.score_ops):
        if isinstance(op, Scale):
            if cap is None:
                scale *= op.value
                for b in biases:
                    b[1] *= op.value
            else:
                post *= op.value
        elif isinstance(op, Bias):
            if cap is not None:
                reasons.append(
                    "a bias added after the logit soft-cap is not supported (the kernel caps "
                    "the biased logits); add the bias before the soft-cap"
                )
            biases.append([op.index, 1.0])
        elif isinstance(op, Softcap):
            if cap is not None:
                reasons.append("two logit soft-caps in a row are not supported")
            elif not op.cap > 0:
                reasons.append(f"soft-cap {op.cap} is not positive")
            cap = op.cap
        elif isinstance(op, Mask | Causal):
            reasons += exclusion_reasons(spec, position)
            if isinstance(op, Mask):
                masks.append(op.index)
            elif op.offset >= 0:
                offsets.append(op.offset)
        elif isinstance(op, KvLengths):
            reasons.append(KV_LENGTHS_REASON)
        elif isinstance(op, Sink):
            if not sinks:  # (a caller that applies the sink itself says so)
                reasons.append(SINK_REASON)
        elif type(op) in structured:
            reasons += exclusion_reasons(spec, position)
            kept.append(op)
        elif type(op) in _STRUCTURED_WORDS:
            missing = [r for r in structured_reasons(spec, structured) if r not in reasons]
            reasons += missing
        else:
            reasons.append(f"unknown score op {type(op).__name__}")
    if cap is not None and post != 1.0:
        # c * cap * tanh(x / cap) == (c * cap) * tanh(c * x / (c * cap))
        scale *= post
        for b in biases:
            b[1] *= post
        cap *= post
        if not cap > 0:
            reasons.append("a non-positive scale after the logit soft-cap is not supported")
    offset = min(offsets) if offsets else None
    if offset is not None and offset >= spec.kv_len - 1:
        offset = None  # every key j <= S - 1 <= i + offset: nothing is excluded
    return LinearForm(
        scale=float(scale),
        biases=tuple((i, float(m)) for i, m in biases),
        softcap=None if cap is None else float(cap),
        masks=tuple(masks),
        causal_offset=offset,
        reasons=tuple(reasons),
        structured=tuple(kept),
    )


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
    used = [op.index for op in spec.score_ops if isinstance(op, Bias | Mask)]
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
    for op in spec.score_ops:
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


#: Why a library adapter declines a `KvLengths` op (none declares "kv_lengths";
#: `linear_form` and the TPU flash adapter give it).
KV_LENGTHS_REASON = (
    "per-row kv lengths (a `j < lengths[b]` mask) are not supported by this kernel; "
    "the 'blockwise' kernel skips the blocks past each row's length"
)


# --------------------------------------------------------------------------- kv lengths


def without_lengths(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` without its `KvLengths` ops (for `linear_form`, which rejects
    them; removing a ``where`` changes no other op's final fill)."""
    if not spec.ops_of(KvLengths):
        return spec
    ops = tuple(op for op in spec.score_ops if not isinstance(op, KvLengths))
    return dataclasses.replace(spec, score_ops=ops)


def lengths_reasons(spec: AttentionSpec, takes: str) -> list[str]:
    """Why the spec's `KvLengths` ops cannot be a kernel's one valid key count
    per batch row (``takes`` says how the kernel takes it, in words)."""
    if not spec.ops_of(KvLengths):
        return []
    reasons = []
    for position, op in enumerate(spec.score_ops):
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
        count = kv_valid_lengths(op, extras[op.index], spec.kv_len)[:, 0, 0, 0]
        n = count if n is None else jnp.minimum(n, count)
    return n


#: Why a library adapter declines a `Sink` op (`linear_form` gives it, unless ``sinks``).
SINK_REASON = (
    "attention sinks (a per-row logit that joins the softmax's normaliser) are not "
    "supported by this kernel; the 'blockwise' kernel starts its online softmax from them"
)


def input_reasons(spec: AttentionSpec, kernel: str) -> list[str]:
    """What every library adapter checks first: empty arrays, dtypes, extras."""
    return empty_reasons(spec) + float_dtype_reasons(spec, kernel) + extra_reasons(spec)


#: Words for the structured-mask descriptors no library adapter takes yet.
_STRUCTURED_WORDS = {
    Window: "a local window (sliding-window mask)",
    Chunk: "a chunked-attention mask",
    Prefix: "a prefix-LM mask",
    Segments: "segment ids (packed documents)",
}


def structured_reasons(spec: AttentionSpec, accepted: frozenset = frozenset()) -> list[str]:
    """One reason per structured-mask op (`Window`, `Chunk`, `Prefix`,
    `Segments`) in ``spec`` whose type is not in ``accepted``."""
    found = {
        type(op)
        for op in spec.score_ops
        if type(op) in _STRUCTURED_WORDS and type(op) not in accepted
    }
    return [
        f"{_STRUCTURED_WORDS[kind]} is not supported by this kernel; the 'blockwise' "
        "kernel takes it as a descriptor and skips the blocks it excludes"
        for kind in sorted(found, key=lambda k: k.__name__)
    ]


def linear_reasons(
    spec: AttentionSpec,
    kernel: str,
    *,
    bias_instead: str | None = None,
    structured: frozenset = frozenset(),
    sinks: bool = False,
):
    """``(reasons, form)`` of an adapter built on `linear_form`: `input_reasons`,
    then (if there are none) the spec's `LinearForm` and its reasons.  With
    ``bias_instead`` the kernel takes no bias, and the reason names that kernel
    instead.  ``form`` is None when the inputs fail (it would read missing extras).
    ``structured``, ``sinks``: what the caller takes itself (`linear_form`)."""
    reasons = input_reasons(spec, kernel)
    if reasons:
        return reasons, None
    form = linear_form(spec, structured, sinks=sinks)
    reasons = list(form.reasons)
    if bias_instead is not None and form.biases:
        reasons.append(
            f"{kernel} takes no bias (additive mask or position bias); use the "
            f"'{bias_instead}' kernel, which adds biases, or 'blockwise'"
        )
    return reasons, form


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


class TpuKernel(Kernel):
    """Base of the adapters of JAX's Pallas TPU kernels (``pallas_tpu``,
    ``splash``): they run on TPU, or on CPU with ``interpret=True`` (slow; for
    tests), with reverse-mode gradients.  A Pallas call is a custom call: XLA's
    SPMD partitioner runs it replicated, and it does not type-check inside
    ``shard_map`` with ``check_vma``.  Subclasses set ``spec_reasons``, the
    static reasons (platform aside) they cannot run a spec."""

    platforms = ("tpu",)
    interpret_platforms = ("cpu",)
    grad = True
    partitionable = False
    plain_jax = False
    spec_reasons: Callable[[AttentionSpec], list[str]]

    def __init__(self, *, max_block: int = TPU_MAX_BLOCK):
        """``max_block``: the largest query/key block (a power-of-two multiple of 128)."""
        if max_block < TPU_LANES or max_block & (max_block - 1):
            raise ValueError(f"max_block must be a power-of-two multiple of 128, got {max_block}")
        self.max_block = max_block

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        """Reasons this kernel cannot run ``spec`` on ``ctx.platform`` (static)."""
        return self.platform_reasons(ctx) + self.spec_reasons(spec)


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


def bias_sum(spec: AttentionSpec, form: LinearForm, extras, dtype):
    """``sum_i m_i * bias_i`` in ``dtype`` (broadcast shapes kept), or None.

    Each bias is rounded to the spec's compute dtype first, as the spec adds it.
    """
    total = None
    for index, multiplier in form.biases:
        bias = extras[index].astype(spec.compute_dtype).astype(dtype)
        if multiplier != 1.0:
            bias = bias * jnp.asarray(multiplier, dtype)
        total = bias if total is None else total + bias
    return total


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
    for position, op in enumerate(spec.score_ops):
        if isinstance(op, Mask | Causal | KvLengths | Window | Chunk | Prefix | Segments):
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
