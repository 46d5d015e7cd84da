"""``stablehlo.convolution`` is lifted as ``lax.conv_general_dilated`` (a ViT's
patch embedding, a speech model's feature encoder): every dimension number,
stride, padding, dilation and group count read from the op, so the values are
the artifact's and the lifted program has a gradient (an island has none)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import flashpass.export as fx
from flashpass.kernels.blockwise import BlockwiseKernel

KERNEL = BlockwiseKernel(block_q=16, block_k=16)

CASES = {
    # name: (lhs shape, rhs shape, conv keyword arguments)
    "patch_nhwc": ((2, 16, 16, 3), (4, 4, 3, 8), dict(
        window_strides=(4, 4), padding="VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "nchw_padded_dilated": ((2, 3, 9, 9), (8, 3, 3, 3), dict(
        window_strides=(2, 1), padding=[(1, 0), (0, 2)], rhs_dilation=(1, 2),
        dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    "lhs_dilated_1d": ((2, 10, 4), (3, 4, 6), dict(
        window_strides=(1,), padding=[(2, 2)], lhs_dilation=(2,),
        dimension_numbers=("NWC", "WIO", "NWC"))),
    "grouped_1d": ((2, 4, 12), (8, 2, 3), dict(
        window_strides=(2,), padding="SAME", feature_group_count=2,
        dimension_numbers=("NCW", "OIW", "NCW"))),
    "highest_precision": ((1, 8, 8, 2), (3, 3, 2, 4), dict(
        window_strides=(1, 1), padding="SAME", precision=lax.Precision.HIGHEST,
        dimension_numbers=("NHWC", "HWIO", "NHWC"))),
}  # fmt: skip


def _args(lhs_shape, rhs_shape):
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32),
        jnp.asarray(rng.standard_normal(rhs_shape) / 4, jnp.float32),
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_convolution_is_lifted_with_its_gradient(name):
    lhs_shape, rhs_shape, kw = CASES[name]

    def fn(x, w):
        return jnp.tanh(lax.conv_general_dilated(x, w, **kw))

    args = _args(lhs_shape, rhs_shape)
    exp = jax.export.export(jax.jit(fn))(*args)
    new, report = fx.rewrite_and_explain(exp)
    assert not report.islands, str(report)
    np.testing.assert_allclose(np.asarray(new.call(*args)), np.asarray(fn(*args)), atol=1e-6)

    def loss(call):
        return lambda x, w: jnp.sum(call(x, w) ** 2)

    got = jax.jit(jax.grad(loss(new.call), argnums=(0, 1)))(*args)
    want = jax.grad(loss(fn), argnums=(0, 1))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


def test_a_vit_style_patch_embedding_then_attention_is_rewritten_with_its_gradient():
    def vit(x, w):
        p = lax.conv_general_dilated(
            x, w, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        t = p.reshape(p.shape[0], -1, 2, 4)  # [B, T, H, D]
        s = jnp.einsum("bqhd,bkhd->bhqk", t, t) * 0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), t)

    args = _args((2, 32, 32, 3), (4, 4, 3, 8))
    exp = jax.export.export(jax.jit(vit))(*args)
    want = jax.grad(lambda w: jnp.sum(vit(args[0], w) ** 2))(args[1])
    for route in ("lift", "splice"):
        new, report = fx.rewrite_and_explain(exp, route=route, kernel=KERNEL)
        assert len(report.rewrites) == 1 and not report.islands, str(report)
        call = new.call
        got = jax.grad(lambda w, call=call: jnp.sum(call(args[0], w) ** 2))(args[1])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
