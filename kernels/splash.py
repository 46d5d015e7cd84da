"""Adapter for JAX's splash attention (``pallas.ops.tpu.splash_attention``).

Splash attention computes, per example and query head ``h`` (``Hkv`` divides
``H``; head ``h`` reads key/value head ``h // (H / Hkv)``, so GQA and MQA run
without repeating K/V)::

    s = q @ k^T                                   # no scale: q is pre-scaled
    s = cap * tanh(s / cap)                       # attn_logits_soft_cap
    s = where(mask & (q_seg == kv_seg), s, -0.7 * f32_max)
    out = softmax(s) @ v                          # f32 statistics, p cast to v.dtype

with ``mask`` a static mask (causal with an offset, skipping fully masked
blocks) or a dynamic boolean ``[heads, T, S]`` array, and a ``custom_vjp``
for ``q``, ``k``, ``v``.  This module maps an `AttentionSpec` onto it exactly:

* Score ops are put in the kernel's order by `_linear.linear_form`: one scale
  ``C`` (Scales after a Softcap move in front of it, scaling the cap), an
  optional soft-cap, then masks whose fills exclude keys.  ``q`` is multiplied
  by ``C`` in float32 before the cast to the kernel dtype: exact when ``C`` is
  a power of two, else within one rounding of that dtype.
* ``Causal(offset)``: the static ``CausalMask(offset=offset)`` (any offset >= 0).
* Masks that only vary over keys and batch (``[B|1, 1, 1, S]``, padding):
  key segment ids (``0`` kept, ``1`` excluded; queries ``0``).  Any other
  mask: the kernel's dynamic mask, ANDed with the causal mask.
* Structured masks, with no ``T x S`` array: ``Window(l, r)`` as the
  static ``LocalMask((l, r))`` (a causal op folded into ``r``), ``Chunk`` with
  ``Causal(0)`` as ``ChunkedCausalMask``, ``Segments`` as ``SegmentIds`` (the
  user's ids; keys a key mask or padding excludes get an id no query has, and
  rows left with no key are found from the sorted ids, `_util.segment_arrays`).
  A window or chunk with a boolean mask or segment ids is rejected.
* ``Sink`` (attention sinks, one logit per head): the kernel's own ``sinks``
  (it starts each row's softmax from them, and returns their gradient); rows
  no key is left to are then 0, as the kernel computes them.
* Sequence padding: queries to a multiple of 16 (one block up to
  ``max_block``) or of 128, keys to a multiple of 128; padded keys get segment
  id 1 (or are false in the dynamic mask), padded queries are sliced off.
* Head dims above 128 are zero-padded to a multiple of 128; ``Dv != D`` is native.
* Batch: ``jax.vmap`` over the per-example kernel.
* Traced with x64 off in the forward and the backward
  (`flashpass.compat.pallas_tpu_traced`); ``interpret=True`` is passed to the
  kernel (the context-wide TPU interpret mode rejects the grid axis ``vmap`` adds).

Not supported (rejected by `check` with a reason): Bias ops (the kernel adds
no bias; ``pallas_tpu`` does), fills that do not exclude keys (including masks
before a soft-cap, which turns any fill into about ``-cap``), float64.

Differences from `reference_attention`, by design:

* Rows where the masks keep no key: the uniform average of ``v`` over the
  keys the causal mask keeps (the reference: over all keys for equal finite
  fills, NaN for ``-inf``).
* Precision: float32 statistics always; q/k/v/p in one kernel dtype
  (`_util.kernel_dtype`), bfloat16 only where the spec keeps no more.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashpass import compat
from flashpass.spec import AttentionSpec, Chunk, Segments, Window

from . import _linear, _tpu, _util

#: Default largest query/key block (see `_tpu.TPU_MAX_BLOCK`).
DEFAULT_MAX_BLOCK = _tpu.TPU_MAX_BLOCK


@dataclasses.dataclass(frozen=True)
class _Plan:
    form: _linear.LinearForm
    kernel_dtype: np.dtype
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    block_q: int
    block_kv: int
    key_masks: tuple[int, ...]  # masks expressed as kv segment ids
    dynamic_masks: tuple[int, ...]  # masks expressed as the dynamic mask
    segment_ids: bool  # key segment ids are passed (key masks or key padding)
    window: tuple | None = None  # LocalMask window_size, causal folded in
    chunk: int | None = None  # ChunkedCausalMask chunk size
    segments: Segments | None = None  # the user's ids as SegmentIds


#: Structured ops splash takes: `Window` (LocalMask), `Chunk` with a causal
#: mask (ChunkedCausalMask), `Segments` (SegmentIds).
_STRUCTURED = frozenset({Window, Chunk, Segments})


def _reasons(spec: AttentionSpec) -> list[str]:
    reasons, form = _linear.linear_reasons(
        spec, "splash attention", bias_instead="pallas_tpu", structured=_STRUCTURED, sinks=True
    )
    reasons += _sink_reasons(spec)
    if form is None or not form.structured:
        return reasons
    kinds = [type(op) for op in form.structured]
    if any(kinds.count(kind) > 1 for kind in _STRUCTURED):
        reasons.append("two window, chunk or segment-id masks of one kind are not supported")
    if Window in kinds and Chunk in kinds:
        reasons.append("a local window together with a chunk mask is not supported")
    if Chunk in kinds and form.causal_offset != 0:
        reasons.append(
            "a chunk mask is supported only together with a causal mask of offset 0 "
            "(splash's ChunkedCausalMask)"
        )
    static = [k for k in kinds if k is not Segments]
    # (Rows such a combination empties would need a T x S pass to find.)
    if static and (form.masks or Segments in kinds):
        reasons.append(
            "a local window or chunk mask together with a boolean mask or segment ids "
            "is not supported"
        )
    if Segments in kinds:
        if any(spec.extras[i].shape[2] != 1 for i in form.masks):
            reasons.append("segment ids together with a mask varying over queries")
        op = next(op for op in form.structured if isinstance(op, Segments))
        for i in (op.q_index, op.kv_index):
            extra = spec.extras[i]
            if extra.shape[1] != 1:
                reasons.append("segment ids that differ between heads are not supported")
            if np.dtype(extra.dtype).itemsize > 4:
                reasons.append(f"segment ids of dtype {np.dtype(extra.dtype).name} (> 32 bits)")
    return reasons


def _sink_reasons(spec: AttentionSpec) -> list[str]:
    """Splash takes attention sinks as one logit per query head (its ``sinks``)."""
    op = spec.sink
    if op is None or not 0 <= op.index < len(spec.extras):
        return [] if op is None else [f"the sink refers to extra #{op.index}, which the spec lacks"]
    shape = tuple(spec.extras[op.index].shape)
    if shape[0] != 1 or shape[2] != 1:
        return [
            f"attention sinks of shape {shape} vary over the batch or the queries; splash "
            "takes one sink logit per head (the 'blockwise' kernel takes any)"
        ]
    return []


def _plan(spec: AttentionSpec, max_block: int) -> _Plan:
    form = _linear.linear_form(spec, _STRUCTURED)
    key_masks, dynamic_masks = [], []
    for index in form.masks:
        shape = tuple(spec.extras[index].shape)
        (key_masks if shape[1] == 1 and shape[2] == 1 else dynamic_masks).append(index)
    if dynamic_masks:  # one mechanism: all masks go into the dynamic mask
        dynamic_masks, key_masks = list(form.masks), []
    kv_len = _util.round_up(spec.kv_len, _tpu.TPU_LANES)
    found = {type(op): op for op in form.structured}
    window = None
    if Window in found:
        op = found[Window]
        right = op.right
        if form.causal_offset is not None:  # the causal mask bounds the right side
            right = form.causal_offset if right is None else min(right, form.causal_offset)
        window = (op.left, right)
    user_ids = found.get(Segments)
    # Segment ids (key masks, key padding) need query blocks of 128 in the dK/dV kernel.
    segments = (
        bool(key_masks) or user_ids is not None or (kv_len > spec.kv_len and not dynamic_masks)
    )
    q_multiple = _tpu.TPU_LANES if segments else _tpu.TPU_Q_MULTIPLE
    q_len, block_q = _tpu.tpu_query_tiling(spec.q_len, max_block, q_multiple)
    return _Plan(
        form=form,
        kernel_dtype=_util.kernel_dtype(spec, narrow=(_util.BF16,)),
        q_len=q_len,
        kv_len=kv_len,
        head_dim=_tpu.tpu_head_dim(spec.head_dim),
        v_head_dim=_tpu.tpu_head_dim(spec.v_head_dim),
        block_q=block_q,
        block_kv=_tpu.largest_block(kv_len, max_block),
        key_masks=tuple(key_masks),
        dynamic_masks=tuple(dynamic_masks),
        segment_ids=segments,
        window=window,
        chunk=found[Chunk].size if Chunk in found else None,
        segments=user_ids,
    )


def _static_mask(plan: _Plan):
    """The plan's static splash mask (window, chunk, causal or full)."""
    sa = compat.splash_attention_module()
    shape = (plan.q_len, plan.kv_len)
    if plan.window is not None:  # the causal mask is folded into its right side
        static = sa.LocalMask(shape, window_size=plan.window, offset=0)
    elif plan.chunk is not None:
        static = compat.splash_chunked_causal_mask(shape, plan.chunk)
    elif plan.form.causal_offset is None:
        static = sa.FullMask(shape)
    else:
        static = sa.CausalMask(shape, offset=plan.form.causal_offset)
    return sa.MultiHeadMask([static])


def _block_sizes(plan: _Plan):
    sa = compat.splash_attention_module()
    bq, bkv = plan.block_q, plan.block_kv
    return sa.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )


class SplashKernel(_tpu.TpuKernel):
    """JAX's splash attention (``pallas.ops.tpu.splash_attention``).

    Runs on TPU, or on CPU with ``interpret=True`` (slow; for tests).  Supports
    Scale, Softcap, boolean Mask and Causal (any offset >= 0) ops, GQA/MQA
    natively, any sequence length and head dims; rejects Bias ops.  Reverse-mode
    AD only.  See the module docstring for the exact mapping.
    """

    name = "splash"
    dtypes = frozenset({"bfloat16", "float16", "float32"})  # float16 computed in float32
    descriptors = frozenset(
        {"causal", "mask", "key_mask", "softcap", "gqa", "window", "chunk", "segments", "sinks"}
    )
    spec_reasons = staticmethod(_reasons)
    ring_step = True  # forward: the kernel's logsumexp; backward: its dQ and dK/dV kernels

    def step_reasons(self, spec: AttentionSpec) -> list[str]:
        """Ring steps with static masks only (causal, window, chunk, full): no
        boolean mask or segment ids, which may leave a row of a block no key.
        (A step spec has no sink: the ring's statistics start from it.)"""
        form = _linear.linear_form(spec, _STRUCTURED)
        if form.masks or spec.ops_of(Segments):
            return ["splash runs ring steps without boolean masks or segment ids"]
        return []

    def step_forward(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        """One ring step: the kernel's output and logsumexp (``m = lse``,
        ``den = 1``; `Kernel.step_forward`)."""
        self.require(_reasons(spec) + self.step_reasons(spec))
        plan = _plan(spec, self.max_block)
        args, ids = _step_inputs(spec, plan, q, k, v)

        def one(q, k, v):
            out, (lse,) = _step_kernel(plan, interpret, residuals=True)(q, k, v, ids)
            return out, lse

        with compat.pallas_tpu_context(False):
            out, lse = jax.vmap(one)(*args)
        out = out[:, :, : spec.q_len, : spec.v_head_dim].astype(spec.out_dtype)
        lse = lse[:, :, : spec.q_len].astype(jnp.float32)
        return out, lse, jnp.ones_like(lse)

    def step_backward(
        self, spec, q, k, v, extras, out, m, den, dout, wanted, *, interpret: bool = False
    ):
        """The kernel's dQ and dK/dV kernels from the global output and
        logsumexp ``m + log(den)`` (`Kernel.step_backward`)."""
        self.require(_reasons(spec) + self.step_reasons(spec))
        plan = _plan(spec, self.max_block)
        (q_k, k_k, v_k), ids = _step_inputs(spec, plan, q, k, v)
        kdt = plan.kernel_dtype

        def rows(x, value=0.0):
            return _util.pad_axis(x, 2, plan.q_len, value=value)

        out_k = rows(_util.pad_axis(out.astype(kdt), 3, plan.v_head_dim))
        do_k = rows(_util.pad_axis(dout.astype(kdt), 3, plan.v_head_dim))
        # Padded query rows: logsumexp +inf, so their weights are exactly 0.
        lse = rows(m.astype(jnp.float32) + jnp.log(den.astype(jnp.float32)), jnp.inf)

        def one(q, k, v, o, lse, do):
            kernel = _step_kernel(plan, interpret, residuals=False)
            return compat.splash_backward(kernel, (q, k, v, ids, o, lse), do)

        with compat.pallas_tpu_context(False):
            dq, dk, dv = jax.vmap(one)(q_k, k_k, v_k, out_k, lse, do_k)
        # q entered the kernel scaled by the form's scale.
        dq = dq[:, :, : spec.q_len, : spec.head_dim].astype(jnp.float32) * plan.form.scale
        dk = dk[:, :, : spec.kv_len, : spec.head_dim].astype(jnp.float32)
        dv = dv[:, :, : spec.kv_len, : spec.v_head_dim].astype(jnp.float32)
        return dq, dk, dv, tuple(None for _ in extras)  # (float32: the ring sums them)

    def apply(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        self.require(_reasons(spec))
        plan = _plan(spec, self.max_block)
        form = plan.form
        T, S = spec.q_len, spec.kv_len

        v_in = v
        q, k, v = _kernel_arrays(spec, plan, q, k, v)

        # Key segment ids [b, S'] (b in {1, B}): 1 excludes a key.  Rows left with
        # no key are finite (every score is the mask value) and replaced below.
        kv_ids = q_ids = None
        empty = None
        if plan.segments is not None:
            keep = None
            if plan.key_masks:
                keep = _util.combined_keep(spec, plan.key_masks, extras)[0]
            q_ids, kv_ids, empty = _util.segment_arrays(
                spec, plan.segments, extras, keep, form.causal_offset, plan.kv_len
            )
            q_ids = jnp.pad(q_ids, ((0, 0), (0, plan.q_len - T)), mode="edge")
        elif plan.key_masks:
            keep, empty = _util.combined_keep(
                spec, plan.key_masks, extras, offset=form.causal_offset
            )  # keep: [b, 1, 1, S]
            keep = _util.pad_axis(keep[:, 0, 0, :], 1, plan.kv_len, value=False)
            kv_ids = jnp.where(keep, 0, 1).astype(jnp.int32)
        elif plan.segment_ids:
            kv_ids = jnp.asarray((np.arange(plan.kv_len) >= S).astype(np.int32)[None])

        # Dynamic keep-mask [b, h, T', S'] (b in {1, B}, h in {1, H}), causal included.
        dynamic = None
        if plan.dynamic_masks:
            keep, empty = _util.combined_keep(
                spec, plan.dynamic_masks, extras, offset=form.causal_offset
            )
            if form.causal_offset is not None:
                keep = keep & jnp.asarray(_util.causal_keep(spec, form.causal_offset))
            # An empty row would skip every block (l == 0: NaN, also in the backward).
            keep = keep | empty
            b, h = keep.shape[0], keep.shape[1]
            keep = jnp.broadcast_to(keep, (b, h, T, S))
            # Padded query rows keep the real keys; padded keys are never kept.
            keep = _util.pad_axis(keep, 2, plan.q_len, value=True)
            dynamic = _util.pad_axis(keep, 3, plan.kv_len, value=False)

        q_len = plan.q_len
        has_ids, has_dynamic = kv_ids is not None, dynamic is not None
        has_q_ids = q_ids is not None

        # Sink logits, one per query head (float32, as the kernel keeps them).
        sinks = None
        if spec.sink is not None:
            sink = extras[spec.sink.index].astype(jnp.float32)
            sinks = jnp.broadcast_to(sink.reshape(-1), (spec.heads,))

        def one(q, k, v, ids, mask, qids, sinks):
            """Splash attention of one example: [H, T, D] x [Hkv, S, D]."""
            sa = compat.splash_attention_module()
            if mask is None:
                mask = _static_mask(plan)
            segment_ids = None
            if ids is not None:
                if qids is None:
                    qids = jnp.zeros((q_len,), jnp.int32)
                segment_ids = sa.SegmentIds(q=qids, kv=ids)
            splash = _splash_kernel(plan, mask, interpret)
            if sinks is None:
                return splash(q, k, v, segment_ids)
            return splash(q, k, v, segment_ids, sinks)

        def kernel(q, k, v, *rest):
            rest = list(rest)
            ids = rest.pop(0) if has_ids else None
            mask = rest.pop(0) if has_dynamic else None
            qids = rest.pop(0) if has_q_ids else None
            sinks = rest.pop(0) if rest else None
            xs = (ids, mask, qids)
            axes = [None if x is None or x.shape[0] == 1 else 0 for x in xs]
            ids, mask, qids = (
                x if x is None or axis == 0 else x[0] for x, axis in zip(xs, axes, strict=True)
            )
            return jax.vmap(one, in_axes=(0, 0, 0, *axes, None))(q, k, v, ids, mask, qids, sinks)

        args = [q, k, v] + [x for x in (kv_ids, dynamic, q_ids, sinks) if x is not None]
        # interpret=True goes to the kernel itself: the context-wide TPU interpret
        # mode does not support the grid axis that vmap adds.
        out = compat.pallas_tpu_traced(kernel, interpret=False)(*args)
        out = out[:, :, :T, : spec.v_head_dim].astype(spec.out_dtype)
        if sinks is not None:
            return out  # a row with no key weighs the sink only: 0, as the kernel gives
        return _util.fill_empty_rows(spec, out, v_in, empty)


def _kernel_arrays(spec: AttentionSpec, plan: _Plan, q, k, v):
    """q, k and v as the kernel takes them, ``[B, H, T', D']``: the spec
    rounds q/k to compute_dtype before the product; the scale is folded into
    q in float32 (the kernel has no scale); lengths and head dims padded."""
    kdt = plan.kernel_dtype
    q = q.astype(spec.compute_dtype).astype(jnp.float32) * jnp.float32(plan.form.scale)
    q = _util.pad_axis(_util.pad_axis(q.astype(kdt), 3, plan.head_dim), 2, plan.q_len)
    k = k.astype(spec.compute_dtype).astype(kdt)
    k = _util.pad_axis(_util.pad_axis(k, 3, plan.head_dim), 2, plan.kv_len)
    v = _util.pad_axis(_util.pad_axis(v.astype(kdt), 3, plan.v_head_dim), 2, plan.kv_len)
    return q, k, v


def _step_inputs(spec: AttentionSpec, plan: _Plan, q, k, v):
    """A ring step's kernel inputs (`_kernel_arrays`; static masks only) and
    the segment ids that exclude padded keys (None without padding)."""
    ids = None
    if plan.kv_len > spec.kv_len:
        sa = compat.splash_attention_module()
        kv = jnp.asarray((np.arange(plan.kv_len) >= spec.kv_len).astype(np.int32))
        ids = sa.SegmentIds(q=jnp.zeros((plan.q_len,), jnp.int32), kv=kv)
    return _kernel_arrays(spec, plan, q, k, v), ids


def _splash_kernel(plan: _Plan, mask, interpret: bool, residuals: bool = False):
    """The splash kernel of ``plan`` with ``mask`` (a static `MultiHeadMask`
    or a dynamic array); with ``residuals`` it also returns its logsumexp."""
    return compat.make_splash_kernel(
        mask,
        block_sizes=_block_sizes(plan),
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=plan.form.softcap,
        interpret=interpret,
        save_residuals=residuals,
    )


def _step_kernel(plan: _Plan, interpret: bool, residuals: bool):
    """The splash kernel of a ring step: its static mask."""
    return _splash_kernel(plan, _static_mask(plan), interpret, residuals)
