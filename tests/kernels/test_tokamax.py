"""The optional tokamax adapter.

tokamax is an optional extra (``pip install flashpass[gpu]``).  Without it the
adapter rejects every site with a reason, and its argument mapping is checked
against a stand-in module that implements ``tokamax.dot_product_attention``'s
documented semantics in plain JAX.  With it (the newest-JAX leg,
ci/newest_jax.sh) the adapter runs the real package through tokamax's XLA
implementations on CPU, forward and gradients against the float64 reference,
and its GPU implementations, which cannot run here, must decline with a
reason; the Mosaic GPU and Triton paths run only on a GPU.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import BF16, F32, bias_op, has_gpu, mask_op, normal, run_and_compare, spec_of

import flashpass
from flashpass import compat
from flashpass.kernels import (
    DEFAULT_ORDER,
    Causal,
    CheckContext,
    Mask,
    Scale,
    Softcap,
    get_kernel,
    gpu_order,
    kernel_names,
)
from flashpass.kernels.tokamax import DEFAULT_IMPLEMENTATIONS, TokamaxKernel
from flashpass.select import choose

KERNEL = get_kernel("tokamax")
GPU = CheckContext(platform="gpu")
INSTALLED = compat.tokamax_installed()
F16 = np.dtype(np.float16)
needs_tokamax = pytest.mark.skipif(not INSTALLED, reason="needs the optional tokamax package")


def test_registered_and_in_the_gpu_order_from_jax_0_11_1_when_installed():
    assert "tokamax" in kernel_names() and isinstance(KERNEL, TokamaxKernel)
    triton = ("cudnn", "pallas_gpu", "flash_gpu", "blockwise")
    assert gpu_order(True, False) == gpu_order(True, True) == triton
    assert gpu_order(False, False) == ("cudnn", "pallas_gpu", "blockwise")
    assert gpu_order(False, True) == ("cudnn", "pallas_gpu", "tokamax", "blockwise")
    assert DEFAULT_ORDER["gpu"] == gpu_order(compat.TRITON_ATTENTION, INSTALLED)
    assert all("tokamax" not in DEFAULT_ORDER[p] for p in ("tpu", "cpu"))
    (reason,) = KERNEL.check(spec_of(dtype=BF16), CheckContext(platform="tpu"))
    assert "runs on gpu" in reason


def test_implementation_argument():
    assert KERNEL.implementation == ("mosaic_gpu", "triton")
    assert DEFAULT_IMPLEMENTATIONS == ("mosaic", "triton")
    assert TokamaxKernel(implementation="xla").implementation == ("xla",)
    assert TokamaxKernel(implementation=["mosaic", "xla"]).implementation == ("mosaic_gpu", "xla")
    for bad in ((), "", ("xla", None)):
        with pytest.raises(ValueError, match="implementation="):
            TokamaxKernel(implementation=bad)


@pytest.mark.skipif(INSTALLED, reason="tokamax is installed")
def test_not_installed_reason():
    (reason,) = KERNEL.check(spec_of(dtype=BF16, ops=[Scale(0.25)]), GPU)
    assert "'tokamax' package is not installed" in reason
    with pytest.raises(ValueError, match="not installed"):
        KERNEL.apply(spec_of(dtype=BF16), None, None, None)


def _stand_in_attention(
    q, k, v, bias=None, mask=None, *, scale, is_causal, logits_soft_cap, implementation
):
    """tokamax.dot_product_attention's documented semantics ([B, T, N, H] layout)."""
    assert implementation == ("mosaic_gpu", "triton")
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = scale * jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    keep = jnp.ones(logits.shape, bool)
    if mask is not None:
        keep = keep & mask
    if is_causal:
        keep = keep & jnp.tril(jnp.ones(logits.shape[-2:], bool))
    logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnh->btnh", p, v, preferred_element_type=jnp.float32).astype(q.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    module = types.SimpleNamespace(dot_product_attention=_stand_in_attention)
    monkeypatch.setattr(compat, "tokamax_module", lambda: module)


@pytest.mark.parametrize("causal", [0, 9], ids=["top_left", "offset"])
def test_mapping_against_stand_in(stand_in, causal):
    """GQA, Dv != D, a bias before the soft-cap, a key mask with a fully masked
    example, causal (tokamax's own at offset 0 with T == S, else a mask)."""
    b, be = bias_op(0, (1, 4, 16, 16 + causal), BF16)
    m, me = mask_op(1, (2, 1, 1, 16 + causal))
    spec = spec_of(
        h=4,
        hkv=2,
        t=16,
        s=16 + causal,
        dv=8,
        dtype=BF16,
        ops=[Scale(0.3), b, Softcap(8.0), Mask(1, me.shape, -1e9), Causal(causal, -1e9)],
        extras=[be, me],
    )
    assert KERNEL.check(spec, GPU) == []
    keep = np.ones(me.shape, bool)
    keep[1] = False
    run_and_compare(KERNEL, spec, [normal(be.shape, 5, BF16), jnp.asarray(keep)], tol=3e-2)


def test_rejects_float32_and_late_bias(stand_in):
    (reason,) = KERNEL.check(spec_of(dtype=F32), GPU)
    assert "float32" in reason
    b, be = bias_op(0, (1, 2, 16, 16), BF16)
    late = spec_of(dtype=BF16, ops=[Softcap(8.0), b], extras=[be])
    assert any("after the logit soft-cap" in r for r in KERNEL.check(late, GPU))


@pytest.mark.skipif(not (INSTALLED and has_gpu()), reason="needs tokamax and a GPU")
def test_real_tokamax_on_gpu():
    spec = spec_of(h=4, hkv=2, t=256, d=64, dtype=BF16, ops=[Scale(0.125), Causal(0, -1e9)])
    assert KERNEL.check(spec, GPU) == []
    run_and_compare(KERNEL, spec, tol=3e-2, interpret=False)


# --------------------------------------------------------------------------- the real package


def _real_case(case: str, dtype):
    """(spec, extras) of one case the adapter claims, in ``dtype``."""
    if case == "causal":  # tokamax's own is_causal (offset 0, T == S)
        return spec_of(h=4, hkv=2, t=24, dtype=dtype, ops=[Scale(0.3), Causal(0, -1e9)]), []
    if case == "causal_offset":  # bottom-right causal (T < S): a mask built by the adapter
        return spec_of(t=16, s=25, dtype=dtype, ops=[Scale(0.3), Causal(9, -1e9)]), []
    if case == "mask":  # a mask that varies over queries
        m, me = mask_op(0, (2, 1, 16, 16))
        keep = np.random.default_rng(7).random(me.shape) < 0.7
        keep[..., 0] = True
        return spec_of(dtype=dtype, ops=[Scale(0.3), m], extras=[me]), [jnp.asarray(keep)]
    if case == "everything":  # GQA, Dv != D, bias before the soft-cap, a key mask
        # with a fully masked example, causal at an offset
        b, be = bias_op(0, (1, 4, 16, 21), dtype)
        m, me = mask_op(1, (2, 1, 1, 21))
        spec = spec_of(
            h=4,
            hkv=2,
            t=16,
            s=21,
            dv=8,
            dtype=dtype,
            ops=[Scale(0.3), b, Softcap(8.0), Mask(1, me.shape, -1e9), Causal(5, -1e9)],
            extras=[be, me],
        )
        keep = np.ones(me.shape, bool)
        keep[1] = False
        return spec, [normal(be.shape, 5, dtype), jnp.asarray(keep)]
    raise ValueError(case)


@needs_tokamax
@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
@pytest.mark.parametrize(
    "case,dtype",
    [
        ("causal", BF16),
        ("causal_offset", BF16),
        ("mask", BF16),
        ("everything", BF16),
    ],
    ids=["causal", "causal_offset", "mask", "everything"],
)
def test_real_tokamax_matches_the_reference(case, dtype, implementation):
    """The real package (its XLA implementations, on any host), forward and
    gradients (q, k, v and the bias) against the float64 reference."""
    kernel = TokamaxKernel(implementation=implementation)
    spec, extras = _real_case(case, dtype)
    assert kernel.check(spec, GPU) == []
    errors = run_and_compare(kernel, spec, extras, tol=3e-2)
    assert {"out", "dq", "dk", "dv"} <= set(errors)


@needs_tokamax
def test_real_tokamax_float16_traces():
    """float16 (declared) traces, forward and backward, to the promised dtypes.
    Not run: tokamax asks for the F16_F16_F32 dot algorithm, which XLA:CPU lacks."""
    kernel = TokamaxKernel(implementation="xla")
    spec, extras = _real_case("everything", F16)
    assert kernel.check(spec, GPU) == []
    q, k, v = (
        jax.ShapeDtypeStruct(shape, F16) for shape in (spec.q_shape, spec.k_shape, spec.v_shape)
    )

    def loss(q, k, v, bias):
        out = kernel.apply(spec, q, k, v, [bias, extras[1]])
        return out.astype(jnp.float32).sum(), out

    (_, out), grads = jax.eval_shape(
        jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True), q, k, v, extras[0]
    )
    assert (out.shape, out.dtype) == (spec.out_shape, F16)
    assert [g.dtype for g in grads] == [F16] * 4


def _bf16_causal(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * 0.25
    keep = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    p = jax.nn.softmax(jnp.where(keep, s, -1e9), axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def _bf16_args():
    return [normal((2, 32, 4, 16), seed, BF16) for seed in range(3)]


@needs_tokamax
@pytest.mark.parametrize("implementation", [("mosaic",), DEFAULT_IMPLEMENTATIONS])
def test_gpu_implementations_decline_with_a_reason_off_a_gpu(implementation):
    """tokamax's GPU kernels raise NotImplementedError while tracing on this
    host: the adapter names each implementation's reason and the site goes on
    to blockwise (no crash)."""
    kernel = TokamaxKernel(implementation=implementation)
    report = flashpass.optimize(_bf16_causal, platform="gpu", kernel=[kernel, "blockwise"]).explain(
        *_bf16_args()
    )
    assert report.kernels == ["blockwise"], str(report)
    (reason,) = report.rewrites[0].rejected["tokamax"]
    assert "NotImplementedError" in reason and "no tokamax implementation" in reason, reason
    for name in kernel.implementation:
        assert f"{name}: " in reason, reason


@needs_tokamax
def test_an_implementation_that_traces_is_chosen():
    spec, _ = _real_case("everything", BF16)
    kernel, rejections = choose(spec, [TokamaxKernel(implementation="xla")], GPU)
    assert kernel is not None and kernel.name == "tokamax" and rejections == {}


@pytest.mark.skipif(
    compat.TRITON_ATTENTION or not INSTALLED or has_gpu(),
    reason="tokamax joins the GPU order on JAX >= 0.11.1 when installed; off a GPU it declines",
)
def test_gpu_default_order_tries_tokamax_then_blockwise():
    report = flashpass.optimize(_bf16_causal, platform="gpu").explain(*_bf16_args())
    assert report.kernels == ["blockwise"], str(report)
    rejected = report.rewrites[0].rejected
    assert list(rejected) == ["cudnn", "pallas_gpu", "tokamax"], rejected
    assert "mosaic_gpu: " in rejected["tokamax"][0] and "triton: " in rejected["tokamax"][0]
