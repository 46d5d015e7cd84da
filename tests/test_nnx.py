"""Flax NNX steps: in-place updates of modules and optimizers are kept.

The step is written as Flax's tutorials write it (``nnx.Optimizer``,
``optimizer.update(model, grads)``) and wrapped both ways: the losses and
parameters must follow ``nnx.jit(step)``'s step after step, and the attention
site (forward and backward) must be rewritten.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")


class SelfAttention(nnx.Module):
    def __init__(self, d_model: int, heads: int, rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3 * self.heads, d // self.heads)
        q, k, v = jnp.split(qkv, 3, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, d))


def _make():
    model = SelfAttention(32, 4, nnx.Rngs(0))
    # SGD: Adam would blow the k bias's gradient (zero up to rounding) up to full steps.
    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


def step(model, optimizer, x, y):
    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _data():
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    return x, jnp.sin(x)


def _train(wrapped, steps=3):
    model, optimizer = _make()
    x, y = _data()
    losses = [float(wrapped(model, optimizer, x, y)) for _ in range(steps)]
    return losses, model, optimizer


@pytest.mark.parametrize("order", ["nnx.jit(optimize(step))", "optimize(nnx.jit(step))"])
def test_nnx_optimizer_step_trains_like_nnx_jit(order):
    opt = flashpass.optimize(step if order.startswith("nnx") else nnx.jit(step), kernel="blockwise")
    wrapped = nnx.jit(opt) if order.startswith("nnx") else opt

    want, ref_model, ref_opt = _train(nnx.jit(step))
    got, model, optimizer = _train(wrapped)

    assert want[0] > want[-1]  # the reference does train
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert int(optimizer.step[...]) == int(ref_opt.step[...]) == 3
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(ref_model, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    (report,) = opt.reports
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert report.rewrites[0].backward and report.rewrites[0].mask == "causal"
    # Both orders keep the report (docs/nnx.md): nnx.jit's wrapper carries them.
    x, y = _data()
    assert wrapped.explain(model, optimizer, x, y) is report
    assert len(wrapped.reports) == 1 and wrapped.reports[-1] is report
    assert list(wrapped.reports) == [report]


def test_nnx_explain_and_forward():
    """A module's forward: explain sees the site, the call returns the
    original's values, and a module passed twice is one node."""
    model, _ = _make()
    x, _ = _data()

    def forward(m, x, again):
        assert m is again  # the same object stays the same object
        return m(x)

    opt = flashpass.optimize(forward, kernel="blockwise")
    report = opt.explain(model, x, model)
    assert report.kernels == ["blockwise"], str(report)
    np.testing.assert_allclose(
        np.asarray(nnx.jit(opt)(model, x, model)), np.asarray(model(x)), rtol=1e-5, atol=1e-5
    )


def test_nnx_rng_state_advances():
    """State that is not a parameter (an ``nnx.Rngs`` counter) is written back too."""
    rngs = nnx.Rngs(dropout=0)

    def draw(rngs, x):
        return x + jax.random.uniform(rngs.dropout(), x.shape)

    opt = flashpass.optimize(draw)
    x = jnp.zeros(3)
    first, second = opt(rngs, x), opt(rngs, x)
    assert not np.allclose(np.asarray(first), np.asarray(second))
