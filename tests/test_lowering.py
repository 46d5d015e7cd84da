"""Lowering checks: read the StableHLO of optimized functions with the MLIR
Python bindings that ship in jaxlib."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from t_by_s import assert_no_t_by_s

import flashpass
from flashpass.testing import custom_call_targets, stablehlo_shapes

T = 1024


def causal_attention(q, k, v):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[2], k.shape[2]), bool)), s, -jnp.inf)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


def _args(t=T, d=64):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((1, 2, t, d)), jnp.float32) for _ in range(3)]


def test_blockwise_leaves_no_full_score_matrix():
    """No tensor of the lowered program, or of its gradient, could hold the
    T x T scores in any layout (tests/t_by_s.py); the original's do."""
    args = _args()
    control = stablehlo_shapes(causal_attention, *args)
    opt = flashpass.optimize(causal_attention, kernel="blockwise")
    assert len(opt.explain(*args).rewrites) == 1
    assert_no_t_by_s(stablehlo_shapes(opt, *args), T, T, control=control)
    grad = jax.grad(lambda q, k, v: opt(q, k, v).sum(), argnums=(0, 1, 2))
    assert_no_t_by_s(stablehlo_shapes(grad, *args), T, T, control=control)


def test_pallas_tpu_appears_as_its_custom_call():
    pytest.importorskip("jax.experimental.pallas.ops.tpu.flash_attention")
    args = _args(t=256, d=128)
    opt = flashpass.optimize(causal_attention, kernel="pallas_tpu", platform="tpu")
    report = opt.explain(*args)
    assert report.kernels == ["pallas_tpu"], str(report)
    targets = custom_call_targets(opt, *args, platform="tpu")
    assert "tpu_custom_call" in targets
    assert "tpu_custom_call" not in custom_call_targets(causal_attention, *args, platform="tpu")
