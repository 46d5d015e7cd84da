"""``flash_gpu``: the op-protocol tiles of ``flash_tpu`` on Pallas Triton.

* Its Threefry (`compat.threefry2x32_rounds`, Triton has no rule for JAX's
  primitive) is bit-equal to the primitive, so its dropout keep-mask is the
  blockwise kernel's; dropout numerics against the float64 reference.
* Numerics in Triton interpret mode on CPU, forward and gradient, on a few of
  test_flash_tpu.py's combinations (the rest ``slow``); the conformance suite
  runs its cases too.
* Lowered for CUDA from this host: each site the issue names, optimized with
  ``kernel="flash_gpu"`` at ``T = S = 2048`` in bfloat16, is a Triton custom
  call with no tensor of ``T * S`` elements, forward and gradient.
No GPU ran these: whether Triton compiles and runs the kernels on the device,
and how fast, only a GPU can tell.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_flash_tpu as tpu_tests
from kernel_testing import BF16, F32, run_and_compare

import flashpass
from flashpass import compat
from flashpass.kernels import CheckContext
from flashpass.kernels.flash_gpu import FlashGpuKernel

from jax_versions import requires_triton

pytestmark = requires_triton

KERNEL = FlashGpuKernel(32, 64)


def test_threefry_rounds_are_the_primitive():
    x = jnp.arange(4096, dtype=jnp.uint32).reshape(64, 64) * np.uint32(2654435761)
    for k1, k2 in ((0, 0), (7, 9), (0xFFFFFFFF, 0x12345678)):
        a = compat.threefry2x32_rounds(np.uint32(k1), np.uint32(k2), x, x ^ np.uint32(5))
        b = compat.threefry2x32(np.uint32(k1), np.uint32(k2), x, x ^ np.uint32(5))
        for u, w in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(w))


def test_dropout_numerics_match_the_reference():
    spec = tpu_tests._dropout_spec()
    key = jax.random.key_data(jax.random.key(5)).reshape(1, 1, 1, 2)
    run_and_compare(FlashGpuKernel(16, 64), spec, [key], tol=2e-5)


DEFAULT = {("causal_window_key", "f32"), ("alibi_keys_padding", "bf16")}


def _matrix():
    for name in tpu_tests.MATRIX:
        for dtype in ("f32", "bf16"):
            marks = [] if (name, dtype) in DEFAULT else [pytest.mark.slow]
            yield pytest.param(name, dtype, marks=marks, id=f"{name}-{dtype}")


@pytest.mark.parametrize("name,dtype", list(_matrix()))
def test_matrix_matches_the_reference(name, dtype):
    spec, extras = tpu_tests.MATRIX[name]({"f32": F32, "bf16": BF16}[dtype])
    assert KERNEL.check(spec, CheckContext("cpu", interpret=True)) == []
    run_and_compare(KERNEL, spec, extras, tol=tpu_tests.TOL[dtype])


@pytest.mark.parametrize("name", list(tpu_tests.SITES))
def test_site_lowers_for_cuda_without_t_by_s(name):
    fn = tpu_tests.SITES[name]
    shape = (tpu_tests.EB, tpu_tests.ET, tpu_tests.EH, tpu_tests.ED)
    qkv = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3
    extra = tpu_tests._site_input(name)
    opt = flashpass.optimize(fn, platform="gpu", kernel="flash_gpu")
    report = opt.explain(*qkv, extra)
    assert report.kernels == ["flash_gpu"] and not report.fallbacks, str(report)
    loss = lambda q, k, v, e: opt(q, k, v, e).astype(jnp.float32).sum()  # noqa: E731
    for program in (opt, jax.grad(loss, argnums=(0, 1, 2))):
        module = compat.parse_stablehlo(compat.lower_for_gpu(program, *qkv, extra))
        ops = compat.stablehlo_ops(module)
        assert any(t and "triton" in t for _, _, t in ops)
        big = {s for _, shapes, _ in ops for s in shapes if math.prod(s) >= tpu_tests.ET**2}
        assert not big, big


def test_gpu_order_takes_what_cudnn_and_pallas_gpu_cannot():
    """ALiBi on GPU: cuDNN and the Triton attention decline it; flash_gpu
    takes it before blockwise."""
    qkv = [jax.ShapeDtypeStruct((1, 256, 2, 32), jnp.bfloat16)] * 3
    slopes = jnp.asarray([0.5, 0.25], jnp.float32)

    def alibi(q, k, v, slopes):
        i, j = jnp.arange(256)[:, None], jnp.arange(256)[None, :]
        s = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) / math.sqrt(32)
        s = jnp.where(j <= i, s + slopes[None, :, None, None] * (j - i), -1e9)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1).astype(v.dtype), v)

    with compat.assume_cudnn():
        report = flashpass.optimize(alibi, platform="gpu").explain(*qkv, slopes)
    assert report.kernels == ["flash_gpu"], str(report)
