"""A ("cpu", "tpu") artifact: each platform gets its own kernel in one artifact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from variants import causal

import flashpass.export as fx

SHAPE = (1, 256, 2, 128)
KERNELS = ["splash", "blockwise"]  # splash where it lowers (TPU), else blockwise


@pytest.fixture(scope="module")
def rewritten():
    x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    exp = jax.export.export(jax.jit(causal), platforms=("cpu", "tpu"))(x, x, x)
    new, report = fx.rewrite_and_explain(exp, backward="lifted", kernel=KERNELS)
    return exp, new, report


def _targets(text: str) -> set[str]:
    import re

    return set(re.findall(r"stablehlo\.custom_call @(\w+)", text))


def test_each_platform_gets_its_kernel(rewritten):
    exp, new, report = rewritten
    assert report.route == "lift"
    assert report.by_platform["tpu"].kernels == ["splash"], str(report)
    assert report.by_platform["cpu"].kernels == ["blockwise"], str(report)
    assert new.platforms == ("cpu", "tpu")
    assert "tpu_custom_call" in _targets(new.mlir_module())
    assert "tpu_custom_call" not in _targets(exp.mlir_module())


def test_runs_here_and_differentiates(rewritten):
    _, new, _ = rewritten
    new = jax.export.deserialize(new.serialize(vjp_order=1))
    assert new.platforms == ("cpu", "tpu")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(SHAPE), jnp.float32) for _ in range(3))
    np.testing.assert_allclose(jax.jit(new.call)(q, k, v), causal(q, k, v), atol=2e-5)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v) ** 2)

    got = jax.jit(jax.grad(loss(new.call), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(causal), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)
    # The backward that ships with the artifact has TPU's kernel backward too.
    assert "tpu_custom_call" in _targets(new.vjp().mlir_module())
