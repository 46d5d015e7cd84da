"""Default kernel order per platform, tested by faking the platform.

``flashpass.optimize(fn, platform=...)`` selects kernels for that platform on
any host: `check` runs as there, and the selection probe traces the kernel
call (it lowers only on the host's own platform).  cuDNN is faked with
`compat.assume_cudnn` (this host's jaxlib has no CUDA).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import BF16, F32, spec_of

import flashpass
from flashpass import compat
from flashpass.kernels import (
    DEFAULT_ORDER,
    Bias,
    Causal,
    CheckContext,
    ExtraSpec,
    Scale,
    Softcap,
    default_order,
    get_kernel,
)
from flashpass.select import choose

B, T, H, D = 2, 64, 4, 32


def causal_attention(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) / np.sqrt(D)
    keep = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    p = jax.nn.softmax(jnp.where(keep, s, -1e9), axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def biased_attention(q, k, v, bias):
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) / np.sqrt(D)
    p = jax.nn.softmax(s + bias, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def softcapped_attention(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) / np.sqrt(D)
    s = 30.0 * jnp.tanh(s / 30.0)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", p, v)


def _args(dtype, bias=False):
    rng = np.random.default_rng(0)
    qkv = [jnp.asarray(rng.standard_normal((B, T, H, D)), dtype) for _ in range(3)]
    if bias:
        qkv.append(jnp.asarray(rng.standard_normal((1, H, T, T)), jnp.float32))
    return qkv


#: What the GPU order picks where cuDNN cannot: pallas_gpu, or on a JAX that
#: deprecates its Triton kernel (`compat.TRITON_ATTENTION`), blockwise.
PALLAS_GPU = "pallas_gpu" if compat.TRITON_ATTENTION else "blockwise"
#: tokamax joins the GPU order after pallas_gpu from JAX 0.11.1 when installed
#: (`flashpass.kernels.gpu_order`); on this host its GPU kernels decline.
TOKAMAX = not compat.TRITON_ATTENTION and compat.tokamax_installed()
#: Our own op-protocol kernel on Pallas Triton (before JAX 0.11.1), before blockwise.
FLASH_GPU = ("flash_gpu",) if compat.TRITON_ATTENTION else ()
#: What the GPU order picks where neither cuDNN nor pallas_gpu can.
OWN_GPU = "flash_gpu" if compat.TRITON_ATTENTION else "blockwise"


def explain(fn, platform, dtype, bias=False, kernel=None):
    return flashpass.optimize(fn, platform=platform, kernel=kernel).explain(*_args(dtype, bias))


def test_default_orders():
    assert DEFAULT_ORDER == {
        "tpu": ("paged_tpu", "splash", "flash_tpu", "pallas_tpu", "blockwise"),
        "gpu": ("cudnn", "pallas_gpu", *FLASH_GPU, *(("tokamax",) if TOKAMAX else ()), "blockwise"),
        "cpu": ("blockwise",),
    }
    assert default_order("metal") == ("blockwise",)
    for order in DEFAULT_ORDER.values():
        for name in order:
            get_kernel(name)  # every default kernel imports and instantiates


@pytest.mark.parametrize(
    "fn,platform,dtype,bias,cudnn,expected",
    [
        (causal_attention, "tpu", F32, False, False, "splash"),
        (causal_attention, "tpu", BF16, False, False, "splash"),
        (biased_attention, "tpu", F32, True, False, "flash_tpu"),  # splash: no bias
        (softcapped_attention, "tpu", F32, False, False, "splash"),
        (causal_attention, "gpu", BF16, False, True, "cudnn"),
        (causal_attention, "gpu", BF16, False, False, PALLAS_GPU),  # no cuDNN here
        (causal_attention, "gpu", F32, False, True, PALLAS_GPU),  # cuDNN: 16-bit only
        (biased_attention, "gpu", BF16, True, True, "cudnn"),
        (biased_attention, "gpu", F32, True, True, OWN_GPU),  # pallas_gpu: no bias
        (softcapped_attention, "gpu", BF16, False, True, OWN_GPU),
    ],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_platform_default_choice(fn, platform, dtype, bias, cudnn, expected):
    with compat.assume_cudnn() if cudnn else contextlib.nullcontext():
        report = explain(fn, platform, dtype, bias)
    assert report.platform == platform
    assert report.kernels == [expected], str(report)


def test_rejection_reasons_in_the_report():
    """Kernels named for a site they cannot run leave it as written, each with
    its reason, in `explain`."""
    report = explain(softcapped_attention, "gpu", F32, kernel=["cudnn", "pallas_gpu"])
    assert report.kernels == []
    (fallback,) = report.fallbacks
    assert set(fallback.rejections) == {"cudnn", "pallas_gpu"}
    assert any("cuDNN" in r for r in fallback.rejections["cudnn"])
    assert any("soft-capping" in r for r in fallback.rejections["pallas_gpu"])

    report = explain(biased_attention, "tpu", F32, bias=True, kernel="splash")
    (fallback,) = report.fallbacks
    assert "takes no bias" in fallback.reason
    assert "splash" in str(report)


_BIAS = spec_of(
    t=64,
    ops=[Scale(0.1), Bias(0, (1, 2, 64, 64), F32)],
    extras=[ExtraSpec((1, 2, 64, 64), F32)],
)


@pytest.mark.parametrize(
    "platform,spec,chosen,rejected",
    [
        ("tpu", _BIAS, "flash_tpu", {"paged_tpu": "queries per row", "splash": "takes no bias"}),
        (
            "gpu",
            spec_of(t=64, ops=[Scale(0.1), Causal(0, -1e9)]),
            PALLAS_GPU,
            {"cudnn": "float32"}
            | ({} if compat.TRITON_ATTENTION else {"pallas_gpu": "deprecates"})
            | ({"tokamax": "float32"} if TOKAMAX else {}),
        ),
        (
            "gpu",
            spec_of(t=64, dtype=BF16, ops=[Scale(0.1), Softcap(30.0)]),
            OWN_GPU,
            {"cudnn": "soft-capping", "pallas_gpu": "soft-capping"}
            | ({"tokamax": "no tokamax implementation"} if TOKAMAX else {}),
        ),
    ],
    ids=["tpu_bias", "gpu_f32", "gpu_softcap"],
)
def test_default_order_rejections(platform, spec, chosen, rejected):
    """Which kernel the default order picks and why the earlier ones declined."""
    kernels = [get_kernel(n) for n in default_order(platform)]
    with compat.assume_cudnn():
        kernel, rejections = choose(spec, kernels, CheckContext(platform=platform))
    assert kernel.name == chosen
    assert set(rejections) == set(rejected)
    for name, word in rejected.items():
        assert any(word in r for r in rejections[name]), rejections[name]


def test_cpu_default_is_blockwise_only():
    """On CPU only blockwise is tried; it declines short sequences (naive XLA is faster)."""
    report = explain(causal_attention, "cpu", F32)
    assert report.kernels == []
    (fallback,) = report.fallbacks
    assert set(fallback.rejections) == {"blockwise"}
