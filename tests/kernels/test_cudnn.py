"""The cuDNN adapter: checks, tracing and lowering without a GPU.

cuDNN cannot run here.  Its checks run under `compat.assume_cudnn` (which
answers JAX's "which cuDNN?" question while tracing); its forward and gradient
are traced and lowered for CUDA to the cuDNN custom calls; its transforms are
checked numerically through the XLA implementation of the same call in
test_conformance.py (``cudnn_xla``), and on a GPU for real (``cudnn``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import (
    BF16,
    F32,
    bias_op,
    has_gpu,
    mask_op,
    normal,
    requires_gpu,
    run_and_compare,
)
from kernel_testing import spec_of as _spec_of

from flashpass import compat
from flashpass.kernels import Causal, CheckContext, Mask, Scale, Softcap, get_kernel
from flashpass.kernels.cudnn import CudnnKernel, _plan

KERNEL = get_kernel("cudnn")
GPU = CheckContext(platform="gpu")


def spec_of(**kwargs):
    kwargs.setdefault("dtype", BF16)
    return _spec_of(**kwargs)


def _shapes(spec):
    return [
        jax.ShapeDtypeStruct(spec.q_shape, spec.q_dtype),
        jax.ShapeDtypeStruct(spec.k_shape, spec.k_dtype),
        jax.ShapeDtypeStruct(spec.v_shape, spec.v_dtype),
        *[jax.ShapeDtypeStruct(e.shape, e.dtype) for e in spec.extras],
    ]


def test_attributes_and_platforms():
    assert isinstance(KERNEL, CudnnKernel)
    assert (KERNEL.platforms, KERNEL.interpret_platforms, KERNEL.grad) == (
        ("gpu",),
        (),
        True,
    )
    spec = spec_of(ops=[Scale(0.125)])
    for platform in ("cpu", "tpu"):
        for interpret in (False, True):
            (reason,) = KERNEL.check(spec, CheckContext(platform=platform, interpret=interpret))
            assert f"runs on gpu, not {platform}" in reason
    with compat.assume_cudnn():
        assert KERNEL.check(spec, GPU) == []
    with pytest.raises(ValueError, match="no interpret mode"):
        KERNEL.apply(spec, None, None, None, interpret=True)


@pytest.mark.skipif(compat.cudnn_version() is not None, reason="this jaxlib has cuDNN")
def test_without_cudnn_the_reason_says_how_to_get_it():
    (reason,) = KERNEL.check(spec_of(ops=[Scale(0.125)]), GPU)
    assert "cuDNN is not available" in reason and "jax[cuda" in reason


def test_plan():
    p = _plan(spec_of(t=21, s=33, d=20, dv=12, ops=[Scale(0.1), Causal(12, -1e9)]))
    # causal with an offset is a mask; masks want even lengths; head dims to 8s.
    assert (p.is_causal, p.q_len, p.kv_len, p.head_dim) == (False, 22, 34, 24)
    p = _plan(spec_of(t=21, ops=[Scale(0.1), Causal(0, -1e9)]))
    assert (p.is_causal, p.q_len, p.kv_len) == (True, 21, 21)


_m, _me = mask_op(0, (1, 1, 16, 16), fill=-10.0)
REJECTED = {
    "float32": (spec_of(dtype=F32, ops=[Scale(0.25)]), "float16/bfloat16"),
    "float32_softmax": (spec_of(p_dtype=F32, out_dtype=F32), "p_dtype=float32"),
    "softcap": (spec_of(ops=[Scale(0.25), Softcap(20.0)]), "soft-capping"),
    "head_dim": (spec_of(d=136), "limit of"),
    "fill": (spec_of(ops=[_m], extras=[_me]), "does not exclude"),
    "float64": (spec_of(dtype=np.float64, compute=np.float64), "float64"),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_check_rejects_with_reason(name):
    spec, needle = REJECTED[name]
    if name == "head_dim" and has_gpu() and compat.gpu_compute_capability() >= (9, 0):
        pytest.skip("Hopper takes head dims up to 256")
    with compat.assume_cudnn():
        reasons = KERNEL.check(spec, GPU)
    assert reasons and any(needle in r for r in reasons), reasons
    with pytest.raises(ValueError, match="cudnn cannot run"):
        KERNEL.apply(spec, None, None, None)


def _everything():
    b, be = bias_op(0, (1, 4, 21, 33), BF16)
    m, me = mask_op(1, (2, 1, 1, 33))
    return spec_of(
        h=4,
        hkv=2,
        t=21,
        s=33,
        d=20,
        dv=12,
        ops=[Scale(0.3), b, Mask(1, me.shape, -1e9), Causal(12, -1e9)],
        extras=[be, me],
    )


def test_traces_and_lowers_for_gpu_without_one():
    """GQA, odd lengths and head dims, a bias, a key mask, bottom-right causal:
    forward and gradient (incl. the bias) trace and lower to cuDNN fused attention."""
    spec = _everything()
    shapes = _shapes(spec)

    def fwd(q, k, v, bias, keep):
        return KERNEL.apply(spec, q, k, v, (bias, keep))

    def grad(q, k, v, bias, keep):
        loss = lambda *a: fwd(*a, keep).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    def targets(fn):
        module = compat.parse_stablehlo(compat.lower_for_gpu(fn, *shapes))
        return [t for _, _, t in compat.stablehlo_ops(module) if t]

    with compat.assume_cudnn():
        out = jax.eval_shape(fwd, *shapes)
        assert (out.shape, out.dtype) == (spec.out_shape, spec.out_dtype)
        grads = jax.eval_shape(grad, *shapes)
        assert [g.shape for g in grads] == [s.shape for s in shapes[:4]]
        fwd_targets, grad_targets = targets(fwd), targets(grad)
    assert len(fwd_targets) == 1 and fwd_targets[0].startswith("__cudnn$fmha")
    assert any(t.startswith("__cudnn$fmha") and "Backward" in t for t in grad_targets)


def test_xla_implementation_checks_the_transforms():
    """The same adapter on jax.nn.dot_product_attention's XLA implementation."""
    with compat.assume_cudnn():
        spec = _everything()
        assert KERNEL.check(spec, GPU) == []
    keep = np.ones((2, 1, 1, 33), bool)
    keep[1, ..., :20] = False  # with the causal offset 12: rows 0..7 of example 1 are empty
    bias = normal(spec.extras[0].shape, 3, BF16)
    run_and_compare(CudnnKernel(implementation="xla"), spec, [bias, jnp.asarray(keep)], tol=3e-2)


@requires_gpu
def test_runs_on_gpu():
    spec = _everything()
    keep = np.ones((2, 1, 1, 33), bool)
    keep[1, ..., :20] = False
    bias = normal(spec.extras[0].shape, 3, BF16)
    run_and_compare(KERNEL, spec, [bias, jnp.asarray(keep)], tol=3e-2, interpret=False)
