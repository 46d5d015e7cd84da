"""Adapter for JAX's Pallas GPU flash attention (``pallas.ops.gpu.attention``, Triton).

``attention.mha`` computes, per batch element and head (layout ``[B, T, H, D]``)::

    s = (q @ k^T) * sm_scale                               # f32 accumulation
    s = where(causal & (seg[i] == seg[j]), s, -0.7 * f32_max)  # top-left causal
    out = softmax(s) @ v                                   # p cast to v.dtype

with ``q``, ``k``, ``v`` of one head dim and head count (no GQA, ``Dv == D``),
one segment-id array shared by queries and keys, no bias, and a
``custom_vjp`` whose fused Triton backward needs as many query blocks as key
blocks.  This module maps an `AttentionSpec` onto it exactly:

* One length for queries and keys: ``L``, a power of two up to the block size
  (128) and a multiple of it beyond; both are zero-padded to it.
* ``Causal(offset)``, any offset >= 0: query ``i`` is placed at row
  ``i + offset`` (``offset`` zero rows in front), so the kernel's top-left
  mask keeps exactly the keys ``j <= i + offset``.
* Excluding keys (padding to ``L``; boolean masks that only vary over keys,
  ``[B|1, H|1, 1, S]``): when every real query row precedes the first padded
  key, padded keys get segment id 1 and everything else 0.  Otherwise an extra
  head-dim column carries the mask: ``2**14`` in every query row, ``0`` for a
  kept key, ``-2**14`` for a masked and ``-2**15`` for a padded one, so an
  excluded key's logit is ``-2**28 * sm_scale`` (float32 accumulation, exactly
  zero weight) and a kept key's is unchanged.
* GQA/MQA: K/V heads are repeated.  ``Dv != D``: both zero-padded to the larger
  (and to at least 16, the Triton ``dot`` minimum); extra columns are sliced off.
* Float32 kernels are traced under ``jax.default_matmul_precision("highest")``
  (IEEE float32 ``dot`` instead of TF32) and every kernel with x64 off, in the
  forward and the backward (`flashpass.compat.traced_with`).
* ``interpret=True`` runs the kernel in Pallas interpret mode (any platform).

* Segment ids (`Segments`): the kernel's ``segment_ids`` is one array read
  for both the query rows and the keys at each position (``seg[i] ==
  seg[j]``), exact only when the program's query and key ids are one array
  (``Segments.same``, which the matcher proves for ``ids[:, None] ==
  ids[None, :]``), with causal offset 0 and no boolean mask; padded keys get
  an id no query has.

Not supported (rejected by `check`): Bias ops, Softcap, masks that vary over
queries, non-positive scales, float64, windows, chunks and prefix-LM masks,
and segment ids the matcher could not prove to be one array.

Rows in which every key is excluded: the mean of ``v`` over all keys (the
reference's result when the excluded keys share one finite fill).

JAX versions: JAX 0.11.1 deprecates ``pallas.ops.gpu.attention`` (in favour of
tokamax) and 0.11.2 the Pallas Triton backend (in favour of Mosaic GPU).  From
0.11.1 on, `check` declines every site with that reason and the module is never
imported (`flashpass.compat.TRITON_ATTENTION`): the GPU order goes on to the
``tokamax`` adapter when tokamax is installed (the ``gpu`` extra), then to
``blockwise``.

Not used as a replacement: JAX's Mosaic GPU attention (``attention_mgpu``,
Hopper) has no softmax scale, masks or sequence padding, no causal backward,
only float16/bfloat16 and head dims that are multiples of 64, and asserts a
CUDA runtime while tracing (no interpret mode on a CPU).  tokamax's kernels (the
``tokamax`` adapter) have no interpret mode either, and its ``triton`` one is
Pallas Triton too: it is tested through tokamax's XLA implementations on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashpass import compat
from flashpass.spec import AttentionSpec, Segments

from . import _linear, _util
from .base import CheckContext, Kernel

#: Head-dim column values that exclude keys (see module doc).
_COLUMN_Q = 2.0**14
_COLUMN_MASKED = -(2.0**14)
_COLUMN_PADDED = -(2.0**15)
#: Triton's ``dot`` needs every dimension to be at least 16.
_MIN_DIM = 16
#: Above this ratio of padded to real work, the default order skips the kernel.
_MAX_WASTE = 4.0


@dataclasses.dataclass(frozen=True)
class _Plan:
    form: _linear.LinearForm
    kernel_dtype: np.dtype
    front: int  # zero query rows in front (the causal offset)
    length: int  # common padded length of queries and keys
    head_dim: int  # common padded head dim (incl. the mask column)
    segments: bool  # padded keys excluded by segment ids
    column: bool  # keys excluded by the extra head-dim column
    block_q: int
    block_k: int
    block_bwd: int


def _jax_reasons() -> list[str]:
    """The Triton kernel runs only on JAX versions that have not deprecated it."""
    if compat.TRITON_ATTENTION:
        return []
    return [
        f"JAX {jax.__version__} deprecates the Triton flash attention pallas_gpu runs "
        "(jax.experimental.pallas.ops.gpu.attention) and the Pallas Triton backend; "
        "pallas_gpu runs on JAX < 0.11.1 only: use 'cudnn', 'tokamax' or 'blockwise'"
    ]


def _reasons(spec: AttentionSpec) -> list[str]:
    label = "the Pallas GPU attention kernel"
    reasons, form = _linear.linear_reasons(
        spec, label, bias_instead="cudnn", structured=frozenset({Segments})
    )
    reasons = _jax_reasons() + reasons
    if form is None:
        return reasons
    for op in form.structured:
        reasons += _segment_reasons(spec, op, form)
    if form.softcap is not None:
        reasons.append(
            "logit soft-capping is not supported by the Pallas GPU attention kernel; "
            "use the 'blockwise' kernel"
        )
    for index in form.masks:
        if not _util.is_key_mask(spec, index):
            shape = tuple(spec.extras[index].shape)
            reasons.append(
                f"boolean mask of shape {shape} varies over queries; the Pallas GPU kernel "
                "only takes key (padding) masks [B, 1, 1, S]: use 'cudnn' or 'blockwise'"
            )
    if not form.scale > 0:
        reasons.append(
            f"score scale {form.scale} is not positive; the adapter excludes keys through "
            "large negative logits, which a non-positive scale would flip"
        )
    return reasons


def _segment_reasons(spec: AttentionSpec, op: Segments, form) -> list[str]:
    """The kernel's one segment-id array serves queries and keys at each
    position: exact for the program's ids only when they are one array
    (`Segments.same`) at aligned positions, with nothing else excluding keys."""
    if not op.same:
        return [
            "segment ids (packed documents) are supported only when the query and key ids "
            "are one array (ids[:, :, None] == ids[:, None, :]): the Pallas GPU kernel "
            "takes one segment-id array for queries and keys (query row p and key p share "
            "one id), and this attention's query and key ids are separate inputs; use the "
            "'blockwise' kernel, which skips the blocks across documents"
        ]
    reasons = []
    if form.causal_offset not in (None, 0):
        reasons.append(
            f"segment ids with a causal offset {form.causal_offset}: the kernel's query rows "
            "would be shifted against their ids"
        )
    if form.masks:
        reasons.append("segment ids together with a boolean mask are not supported")
    extra = spec.extras[op.q_index]
    if extra.shape[1] != 1:
        reasons.append("segment ids that differ between heads are not supported")
    dtype = np.dtype(extra.dtype)
    if dtype.itemsize > 4 or not (np.issubdtype(dtype, np.integer) or dtype == np.bool_):
        reasons.append(f"segment ids of dtype {dtype.name} (the kernel takes int32)")
    reasons += _linear.exclusion_reasons(spec, spec.ops.index(op))
    return reasons


def _plan(spec: AttentionSpec, block_q: int, block_k: int, block_bwd: int) -> _Plan:
    form = _linear.linear_form(spec, frozenset({Segments}))
    front = form.causal_offset or 0
    n = max(front + spec.q_len, spec.kv_len)
    block = max(block_q, block_k, block_bwd)  # every block divides the common length
    if n <= block:
        length = max(_MIN_DIM, _util.next_pow2(n))
    else:
        length = _util.round_up(n, block)
    pad_keys = length > spec.kv_len
    # Segment ids are shared by queries and keys: usable only when no real query
    # row sits at a padded key's position (the program's own ids, `Segments.same`:
    # padded keys get an id no query has).
    user_ids = bool(form.structured)
    segments = user_ids or (pad_keys and not form.masks and front + spec.q_len <= spec.kv_len)
    column = bool(form.masks) or (pad_keys and not segments)
    head_dim = max(spec.head_dim, spec.v_head_dim) + (1 if column else 0)
    return _Plan(
        form=form,
        kernel_dtype=_util.kernel_dtype(spec, narrow=(_util.BF16, _util.F16)),
        front=front,
        length=length,
        head_dim=max(head_dim, _MIN_DIM),
        segments=segments,
        column=column,
        block_q=min(block_q, length),
        block_k=min(block_k, length),
        block_bwd=min(block_bwd, length),
    )


def _waste(spec: AttentionSpec, plan: _Plan) -> float:
    """Padded work over real work (``q_len * kv_len`` score entries)."""
    return plan.length**2 / (spec.q_len * spec.kv_len)


def _trace_context(kernel_dtype):
    @contextlib.contextmanager
    def context():
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.enable_x64(False))
            if kernel_dtype == _util.F32:
                # DEFAULT precision makes Triton use TF32 for float32 dots.
                stack.enter_context(jax.default_matmul_precision("highest"))
            yield

    return context


class PallasGpuKernel(Kernel):
    """JAX's Pallas Triton flash attention (``pallas.ops.gpu.attention.mha``).

    Runs on GPU, or anywhere with ``interpret=True`` (slow; for tests).
    Supports Scale, Causal (any offset >= 0) and key (padding) masks, GQA/MQA
    (K/V repeated), any sequence length and head dims, float32/bfloat16/float16,
    reverse-mode AD.  Rejects Bias, Softcap and masks that vary over queries.
    Unless named explicitly, it also declines sites where padding queries and
    keys to one length would more than quadruple the work (e.g. decoding).
    JAX < 0.11.1 only (later versions deprecate the kernel; see the module doc).
    """

    name = "pallas_gpu"
    platforms = ("gpu",)
    interpret_platforms = ("cpu",)
    dtypes = frozenset({"bfloat16", "float16", "float32"})
    # (segment ids only when they are one array, `Segments.same`: not declared)
    descriptors = frozenset({"causal", "key_mask", "gqa"})
    grad = True
    partitionable = False  # a Pallas custom call: XLA runs it replicated
    plain_jax = False
    ring_step = True  # forward: the kernel's logsumexp; backward: its fused kernels

    def __init__(self, *, block_q: int = 128, block_k: int = 128, block_bwd: int = 32):
        """Block sizes (powers of two >= 16): forward query/key blocks and the
        backward's blocks (JAX's defaults)."""
        for name, value in (("block_q", block_q), ("block_k", block_k), ("block_bwd", block_bwd)):
            if value < _MIN_DIM or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        self.block_q, self.block_k, self.block_bwd = block_q, block_k, block_bwd

    def _plan(self, spec: AttentionSpec) -> _Plan:
        return _plan(spec, self.block_q, self.block_k, self.block_bwd)

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        reasons = self.platform_reasons(ctx) + _reasons(spec)
        if not reasons and not ctx.explicit:
            waste = _waste(spec, self._plan(spec))
            if waste > _MAX_WASTE:
                reasons.append(
                    f"padding queries and keys to one length ({self._plan(spec).length}, for "
                    f"q_len={spec.q_len}, kv_len={spec.kv_len}) would do {waste:.1f}x the "
                    "work; name kernel='pallas_gpu' to use it anyway"
                )
        return reasons

    def apply(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        self.require(_reasons(spec))
        plan, args, empty = self._inputs(spec, q, k, v, extras)
        kernel = _kernel(plan, interpret)
        out = compat.traced_with(kernel, _trace_context(plan.kernel_dtype))(*args)
        out = _rows(plan, out, spec.q_len)[..., : spec.v_head_dim].astype(spec.out_dtype)
        return _util.fill_empty_rows(spec, out, v, empty)

    def step_reasons(self, spec: AttentionSpec) -> list[str]:
        """Ring steps without masks or segment ids: a step whose masks leave a
        row no key would need the original's fill statistics."""
        form = _linear.linear_form(spec, frozenset({Segments}))
        if form.masks or form.structured:
            return ["pallas_gpu runs ring steps without boolean masks or segment ids"]
        return []

    def step_forward(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        """One ring step: the kernel's output and logsumexp (``m = lse``,
        ``den = 1``; `Kernel.step_forward`)."""
        self.require(_reasons(spec) + self.step_reasons(spec))
        plan, args, _ = self._inputs(spec, q, k, v, extras)
        kernel = _kernel(plan, interpret, residuals=True)
        with _trace_context(plan.kernel_dtype)():
            out, lse = kernel(*args)
        out = _rows(plan, out, spec.q_len)[..., : spec.v_head_dim].astype(spec.out_dtype)
        lse = lse[:, :, plan.front : plan.front + spec.q_len]
        return out, lse, jnp.ones_like(lse)

    def step_backward(
        self, spec, q, k, v, extras, out, m, den, dout, wanted, *, interpret: bool = False
    ):
        """The kernel's fused backward from the global output and logsumexp
        ``m + log(den)`` (`Kernel.step_backward`)."""
        self.require(_reasons(spec) + self.step_reasons(spec))
        plan, args, _ = self._inputs(spec, q, k, v, extras)
        T, L, kdt = spec.q_len, plan.length, plan.kernel_dtype

        def rows_in(x, value=0.0):  # [B, H, T, ...] -> the kernel's padded rows
            return _util.pad_axis(x, 2, L, front=plan.front, value=value)

        width = plan.head_dim
        out_k = rows_in(_util.pad_axis(out.astype(kdt), 3, width))
        do_k = rows_in(_util.pad_axis(dout.astype(kdt), 3, width))
        # Padded query rows: lse +inf, so their weights are exactly 0.
        lse = rows_in(m.astype(jnp.float32) + jnp.log(den.astype(jnp.float32)), jnp.inf)
        q_k, k_k, v_k, *ids = args
        res = (*(_btnh(x) for x in (q_k, k_k, v_k)), ids[0] if ids else None)
        res += (_btnh(out_k), lse)
        with _trace_context(kdt)():
            dq, dk, dv, _ = compat.gpu_attention_backward(
                res, _btnh(do_k), **_call_options(plan, interpret)
            )
        dq = _rows(plan, _btnh(dq), T)[..., : spec.head_dim]
        dk, dv = (_btnh(x)[:, :, : spec.kv_len] for x in (dk, dv))
        dk, dv = dk[..., : spec.head_dim], dv[..., : spec.v_head_dim]
        if spec.groups > 1:  # K/V were repeated per query head: sum each group
            dk, dv = (_group_sum(spec, x) for x in (dk, dv))
        grads = tuple(x.astype(jnp.float32) for x in (dq, dk, dv))  # (the ring sums them)
        return (*grads, tuple(None for _ in extras))

    def _inputs(self, spec: AttentionSpec, q, k, v, extras):
        """The plan and the kernel's arguments ``[B, H, L, D']`` (and segment
        ids), and the rows the masks leave no key."""
        plan = self._plan(spec)
        form = plan.form
        kdt = plan.kernel_dtype
        S, L = spec.kv_len, plan.length

        q = q.astype(spec.compute_dtype).astype(kdt)
        k = k.astype(spec.compute_dtype).astype(kdt)
        v = v.astype(kdt)
        if spec.groups > 1:  # no GQA in the kernel
            k = jnp.repeat(k, spec.groups, axis=1)
            v = jnp.repeat(v, spec.groups, axis=1)
        width = max(spec.head_dim, spec.v_head_dim)
        q = _util.pad_axis(_util.pad_axis(q, 3, width), 2, L, front=plan.front)
        k = _util.pad_axis(_util.pad_axis(k, 3, width), 2, L)
        v = _util.pad_axis(_util.pad_axis(v, 3, plan.head_dim), 2, L)

        keep, empty = _util.combined_keep(spec, form.masks, extras, offset=form.causal_offset)
        if plan.column:
            B, H = spec.batch, spec.heads
            if keep is None:  # only padded keys to exclude
                real = jnp.zeros((1, 1, S), kdt)
            else:  # [b, h, 1, S] key mask
                real = jnp.where(keep[:, :, 0, :], 0.0, _COLUMN_MASKED).astype(kdt)
            k_col = jnp.broadcast_to(real, (B, H, S))
            k_col = _util.pad_axis(k_col, 2, L, value=_COLUMN_PADDED)[..., None]
            q = jnp.concatenate([q, jnp.full((B, H, L, 1), _COLUMN_Q, kdt)], axis=3)
            k = jnp.concatenate([k, k_col], axis=3)
        q = _util.pad_axis(q, 3, plan.head_dim)
        k = _util.pad_axis(k, 3, plan.head_dim)

        args = [q, k, v]
        if form.structured:  # the program's ids, one array (`_segment_reasons`)
            (op,) = form.structured
            _, ids, _ = _util.segment_arrays(spec, op, extras, kv_len=L)
            args.append(jnp.broadcast_to(ids, (spec.batch, L)))
        elif plan.segments:
            ids = (np.arange(L) >= S).astype(np.int32)
            args.append(jnp.asarray(np.broadcast_to(ids, (spec.batch, L))))
        return plan, args, empty


def _btnh(x):
    """``[B, H, T, D]`` <-> the kernel's ``[B, T, H, D]``."""
    return jnp.swapaxes(x, 1, 2)


def _rows(plan: _Plan, out, q_len: int):
    """The real query rows of a kernel output ``[B, H, L, D']``."""
    return out[:, :, plan.front : plan.front + q_len]


def _group_sum(spec: AttentionSpec, x):
    b, _, s, d = x.shape
    return x.reshape(b, spec.kv_heads, spec.groups, s, d).sum(axis=2)


def _call_options(plan: _Plan, interpret: bool) -> dict:
    ga = compat.gpu_attention_module()
    block_sizes = ga.BlockSizes(
        block_q=plan.block_q,
        block_k=plan.block_k,
        block_q_dkv=plan.block_bwd,
        block_kv_dkv=plan.block_bwd,
        block_q_dq=plan.block_bwd,
        block_kv_dq=plan.block_bwd,
    )
    causal = plan.form.causal_offset is not None
    return dict(
        sm_scale=plan.form.scale, causal=causal, block_sizes=block_sizes, interpret=interpret
    )


def _kernel(plan: _Plan, interpret: bool, residuals: bool = False):
    """``fn(q, k, v[, segment_ids])`` in the adapter's ``[B, H, L, D']``
    layout: the kernel's output (and, with ``residuals``, its logsumexp
    ``[B, H, L]``)."""
    options = _call_options(plan, interpret)

    def kernel(q, k, v, segment_ids=None):
        q, k, v = (_btnh(x) for x in (q, k, v))
        if residuals:
            out, lse = compat.gpu_attention_with_lse(q, k, v, segment_ids, **options)
            return _btnh(out), lse
        return _btnh(compat.gpu_attention_module().mha(q, k, v, segment_ids, **options))

    return kernel
