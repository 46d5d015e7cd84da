"""Adapter for JAX's Pallas TPU flash-attention kernel.

``jax.experimental.pallas.ops.tpu.flash_attention`` computes, per head::

    s = (q @ k^T + ab) * sm_scale        # bias BEFORE the scale
    s = s + where(causal & segment_mask, 0, -0.7 * f32_max)   # top-left causal
    out = softmax(s) @ v                 # f32 statistics, p cast to v.dtype

with ``q, k, v`` of one shape ``[B, H, T, D]`` (no GQA, ``Dv == D``), ``ab``
exactly ``[B, H, T, S]``, ``S`` a multiple of the key block and a
``custom_vjp`` that also returns ``d ab``.  This module maps an
`AttentionSpec` onto that exactly:

* Scale ops: ``sm_scale`` = their product ``C``.  A bias seen after scales
  ``c`` is passed as ``bias / c``, so ``(qk + bias / c) * C`` equals the
  spec's order (bit-exact when ``c`` is a power of two, else within an ulp).
  Pre-scaling ``q`` instead would round ``q`` in its (bf16) dtype.
* Mask ops, Causal with ``offset != 0`` and ``-inf``/huge biases are folded
  into ``ab`` as ``-2**126 / max(C, 1)`` (`_masked_value`): finite, so the
  kernel's online softmax never sees a block row that is all ``-inf``
  (which would give NaN), and far below any real score, so excluded keys get
  exactly zero weight.  ``Causal(offset=0)`` uses the kernel's own ``causal``.
* GQA/MQA: K/V heads are repeated.  ``Dv != D`` and head dims > 128 that are
  not multiples of 128: zero-padded (zeros add nothing to ``q . k`` and their
  output columns are sliced off).
* Sequence lengths are padded: queries to a multiple of 16 (one block) or,
  above ``max_block`` (default 512), of 128; keys to a multiple of 128.
  Padded keys are excluded through the kernel's segment ids
  (``-0.7 * f32_max``, below the mask value); padded queries are sliced off.
* ``Segments`` (packed documents): the user's query and key ids become
  the kernel's ``SegmentIds`` (``[B, T]`` and ``[B, S]``, shared by the heads,
  cast to int32: exact for integer or boolean ids of at most 32 bits), with
  no ``T x S`` array.  Padded keys, and keys that key masks shared by the
  heads (``[B|1, 1, 1, S]``) exclude, get an id no query has
  (`_util.segment_arrays`); other masks stay in ``ab``.  Rows left with no
  key (a query id no kept key has) are found from the sorted ids in
  O(S log S) (with a mask in ``ab``: one T x S pass, like ``ab`` itself) and
  get the mean of ``v``, which is the reference's result because every
  excluding op must end with one score (`_util.shared_fill_reasons`).
* ``ab`` is materialised as ``[B, H, T, S]`` (padded; float32 unless bfloat16
  holds it exactly) whenever the spec has a Bias, a Mask or a causal offset.
* The kernel is traced with x64 off (its index maps fail under x64) and, for
  ``interpret=True``, in TPU interpret mode, in the forward and the backward
  (`flashpass.compat.pallas_tpu_traced`), so callers need no context.
* Gradients w.r.t. ``q``, ``k``, ``v`` and every Bias extra are exact
  reverse-mode (the kernel returns ``d ab``).  There is no forward mode and no
  second order (the kernel raises ``Higher-order AD not supported``).

Differences from `reference_attention`, by design:

* Rows in which the Mask ops (with the causal mask) keep no key: the mean of
  ``v`` over all keys, with that mean's gradients (`_util.fill_empty_rows`):
  the reference's result when the excluded keys share one finite fill (NaN
  for ``-inf``).  Rows excluded only through ``-inf`` bias entries: the
  uniform average over the keys the kernel's own causal mask keeps (the
  reference: NaN), and their gradients are not the reference's.
* Precision: the kernel always accumulates and normalises in float32; a spec
  computing in bfloat16/float16 gets a more precise result, not the same
  rounding.  q, k, v and p are cast to one kernel dtype (`_util.kernel_dtype`),
  bfloat16 only where the spec itself keeps no more precision.
* A Bias after a Mask/Causal is assumed not to lift an excluded score (fill
  + bias) back into range, the same assumption `EXCLUDING_FILL` makes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from flashpass import compat
from flashpass.spec import (
    AttentionSpec,
    Bias,
    Causal,
    Dropout,
    KvLengths,
    Mask,
    Scale,
    Segments,
    Sink,
    Softcap,
)

from . import _linear, _tpu, _util

#: Default largest query/key block (see `_tpu.TPU_MAX_BLOCK`).
DEFAULT_MAX_BLOCK = _tpu.TPU_MAX_BLOCK


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


def _biases_with_scale_before(spec: AttentionSpec) -> list[tuple[Bias, float]]:
    """Each Bias op with the product of the Scale ops before it."""
    out, c_before = [], 1.0
    for op in spec.ops:
        if isinstance(op, Scale):
            c_before *= op.value
        elif isinstance(op, Bias):
            out.append((op, c_before))
    return out


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything `apply` does to a spec, decided statically."""

    kernel_dtype: np.dtype
    ab_dtype: np.dtype | None  # None: no ``ab`` (no Bias/Mask/folded causal)
    sm_scale: float
    masked_value: float  # value of an excluded key in ``ab`` (before sm_scale)
    causal: bool  # kernel's top-left causal mask
    fold_offset: int | None  # causal offset folded into ``ab`` as a mask
    q_len: int  # padded
    kv_len: int  # padded
    head_dim: int  # padded, shared by q, k and v
    pad_keys: bool  # padded keys must be excluded (via segment ids)
    block_q: int
    block_k: int
    #: the user's segment ids (a `Segments` op), passed as the kernel's SegmentIds
    segments: Segments | None = None
    #: Mask ops folded into ``ab``; with segment ids, key masks ``[B|1, 1, 1, S]``
    #: become key ids no query has instead (`id_masks`)
    ab_masks: tuple[int, ...] = ()
    id_masks: tuple[int, ...] = ()

    def block_sizes(self):
        fa = compat.tpu_flash_attention_module()
        bq, bk = self.block_q, self.block_k
        return fa.BlockSizes(
            block_q=bq,
            block_k_major=bk,
            block_k=bk,
            block_b=1,
            block_q_major_dkv=bq,
            block_k_major_dkv=bk,
            block_k_dkv=bk,
            block_q_dkv=bq,
            block_k_major_dq=bk,
            block_k_dq=bk,
            block_q_dq=bq,
        )


def _masked_value(sm_scale: float) -> float:
    # After the kernel multiplies by sm_scale this is -2**126 * min(sm_scale, 1):
    # finite (even plus the kernel's own -0.7 * f32_max), yet below any real score.
    return -(2.0**126) / max(sm_scale, 1.0)


#: Score ops `_spec_reasons` knows (structured ones it does not take are
#: rejected by `_linear.structured_reasons`; `Dropout` by kernel selection).
_KNOWN_OPS = (Scale, Bias, Mask, Causal, Softcap, KvLengths, Dropout, Segments, Sink)


def _spec_reasons(spec: AttentionSpec) -> list[str]:
    """Static reasons this adapter cannot run ``spec`` exactly (platform aside)."""
    reasons = _util.input_reasons(spec, "the TPU flash kernel")
    reasons += _linear.structured_reasons(spec, frozenset({Segments}))
    for position, op in enumerate(spec.ops):
        if isinstance(op, Softcap):
            reasons.append(
                f"logit soft-capping (Softcap cap={op.cap}) is not supported by the "
                "TPU flash kernel; use the 'blockwise' kernel for this attention"
            )
        elif isinstance(op, Scale):
            if not op.value > 0:
                reasons.append(
                    f"score scale {op.value} is not positive; the adapter folds masks "
                    "into large negative biases, which a non-positive scale would flip"
                )
        elif isinstance(op, Causal) or (
            isinstance(op, Mask) and 0 <= op.index < len(spec.extras)  # else see extra_reasons
        ):
            # Masks become a -2**126 bias (a weight a finite fill would not give);
            # the kernel's causal mask gives excluded keys zero weight.
            reasons += _linear.exclusion_reasons(spec, position)
        elif isinstance(op, KvLengths):
            reasons.append(_linear.KV_LENGTHS_REASON)
        elif isinstance(op, Segments):
            reasons += _linear.exclusion_reasons(spec, position)
        elif isinstance(op, Sink):
            reasons.append(_linear.SINK_REASON)
        elif not (isinstance(op, _KNOWN_OPS) or getattr(op, "reason_words", None)):
            reasons.append(
                f"unknown score op {type(op).__name__}: the TPU flash kernel adapter does "
                "not know its semantics"
            )
    return reasons + _segment_reasons(spec)


def _segment_reasons(spec: AttentionSpec) -> list[str]:
    """Why the spec's `Segments` op cannot be the kernel's ``SegmentIds``."""
    ops = spec.ops_of(Segments)
    if not ops:
        return []
    reasons = []
    if len(ops) > 1:
        reasons.append(
            "two segment-id masks are not supported (the TPU flash kernel takes one "
            "pair of query and key segment ids); use 'blockwise'"
        )
    full = (spec.batch, spec.heads, spec.q_len, spec.kv_len)
    for op in ops:
        for side, index, axis in (("query", op.q_index, 2), ("key", op.kv_index, 3)):
            if not 0 <= index < len(spec.extras):
                reasons.append(f"{side} segment ids refer to extra #{index}, which the spec lacks")
                continue
            extra = spec.extras[index]
            shape, dtype = tuple(extra.shape), np.dtype(extra.dtype)
            layout = "[B|1, 1, T, 1]" if axis == 2 else "[B|1, 1, 1, S]"
            if not _util.broadcastable(shape, full) or shape[5 - axis] != 1:
                reasons.append(f"{side} segment ids of shape {shape} are not {layout}")
            elif shape[1] != 1:
                reasons.append(
                    f"{side} segment ids of shape {shape} differ between heads; the TPU "
                    "flash kernel's segment ids are shared by all heads; use 'blockwise'"
                )
            if not (dtype == np.bool_ or np.issubdtype(dtype, np.integer)):
                reasons.append(f"{side} segment ids of dtype {dtype.name} are not integers")
            elif dtype.itemsize > 4:
                reasons.append(
                    f"{side} segment ids of dtype {dtype.name}: the TPU flash kernel takes "
                    "int32 ids, and a 64-bit id would not survive the cast (ids from "
                    "jnp.arange/cumsum under jax_enable_x64 are int64: cast them to int32)"
                )
    reasons += _util.shared_fill_reasons(spec, "segment ids")
    return reasons


def _plan(spec: AttentionSpec, max_block: int = DEFAULT_MAX_BLOCK) -> _Plan:
    # bfloat16 only when it loses nothing the spec keeps (the kernel's output
    # dtype is q's, so a bf16 q would round a float32 result); one dtype for q,
    # k and v: the backward's ``do @ v^T`` would mix them.
    kernel_dtype = _util.kernel_dtype(spec)
    sm_scale = spec.scale

    offsets = [op.offset for op in spec.ops_of(Causal)]
    offset = min(offsets) if offsets else None
    if offset is not None and offset >= spec.kv_len - 1:
        offset = None  # every key j <= S - 1 <= i + offset: no key is excluded
    causal = offset == 0
    fold_offset = offset if offset else None

    # With segment ids, key masks shared by the heads exclude keys through them
    # (an id no query has, `_util.segment_arrays`): no T x S ``ab`` for packing
    # with padding.  Every other mask is folded into ``ab``.
    segments = next(iter(spec.ops_of(Segments)), None)
    ab_masks, id_masks = [], []
    for op in spec.ops_of(Mask):
        shape = tuple(spec.extras[op.index].shape) if op.index < len(spec.extras) else ()
        shared_key_mask = len(shape) == 4 and shape[1] == 1 and shape[2] == 1
        (id_masks if segments is not None and shared_key_mask else ab_masks).append(op.index)

    # ab dtype: bfloat16 only when it holds the one bias exactly: the bias is
    # bfloat16 as the spec adds it, and `bias / c` is exact (c a power of two).
    ab_dtype = None
    if spec.ops_of(Bias) or ab_masks or fold_offset is not None:
        ab_dtype = _util.F32
        biases = _biases_with_scale_before(spec)
        bf16 = _util.BF16
        if kernel_dtype == bf16 and len(biases) <= 1:
            if all(
                (spec.compute_dtype == bf16 or np.dtype(op.dtype) == bf16) and _is_power_of_two(c)
                for op, c in biases
            ):
                ab_dtype = bf16

    q_len, block_q = _tpu.tpu_query_tiling(spec.q_len, max_block)
    kv_len = _util.round_up(spec.kv_len, _tpu.TPU_LANES)
    # The kernel tiles head dims above 128 in lanes of 128.
    head_dim = _tpu.tpu_head_dim(max(spec.head_dim, spec.v_head_dim))

    # Top-left causal with T <= S already excludes every padded key (j >= S > i).
    pad_keys = kv_len > spec.kv_len and not (causal and spec.q_len <= spec.kv_len)
    return _Plan(
        kernel_dtype=kernel_dtype,
        ab_dtype=ab_dtype,
        sm_scale=float(sm_scale),
        masked_value=_masked_value(sm_scale),
        causal=causal,
        fold_offset=fold_offset,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        pad_keys=pad_keys,
        block_q=block_q,
        block_k=_tpu.largest_block(kv_len, max_block),
        segments=segments,
        ab_masks=tuple(ab_masks),
        id_masks=tuple(id_masks),
    )


def _build_ab(spec: AttentionSpec, plan: _Plan, extras: Sequence):
    """The kernel's ``[B, H, T, S]`` bias (unpadded), or None."""
    if plan.ab_dtype is None:
        return None
    ab = None
    for op, c_before in _biases_with_scale_before(spec):
        # The spec adds the bias rounded to compute_dtype, after the scales seen
        # so far; the kernel adds it before scaling by all of them.
        bias = extras[op.index].astype(spec.compute_dtype).astype(plan.ab_dtype)
        if c_before != 1.0:
            bias = bias / jnp.asarray(c_before, plan.ab_dtype)
        ab = bias if ab is None else ab + bias
    keep = None
    for index in plan.ab_masks:
        mask = extras[index].astype(bool)
        keep = mask if keep is None else keep & mask
    if plan.fold_offset is not None:
        causal = jnp.asarray(_util.causal_keep(spec, plan.fold_offset))
        keep = causal if keep is None else keep & causal
    masked = jnp.asarray(plan.masked_value, plan.ab_dtype)
    if ab is None:
        ab = jnp.zeros((1, 1, 1, 1), plan.ab_dtype)
    else:
        # -inf or overflowed (bias / c) entries would make an all -inf block row,
        # which the kernel's online softmax turns into NaN.
        ab = jnp.maximum(ab, masked)
    if keep is not None:
        ab = jnp.where(keep, ab, masked)
    return jnp.broadcast_to(ab, (spec.batch, spec.heads, spec.q_len, spec.kv_len))


class PallasTpuKernel(_tpu.TpuKernel):
    """JAX's Pallas TPU flash attention (``pallas.ops.tpu.flash_attention``).

    Runs on TPU, or on CPU with ``interpret=True`` (slow; for tests).  Supports
    Scale, Bias (with gradient), boolean Mask, Causal (any offset >= 0) and
    Segments (segment ids shared by the heads) ops, GQA/MQA and any sequence
    length or head dims; rejects Softcap, the other structured masks, float64,
    non-positive scales and fills that do not exclude keys.  Reverse-mode AD
    only.  No cost heuristics (``ctx.explicit`` is not consulted).  See the
    module docstring for the exact mapping and the fully-masked-row difference.
    """

    name = "pallas_tpu"
    dtypes = frozenset({"bfloat16", "float16", "float32"})
    descriptors = frozenset({"causal", "mask", "key_mask", "bias", "gqa", "segments"})
    spec_reasons = staticmethod(_spec_reasons)

    def apply(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        """Attention ``[B, H, T, Dv]`` in ``spec.out_dtype`` via the TPU kernel.

        ``interpret=True`` runs the kernel (forward and backward) in Pallas TPU
        interpret mode, e.g. on CPU.
        """
        self.require(_spec_reasons(spec))
        _util.check_arrays(self.name, spec, q, k, v)
        plan = _plan(spec, self.max_block)
        fa = compat.tpu_flash_attention_module()

        v_in = v
        # The reference rounds q/k to compute_dtype before the product.
        q = q.astype(spec.compute_dtype).astype(plan.kernel_dtype)
        k = k.astype(spec.compute_dtype).astype(plan.kernel_dtype)
        # The kernel computes p.astype(v.dtype) @ v: v (and so p) in the kernel dtype.
        v = v.astype(plan.kernel_dtype)
        # No GQA in the kernel: query head h reads kv head h // G.
        if spec.groups > 1:
            k = jnp.repeat(k, spec.groups, axis=1)
            v = jnp.repeat(v, spec.groups, axis=1)
        q = _util.pad_axis(_util.pad_axis(q, 3, plan.head_dim), 2, plan.q_len)
        k = _util.pad_axis(_util.pad_axis(k, 3, plan.head_dim), 2, plan.kv_len)
        v = _util.pad_axis(_util.pad_axis(v, 3, plan.head_dim), 2, plan.kv_len)
        args = [q, k, v]
        ab = _build_ab(spec, plan, extras)
        if ab is not None:
            # Padded query rows get 0 (finite), padded keys are excluded by segment ids.
            args.append(_util.pad_axis(_util.pad_axis(ab, 2, plan.q_len), 3, plan.kv_len))

        offsets = [op.offset for op in spec.ops_of(Causal)]
        offset = min(offsets) if offsets else None
        static_ids = None
        if plan.segments is not None:
            # The user's ids; keys an id mask excludes, and padded keys, get an id
            # no query has.  Padded query rows repeat the last id (sliced off).
            q_ids, kv_ids, empty = _segment_ids(spec, plan, extras, offset)
            q_ids = jnp.pad(q_ids, ((0, 0), (0, plan.q_len - spec.q_len)), mode="edge")
            args += [
                jnp.broadcast_to(q_ids, (spec.batch, plan.q_len)),
                jnp.broadcast_to(kv_ids, (spec.batch, plan.kv_len)),
            ]
        else:
            if plan.pad_keys:
                # Keys whose segment id differs from the queries' get -0.7 * f32_max.
                # numpy constants: the kernel closure must not capture tracers.
                kv_ids = (np.arange(plan.kv_len) >= spec.kv_len).astype(np.int32)
                static_ids = fa.SegmentIds(
                    q=np.zeros((spec.batch, plan.q_len), np.int32),
                    kv=np.broadcast_to(kv_ids, (spec.batch, plan.kv_len)),
                )
            # Rows the masks leave empty: the kernel averages v but differentiates as
            # if unmasked (its -2**126 bias absorbs q.k only in the forward).
            _, empty = _util.combined_keep(spec, plan.ab_masks, extras, offset=offset)
        block_sizes = plan.block_sizes()
        has_ab, has_ids = ab is not None, plan.segments is not None

        def kernel(q, k, v, *rest):
            ab = rest[0] if has_ab else None
            segment_ids = fa.SegmentIds(*rest[-2:]) if has_ids else static_ids
            return fa.flash_attention(
                q,
                k,
                v,
                ab,
                segment_ids,
                causal=plan.causal,
                sm_scale=plan.sm_scale,
                block_sizes=block_sizes,
            )

        out = compat.pallas_tpu_traced(kernel, interpret=interpret)(*args)
        out = out[:, :, : spec.q_len, : spec.v_head_dim].astype(spec.out_dtype)
        return _util.fill_empty_rows(spec, out, v_in, empty)


def _segment_ids(spec: AttentionSpec, plan: _Plan, extras, offset: int | None):
    """``(q_ids [b, T], kv_ids [b, S'], empty [b, h, T, 1])`` of the `Segments`
    op (`_util.segment_arrays`), ``b`` in {1, B}: the rows in which the ids,
    every Mask and the causal mask leave no key."""
    keep = None
    if plan.id_masks:  # [b, 1, 1, S]: folded into the key ids
        keep = _util.combined_keep(spec, plan.id_masks, extras)[0]
    q_ids, kv_ids, empty = _util.segment_arrays(
        spec, plan.segments, extras, keep, offset, plan.kv_len
    )
    if plan.ab_masks:
        # Masks varying over queries or heads: the rows they empty together with
        # the ids need a T x S pass (``ab`` is T x S already).
        keep = _util.combined_keep(spec, plan.ab_masks, extras)[0]
        same = q_ids[:, None, :, None] == kv_ids[:, None, None, : spec.kv_len]
        keep = keep & same
        if offset is not None:
            rows = jnp.arange(spec.q_len)[:, None]
            keep = keep & (jnp.arange(spec.kv_len)[None, :] <= rows + offset)
        empty = ~jnp.any(keep, axis=-1, keepdims=True)
    return q_ids, kv_ids, empty
