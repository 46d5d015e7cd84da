"""Optional adapter for ``tokamax.dot_product_attention`` (never a dependency).

`tokamax <https://github.com/openxla/tokamax>`_ picks among its own GPU
attention kernels (Mosaic GPU on Hopper/Blackwell, Triton) and computes::

    logits = scale * (q @ k^T) + bias
    logits = cap * tanh(logits / cap)              # logits_soft_cap
    logits = where(mask & causal, logits, -big)    # is_causal: top-left
    out    = softmax(logits) @ v

with ``q: [B, T, H, D]``, ``k: [B, S, Hkv, D]``, ``v: [B, S, Hkv, Dv]`` (GQA,
MQA and ``Dv != D`` native) and broadcastable bias/mask.  The mapping uses
`_linear.linear_form` (as the cuDNN adapter does) and passes masks unmaterialised.

The adapter is always registered; its `check` rejects every site, with a
reason, when ``tokamax`` is not installed.  It joins the GPU default order
(before ``blockwise``) on JAX >= 0.11.1, where ``pallas_gpu`` declines every
site, when tokamax is installed (`flashpass.kernels.gpu_order`); elsewhere name it
(``kernel="tokamax"`` or ``kernel=["tokamax", "cudnn", ...]``).  float32
attention is rejected (tokamax's public API uses the default matmul precision,
TF32 on recent GPUs).

``TokamaxKernel(implementation=...)`` picks tokamax's implementations, tried in
order: by default Mosaic GPU (Hopper and Blackwell), then Triton.  Where none
runs (an Ampere GPU with a JAX whose Triton tokamax will not use, or a host
that is not a GPU: tokamax raises ``NotImplementedError`` while tracing), the
adapter raises one ``NotImplementedError`` naming each implementation's reason,
which kernel selection's probe turns into the site's rejection reason: the
order goes on to ``blockwise``.  ``implementation="xla"`` (tokamax's plain XLA
attention) runs on any host; the tests run the adapter through it on CPU
(tests/kernels/test_tokamax.py, the conformance suite's ``tokamax_xla``).
Unverified here: no GPU, so the Mosaic GPU and Triton paths have never run.
"""

from __future__ import annotations

import jax.numpy as jnp

from flashpass import compat
from flashpass.spec import AttentionSpec

from . import _linear, _util
from .base import CheckContext, Kernel

#: tokamax implementations tried in order (its own fallback: an implementation
#: that cannot take the call raises NotImplementedError while tracing).
DEFAULT_IMPLEMENTATIONS = ("mosaic", "triton")


def _implementations(implementation) -> tuple[str, ...]:
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"implementation= takes a tokamax implementation name or a non-empty sequence "
            f"of them (e.g. 'mosaic', 'triton', 'xla'); got {implementation!r}"
        )
    # tokamax resolves "mosaic" by the default device (Mosaic TPU on a TPU host);
    # this adapter's kernels are for GPUs, whichever host traces them.
    return tuple("mosaic_gpu" if n == "mosaic" else n for n in names)


def _reasons(spec: AttentionSpec) -> list[str]:
    reasons, form = _linear.linear_reasons(spec, "tokamax attention")
    if form is not None and _util.kernel_dtype(spec, narrow=(_util.BF16, _util.F16)) == _util.F32:
        reasons.insert(
            0,
            "this attention keeps float32 precision; tokamax's kernels use the default "
            "(TF32) matmul precision for float32: use 'pallas_gpu' or 'blockwise'",
        )
    return reasons


class TokamaxKernel(Kernel):
    """``tokamax.dot_product_attention`` (optional package).

    GPU only.  Supports Scale, Bias, Softcap (after scale and bias), boolean
    Mask and Causal (any offset >= 0) ops, GQA/MQA, ``Dv != D``, bfloat16 and
    float16.  Which tokamax kernel runs, and its limits, is tokamax's choice.
    """

    name = "tokamax"
    platforms = ("gpu",)
    interpret_platforms = ()
    dtypes = frozenset({"bfloat16", "float16"})
    descriptors = frozenset({"causal", "mask", "key_mask", "bias", "softcap", "gqa"})
    grad = True
    partitionable = False
    plain_jax = False

    def __init__(self, *, implementation=DEFAULT_IMPLEMENTATIONS):
        """``implementation``: a tokamax implementation name or a sequence of them,
        tried in order (``tokamax.dot_product_attention``'s argument; "mosaic" is
        passed as "mosaic_gpu").  Register an instance to change the default one:
        ``register_kernel(TokamaxKernel(implementation=...), replace=True)``."""
        self.implementation = _implementations(implementation)

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        reasons = self.platform_reasons(ctx)
        if reasons:
            return reasons
        if compat.tokamax_module() is None:
            return ["the optional 'tokamax' package is not installed (pip install tokamax)"]
        return _reasons(spec)

    def apply(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        reasons = _reasons(spec)
        tokamax = compat.tokamax_module()
        if tokamax is None:
            reasons.append("the optional 'tokamax' package is not installed")
        self.require(reasons)
        form = _linear.linear_form(spec)
        kdt = _util.kernel_dtype(spec, narrow=(_util.BF16, _util.F16))
        T, S = spec.q_len, spec.kv_len
        v_in = v

        def btnh(x):
            return jnp.swapaxes(x, 1, 2)

        q = btnh(q.astype(spec.compute_dtype).astype(kdt))
        k = btnh(k.astype(spec.compute_dtype).astype(kdt))
        v = btnh(v.astype(kdt))
        bias = _linear.bias_sum(spec, form, extras, jnp.float32)
        keep, empty = _util.combined_keep(spec, form.masks, extras, offset=form.causal_offset)
        offset = form.causal_offset
        is_causal = offset == 0 and T == S
        if offset is not None and not is_causal:
            causal = jnp.asarray(_util.causal_keep(spec, offset))
            keep = causal if keep is None else keep & causal
        try:
            out = tokamax.dot_product_attention(
                q,
                k,
                v,
                bias=bias,
                mask=keep,
                scale=form.scale,
                is_causal=is_causal,
                logits_soft_cap=form.softcap,
                implementation=self.implementation,
            )
        except NotImplementedError as err:  # the only implementation named
            raise NotImplementedError(_declined(self.implementation, [err])) from err
        except ExceptionGroup as group:  # each implementation raised
            errors = group.exceptions
            if not all(isinstance(e, NotImplementedError) for e in errors):
                raise
            raise NotImplementedError(_declined(self.implementation, errors)) from group
        out = btnh(out)[:, :, :, : spec.v_head_dim].astype(spec.out_dtype)
        return _util.fill_empty_rows(spec, out, v_in, empty)


def _declined(implementations, errors) -> str:
    """One line naming why each tokamax implementation declined."""
    parts = [
        f"{name}: {' '.join(str(err).split()) or type(err).__name__}"
        for name, err in zip(implementations, errors, strict=False)
    ]
    return "no tokamax implementation takes this attention here (" + "; ".join(parts) + ")"
