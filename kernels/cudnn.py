"""Adapter for cuDNN flash attention: ``jax.nn.dot_product_attention(implementation="cudnn")``.

cuDNN's fused attention computes, per batch element and query head (layout
``[B, T, H, D]``; ``H`` a multiple of the key/value heads, so GQA and MQA run
without repeating K/V)::

    s = scale * (q @ k^T) + bias + where(mask, 0, -2**41)   # f32 statistics
    s = where(causal, s, -inf)                               # top-left, is_causal
    out = softmax(s) @ v                                     # p in the input dtype

on float16/bfloat16 inputs with ``q``, ``k``, ``v`` of one head dim (a
multiple of 8, at most 128; 256 on Hopper and later), a bias and a mask whose
two last axes are exactly ``[T, S]``, and gradients for ``q``, ``k``, ``v`` and
the bias.  This module maps an `AttentionSpec` onto it exactly:

* Score ops in the kernel's order (`_linear.linear_form`): one ``scale``; each
  bias multiplied by the Scales that follow it (exact for powers of two);
  masks whose fills exclude keys.  Bias sums are rounded to the input dtype.
* ``Causal``: cuDNN's own causal mask when ``offset == 0`` and ``T == S``;
  otherwise ANDed into the boolean mask (materialised as ``[1, 1, T, S]``).
* ``Window``: when the windows and the causal mask keep exactly the keys
  ``i - left <= j <= i`` and ``T == S``, ``local_window_size=(left, 0)`` with
  ``is_causal=True``: cuDNN's causal sliding window (JAX passes
  ``sliding_window_length = left + 1``, keys ``(i - left - 1, i]``), the same
  band in the XLA implementation; no ``T x S`` array.  A window's right
  bound 0 implies any causal offset >= 0.  With masks, the rows they empty
  within the window are found by prefix counts (key masks) or one pass over
  the (already ``T x S``) mask, and every excluding op must end with one score
  (`_util.shared_fill_reasons`).
* ``KvLengths``: the valid key count of each batch row, ``n =
  clip(L + shift, 0, S)`` (`flashpass.ops.valid_lengths`, the minimum over
  several ops), one per batch row (lengths varying over heads are rejected:
  cuDNN takes one per row).  Without any other mask array (no bias, mask,
  window or materialised causal mask) it is ``key_value_seq_lengths``, no
  ``T x S`` array (cuDNN's padding mask, ``PADDING_CAUSAL`` with its causal
  mask): a row of length 0 runs with length 1 (every kernel row keeps a key,
  nothing non-finite reaches the backward) and its output is replaced by the
  mean of ``v``; ``k`` and ``v`` past each row's length are zeroed by a
  select before the call, so the gradient there is exactly 0 whatever cuDNN
  leaves in the regions it skips.  With a bias, a mask or a window it is
  ANDed into the mask as the key mask ``j < n`` (that path already builds a
  ``T x S`` array), whose empty rows are found like any key mask's.  A
  length of 0 can empty any row, so every excluding op must end with one
  score (`_util.shared_fill_reasons`).
* Bias and masks are broadcast to ``[B|1, H|1, T, S]``.
* An odd ``T`` or ``S`` is padded by one (cuDNN's training kernels want even
  lengths with a bias, and JAX's forward rule counts its placeholder for no
  bias as one): the padded key is masked out (by the mask, or by
  ``key_value_seq_lengths = S`` where there is no mask array), the padded
  query sliced off.
* Head dims are zero-padded to one multiple of 8 (``Dv != D`` included).

Not supported (rejected by `check`): float32 attention (cuDNN computes on
16-bit inputs; a spec that keeps float32 q/k/v, weights or output would lose
precision), Softcap, fills that do not exclude keys, head dims above the
limit, windows other than the causal sliding window on self-attention (cuDNN
has no right window without its causal mask; a ``T x S`` mask would lose
what the descriptor saves), chunk/prefix/segment-id masks, kv lengths that
vary over heads or whose rows can end empty with different fills, and hosts whose
jaxlib has no cuDNN.  No interpret mode: it only runs on
an NVIDIA GPU (`flashpass.compat.assume_cudnn` lets it be traced and lowered
elsewhere, for tests).

Rows in which every key is excluded: the mean of ``v`` over all keys (the
reference's result when the excluded keys share one finite fill).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashpass import compat
from flashpass.spec import AttentionSpec, KvLengths, Window

from . import _linear, _util
from .base import CheckContext, Kernel

_HEAD_MULTIPLE = 8
#: Structured ops the adapter takes: `Window`, as cuDNN's causal sliding window.
_STRUCTURED = frozenset({Window})


def head_dim_limit() -> int:
    """cuDNN's largest head dim here: 256 on Hopper (sm_90) and later, else 128."""
    capability = compat.gpu_compute_capability()
    return 256 if capability is not None and capability >= (9, 0) else 128


@dataclasses.dataclass(frozen=True)
class _Plan:
    form: _linear.LinearForm
    kernel_dtype: np.dtype
    head_dim: int
    is_causal: bool  # cuDNN's own causal mask (else folded into the mask)
    q_len: int  # padded to even when there is a bias/mask
    kv_len: int
    #: the `Window` ops' keys ``i - left <= j <= i + right`` (with the causal
    #: mask's bound on the right; None: unbounded), or None without a window
    window_bounds: tuple[int, int | None] | None = None
    #: ``local_window_size``, ``(left, 0)`` with ``is_causal``: cuDNN's causal
    #: sliding window (None: no window, or one that excludes no key on the left)
    window: tuple[int, int] | None = None
    #: how the `KvLengths` ops run: None (there are none), "native"
    #: (``key_value_seq_lengths``) or "mask" (the key mask ``j < n``)
    lengths: str | None = None
    #: whether cuDNN gets ``key_value_seq_lengths``: the native kv lengths, or
    #: ``S`` to exclude the padded key where there is no mask to do it
    seq_lengths: bool = False


def window_bounds(spec: AttentionSpec, form: _linear.LinearForm):
    """``(left, right)``: the keys ``i - left <= j <= i + right`` the spec's
    `Window` ops and causal mask keep (``right`` None: unbounded), or None
    without a `Window` op.  Several windows intersect."""
    windows = [op for op in form.structured if isinstance(op, Window)]
    if not windows:
        return None
    rights = [op.right for op in windows if op.right is not None]
    if form.causal_offset is not None:
        rights.append(form.causal_offset)
    return min(op.left for op in windows), min(rights) if rights else None


def _native_window(spec: AttentionSpec, bounds) -> bool:
    """Whether ``bounds`` is cuDNN's causal sliding window: ``local_window_size
    = (left, 0)`` with ``is_causal`` (keys ``i - left <= j <= i``), which
    cuDNN takes on self-attention (its causal mask is used only for T == S)."""
    left, right = bounds
    return right == 0 and left >= 0 and spec.q_len == spec.kv_len


def _plan(spec: AttentionSpec) -> _Plan:
    form = _linear.linear_form(_util.without_lengths(spec), _STRUCTURED)
    offset = form.causal_offset
    is_causal = offset == 0 and spec.q_len == spec.kv_len
    bounds = window_bounds(spec, form)
    window = None
    if bounds is not None and _native_window(spec, bounds):
        # The window's right bound 0 implies the causal mask (any offset >= 0).
        is_causal = True
        if bounds[0] < spec.kv_len - 1:  # else it excludes no key on the left
            window = (bounds[0], 0)
    masked = bool(form.biases or form.masks) or (offset is not None and not is_causal)
    lengths = None
    if spec.ops_of(KvLengths):
        # Native only where no mask array exists: then no row but a length-0
        # one is empty, and nothing adds to the regions cuDNN skips.
        lengths = "mask" if masked or bounds is not None else "native"
        masked = masked or lengths == "mask"
    # cuDNN's training kernels want even lengths with a bias, and JAX's forward
    # rule counts its placeholder for no bias as one: odd lengths are padded.
    q_len, kv_len = _util.round_up(spec.q_len, 2), _util.round_up(spec.kv_len, 2)
    return _Plan(
        form=form,
        kernel_dtype=_util.kernel_dtype(spec, narrow=(_util.BF16, _util.F16)),
        head_dim=_util.round_up(max(spec.head_dim, spec.v_head_dim), _HEAD_MULTIPLE),
        is_causal=is_causal,
        q_len=q_len,
        kv_len=kv_len,
        window_bounds=bounds,
        window=window,
        lengths=lengths,
        seq_lengths=lengths == "native" or (not masked and kv_len > spec.kv_len),
    )


def _reasons(spec: AttentionSpec) -> list[str]:
    reasons = _util.input_reasons(spec, "cuDNN attention")
    if reasons:
        return reasons
    plan = _plan(spec)
    if plan.kernel_dtype == _util.F32:
        kept = ", ".join(
            f"{n}={getattr(spec, n).name}"
            for n in ("q_dtype", "k_dtype", "v_dtype", "p_dtype", "out_dtype", "compute_dtype")
        )
        reasons.append(
            f"cuDNN flash attention computes on float16/bfloat16 inputs, but this attention "
            f"keeps float32 precision ({kept}); cast q/k/v, the softmax weights and the "
            "output to bfloat16 or float16, or use 'pallas_gpu' or 'blockwise'"
        )
    limit = head_dim_limit()
    if plan.head_dim > limit:
        reasons.append(
            f"head dim {max(spec.head_dim, spec.v_head_dim)} (padded to {plan.head_dim}) "
            f"exceeds cuDNN's limit of {limit} on this GPU; use 'pallas_gpu' or 'blockwise'"
        )
    form = plan.form
    reasons += form.reasons
    if form.softcap is not None:
        reasons.append(
            "logit soft-capping is not supported by cuDNN attention in "
            "jax.nn.dot_product_attention; use the 'blockwise' kernel"
        )
    if plan.window_bounds is not None:
        left, right = plan.window_bounds
        if not _native_window(spec, plan.window_bounds):
            right_words = "unbounded" if right is None else f"i + {right}"
            reasons.append(
                "cuDNN takes a local window only as a causal sliding window on "
                "self-attention (keys i - left <= j <= i: local_window_size=(left, 0) with "
                f"its causal mask, q_len == kv_len); this window keeps keys i - {left} <= j "
                f"<= {right_words} with q_len={spec.q_len}, kv_len={spec.kv_len}: use the "
                "'blockwise' kernel, which skips the blocks it excludes"
            )
        elif form.masks:
            reasons += _util.shared_fill_reasons(spec, "a local window together with a mask")
    return reasons + _util.lengths_reasons(
        spec, "cuDNN takes one key/value length per batch row (key_value_seq_lengths)"
    )


def _window_empty(spec: AttentionSpec, keep, left: int):
    """``[b, h, T, 1]``: the rows in which the keep-mask ``keep`` (``[b, h,
    T|1, S]``) leaves no key of the causal window ``i - left <= j <= i``.
    Key masks in O(T + S) (prefix counts), others in one T x S pass."""
    rows = np.arange(spec.q_len)
    if keep.shape[2] == 1:
        counts = jnp.cumsum(keep[:, :, 0, :].astype(jnp.int32), axis=-1)
        counts = jnp.pad(counts, ((0, 0), (0, 0), (1, 0)))  # counts[j]: kept keys < j
        hi = np.minimum(rows, spec.kv_len - 1) + 1
        lo = np.clip(rows - left, 0, spec.kv_len)
        return (counts[..., hi] - counts[..., lo] == 0)[..., None]
    cols = jnp.arange(spec.kv_len)[None, :]
    band = (cols >= jnp.asarray(rows)[:, None] - left) & (cols <= jnp.asarray(rows)[:, None])
    return ~jnp.any(keep & band, axis=-1, keepdims=True)


class CudnnKernel(Kernel):
    """cuDNN flash attention through ``jax.nn.dot_product_attention``.

    NVIDIA GPUs only (no interpret mode).  Supports Scale, Bias (with gradient),
    boolean Mask and Causal (any offset >= 0) ops, causal sliding windows
    (`Window`, self-attention), per-row kv lengths (`KvLengths`, one per
    batch row), GQA/MQA natively, any sequence length, head
    dims up to 128 (256 on Hopper+), bfloat16/float16.
    Rejects float32 attention, Softcap and non-excluding fills.  Reverse-mode AD.
    """

    name = "cudnn"
    platforms = ("gpu",)
    interpret_platforms = ()
    dtypes = frozenset({"bfloat16", "float16"})
    descriptors = frozenset({"causal", "mask", "key_mask", "bias", "gqa", "window", "kv_lengths"})
    grad = True
    partitionable = True  # jax.nn.dot_product_attention's custom_partitioning
    plain_jax = False

    def __init__(self, *, implementation: str = "cudnn"):
        """``implementation="xla"`` calls ``jax.nn.dot_product_attention``'s XLA
        implementation instead, on any platform: the same contract, so the
        adapter's transforms can be checked numerically without a GPU (tests)."""
        if implementation not in ("cudnn", "xla"):
            raise ValueError(f"implementation must be 'cudnn' or 'xla', got {implementation!r}")
        self.implementation = implementation

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        reasons = self.platform_reasons(ctx)
        if reasons:
            return reasons
        if compat.cudnn_version() is None:
            return [
                "cuDNN is not available in this JAX installation (jaxlib without CUDA); "
                "install jax[cuda12] (or jax[cuda13]) on the GPU machine"
            ]
        return _reasons(spec)

    def apply(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        if interpret and self.implementation == "cudnn":
            raise ValueError("the cudnn kernel has no interpret mode (it only runs on a GPU)")
        reasons = _reasons(spec)
        self.require(reasons)
        plan = _plan(spec)
        form = plan.form
        kdt = plan.kernel_dtype
        T, S = spec.q_len, spec.kv_len
        Tp, Sp = plan.q_len, plan.kv_len
        v_in = v

        def prepare(x, length):
            x = _util.pad_axis(_util.pad_axis(x, 3, plan.head_dim), 2, length)
            return jnp.swapaxes(x, 1, 2)  # [B, H, T, D] -> [B, T, H, D]

        q = prepare(q.astype(spec.compute_dtype).astype(kdt), Tp)
        k = prepare(k.astype(spec.compute_dtype).astype(kdt), Sp)
        v = prepare(v.astype(kdt), Sp)

        lengths = _util.valid_lengths(spec, extras) if plan.lengths else None
        seq_lengths = None
        if plan.seq_lengths:
            # The padded query row (if any) is cuDNN's padding too: never computed.
            # Under vmap, JAX's cuDNN batching rule reshapes both length arrays
            # with q's batch: an integer 0 read from q makes them batched with it
            # (constant query lengths would stay unbatched, and fail).
            zero = (q[:, 0, 0, 0] != 0).astype(jnp.int32) * 0
            n = S if lengths is None else jnp.maximum(lengths, 1)
            seq_lengths = (n + zero, jnp.full_like(zero, T) + zero)
        if plan.lengths == "native":
            # A row of length 0 runs with one key (a finite kernel row) and gets the
            # mean of v below; keys past a row's length are selected to 0 so that
            # their gradient is exactly 0 whatever the kernel leaves there.
            key_rows = (jnp.arange(Sp) < seq_lengths[0][:, None])[:, :, None, None]
            k = jnp.where(key_rows, k, jnp.zeros((), kdt))
            v = jnp.where(key_rows, v, jnp.zeros((), kdt))

        bias = _linear.bias_sum(spec, form, extras, kdt)
        if bias is not None:
            bias = jnp.broadcast_to(bias, (*bias.shape[:2], T, S))
            bias = _util.pad_axis(_util.pad_axis(bias, 2, Tp), 3, Sp)

        masks = form.masks
        if plan.lengths == "mask":  # the key mask j < n, ANDed with the others
            extras = [*extras, (jnp.arange(S) < lengths[:, None])[:, None, None, :]]
            masks = (*masks, len(extras) - 1)
        keep, empty = _util.combined_keep(spec, masks, extras, offset=form.causal_offset)
        if plan.lengths == "native":
            empty = (lengths == 0)[:, None, None, None]
        if plan.window_bounds is not None and keep is not None:
            # (check: the window is native, keys i - left <= j <= i)
            empty = _window_empty(spec, keep, plan.window_bounds[0])
        if form.causal_offset is not None and not plan.is_causal:
            causal = jnp.asarray(_util.causal_keep(spec, form.causal_offset))
            keep = causal if keep is None else keep & causal
        if keep is None and Sp > S and not plan.seq_lengths:
            keep = jnp.ones((1, 1, 1, S), bool)
        if keep is not None:
            keep = jnp.broadcast_to(keep, (*keep.shape[:2], T, S))
            # The padded query row keeps the real keys; the padded key is never kept.
            keep = _util.pad_axis(_util.pad_axis(keep, 2, Tp, value=True), 3, Sp, value=False)

        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias=bias,
            mask=keep,
            scale=form.scale,
            is_causal=plan.is_causal,
            query_seq_lengths=None if seq_lengths is None else seq_lengths[1],
            key_value_seq_lengths=None if seq_lengths is None else seq_lengths[0],
            local_window_size=plan.window,
            implementation=self.implementation,
        )
        out = jnp.swapaxes(out, 1, 2)[:, :, :T, : spec.v_head_dim].astype(spec.out_dtype)
        return _util.fill_empty_rows(spec, out, v_in, empty)
