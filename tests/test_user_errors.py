"""Errors a user meets name the user's function, argument and platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.errors import PlatformError

from jax_versions import requires_triton


def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


Q = np.ones((1, 256, 2, 64), np.float32)


@requires_triton
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a CPU host")
def test_program_for_another_platform_says_so():
    opt = flashpass.optimize(attention, platform="gpu")
    report = opt.explain(Q, Q, Q)
    assert report.kernels == ["pallas_gpu"], str(report)
    with pytest.raises(PlatformError) as info:
        opt(Q, Q, Q)
    text = str(info.value)
    assert "attention was optimized for platform='gpu'" in text
    assert "pallas_gpu" in text and "this cpu host" in text
    assert "platform='cpu'" in text and "interpret=True" in text


@requires_triton
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a CPU host")
def test_program_for_another_platform_with_interpret_runs():
    small = Q[:, :64, :, :16]
    opt = flashpass.optimize(attention, platform="gpu", interpret=True)
    assert opt.explain(small, small, small).kernels == ["pallas_gpu"]
    np.testing.assert_allclose(
        np.asarray(opt(small, small, small)), np.asarray(attention(small, small, small)), atol=1e-5
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a CPU host")
def test_cross_lowering_is_not_refused():
    """Built for TPU and lowered for TPU on a CPU host (jax.export): no error."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.flash_attention")
    from flashpass.testing import custom_call_targets

    opt = flashpass.optimize(attention, kernel="pallas_tpu", platform="tpu")
    assert "tpu_custom_call" in custom_call_targets(opt, Q, Q, Q, platform="tpu")


def test_bad_argument_names_the_function_and_path():
    opt = flashpass.optimize(attention)
    with pytest.raises(Exception) as info:  # JAX's own error type, as jax.jit raises it
        jax.jit(opt)(Q.tolist(), Q, Q)
    text = str(info.value)
    assert "flat_fn" not in text and "leaves[" not in text, text
    assert "the function attention at" in text, text
    assert "argument q[0][0][0][0]" in text, text


@requires_triton  # (pallas_gpu is the GPU kernel that cannot run here)
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a CPU host")
def test_program_for_another_platform_under_jit_says_so():
    """The first call under jax.jit: lowering for this host meets the guard first."""
    opt = flashpass.optimize(attention, platform="gpu")
    with pytest.raises(PlatformError, match="optimized for platform='gpu'"):
        jax.jit(opt)(Q, Q, Q)
    with pytest.raises(PlatformError, match="interpret=True"):
        jax.jit(jax.grad(lambda q: opt(q, Q, Q).sum()))(Q)
    # a program whose kernels run here gets no guard
    assert "platform_guard" not in str(jax.make_jaxpr(flashpass.optimize(attention))(Q, Q, Q))
