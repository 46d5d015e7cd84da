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

* Score ops in the kernel's order (`_util.linear_form`): one ``scale``; each
  bias multiplied by the Scales that follow it (exact for powers of two);
  masks whose fills exclude keys.  Bias sums are rounded to the input dtype.
* ``Causal``: cuDNN's own causal mask when ``offset == 0`` and ``T == S``;
  otherwise ANDed into the boolean mask (materialised as ``[1, 1, T, S]``).
* Bias and masks are broadcast to ``[B|1, H|1, T, S]``.
* With a bias or a mask and an odd ``T`` or ``S`` (cuDNN's training kernels
  want even lengths), both are padded by one: the padded key is masked out,
  the padded query sliced off.
* Head dims are zero-padded to one multiple of 8 (``Dv != D`` included).

Not supported (rejected by `check`): float32 attention (cuDNN computes on
16-bit inputs; a spec that keeps float32 q/k/v, weights or output would lose
precision), Softcap, fills that do not exclude keys, head dims above the
limit, and hosts whose jaxlib has no cuDNN.  No interpret mode: it only runs on
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
from flashpass.spec import AttentionSpec

from . import _util
from .base import CheckContext, Kernel

_HEAD_MULTIPLE = 8


def head_dim_limit() -> int:
    """cuDNN's largest head dim here: 256 on Hopper (sm_90) and later, else 128."""
    capability = compat.gpu_compute_capability()
    return 256 if capability is not None and capability >= (9, 0) else 128


@dataclasses.dataclass(frozen=True)
class _Plan:
    form: _util.LinearForm
    kernel_dtype: np.dtype
    head_dim: int
    is_causal: bool  # cuDNN's own causal mask (else folded into the mask)
    q_len: int  # padded to even when there is a bias/mask
    kv_len: int


def _plan(spec: AttentionSpec) -> _Plan:
    form = _util.linear_form(spec)
    offset = form.causal_offset
    is_causal = offset == 0 and spec.q_len == spec.kv_len
    masked = bool(form.biases or form.masks) or (offset is not None and not is_causal)
    q_len, kv_len = spec.q_len, spec.kv_len
    if masked and (q_len % 2 or kv_len % 2):
        q_len, kv_len = _util.round_up(q_len, 2), _util.round_up(kv_len, 2)
    return _Plan(
        form=form,
        kernel_dtype=_util.kernel_dtype(spec, narrow=(_util.BF16, _util.F16)),
        head_dim=_util.round_up(max(spec.head_dim, spec.v_head_dim), _HEAD_MULTIPLE),
        is_causal=is_causal,
        q_len=q_len,
        kv_len=kv_len,
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
    return reasons


class CudnnKernel(Kernel):
    """cuDNN flash attention through ``jax.nn.dot_product_attention``.

    NVIDIA GPUs only (no interpret mode).  Supports Scale, Bias (with gradient),
    boolean Mask and Causal (any offset >= 0) ops, GQA/MQA natively, any
    sequence length, head dims up to 128 (256 on Hopper+), bfloat16/float16.
    Rejects float32 attention, Softcap and non-excluding fills.  Reverse-mode AD.
    """

    name = "cudnn"
    platforms = ("gpu",)
    interpret_platforms = ()
    dtypes = frozenset({"bfloat16", "float16"})
    descriptors = frozenset({"causal", "mask", "key_mask", "bias", "gqa"})
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

        bias = _util.bias_sum(spec, form, extras, kdt)
        if bias is not None:
            bias = jnp.broadcast_to(bias, (*bias.shape[:2], T, S))
            bias = _util.pad_axis(_util.pad_axis(bias, 2, Tp), 3, Sp)

        keep, empty = _util.combined_keep(spec, form.masks, extras, offset=form.causal_offset)
        if form.causal_offset is not None and not plan.is_causal:
            causal = jnp.asarray(_util.causal_keep(spec, form.causal_offset))
            keep = causal if keep is None else keep & causal
        if keep is None and Sp > S:
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
            implementation=self.implementation,
        )
        out = jnp.swapaxes(out, 1, 2)[:, :, :T, : spec.v_head_dim].astype(spec.out_dtype)
        return _util.fill_empty_rows(spec, out, v_in, empty)
