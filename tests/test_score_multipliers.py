"""Score multipliers that are tensors: folded into q when constant along the keys.

``(q * t) @ kᵀ == t * (q @ kᵀ)`` holds for any ``t`` that does not vary along
the keys (nor the contracted axis): a learned per-head temperature (XCiT's
cross-covariance attention, Swin V2's scaled cosine attention, both ``[H, 1,
1]`` parameters), one per batch row, one per query.  Such a multiplier is read
as a scale of q (patterns/scale.py), its gradient included.  A multiplier that
varies along the keys is no scale of q, and one after a bias or mask would
scale the bias too: both keep the site, with the reason.

Every positive case: rewritten on its first call under ``jax.jit``, forward
and gradient (to the multiplier too) equal to the original's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from no_silent import assert_kept

import flashpass
from flashpass.testing import assert_same_function

B, H, T, S, D = 2, 3, 12, 16, 8
HKV, G = 3, 2


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _matmul4(x, y):
    """``torch.matmul`` on 4-D operands as PyTorch decomposes it."""
    b, h = x.shape[:2]
    out = jnp.matmul(x.reshape(b * h, *x.shape[2:]), y.reshape(b * h, *y.shape[2:]))
    return out.reshape(b, h, *out.shape[1:])


def _l2(x):
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def xca(q, k, v, temperature):
    # timm's XCA: unit-norm q and k, scores times a [H, 1, 1] temperature,
    # PyTorch's matmul decomposed as torchax runs it.
    s = _matmul4(_l2(q), jnp.swapaxes(_l2(k), -1, -2)) * temperature
    return _matmul4(jax.nn.softmax(s, axis=-1), v)


def cosine_attention(q, k, v, logit_scale, table):
    # Swin V2: cosine scores times exp(min(logit_scale, log 100)) per head,
    # then a learned relative-position bias (a parameter, not a mask).
    scale = jnp.exp(jnp.minimum(logit_scale, np.log(100.0)))
    s = jnp.einsum("bhtd,bhsd->bhts", _l2(q), _l2(k)) * scale
    s = s + 16 * jax.nn.sigmoid(table)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def per_batch_divisor(q, k, v, t):
    # One temperature per batch row, dividing the scores.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) / t[:, None, None, None]
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def per_query(q, k, v, w):
    # A factor per query (constant along the keys), before a causal mask.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * w[None, None, :, None]
    s = jnp.where(jnp.tril(jnp.ones((T, S), bool)), s, -1e30)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def grouped_query_scale(q, k, v, t):
    # GQA written with a group axis; the scale varies along the group only.
    s = jnp.einsum("bkgtd,bksd->bkgts", q, k) * t[None, None, :, None, None]
    return jnp.einsum("bkgts,bksd->bkgtd", jax.nn.softmax(s, axis=-1), v)


def _bhtd(rng, *extra):
    q, k, v = _normal(rng, B, H, T, D), _normal(rng, B, H, S, D), _normal(rng, B, H, S, D)
    return (q, k, v, *extra)


POSITIVE = {
    "xca": (xca, lambda rng: _bhtd(rng, 1.0 + jnp.abs(_normal(rng, H, 1, 1)))),
    "cosine_attention": (
        cosine_attention,
        lambda rng: _bhtd(rng, _normal(rng, H, 1, 1), _normal(rng, H, T, S)),
    ),
    "per_batch_divisor": (per_batch_divisor, lambda rng: _bhtd(rng, 2.0 + _normal(rng, B) ** 2)),
    "per_query": (per_query, lambda rng: _bhtd(rng, _normal(rng, T))),
    "grouped_query_scale": (
        grouped_query_scale,
        lambda rng: (
            _normal(rng, B, HKV, G, T, D),
            _normal(rng, B, HKV, S, D),
            _normal(rng, B, HKV, S, D),
            _normal(rng, G),
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_rewritten_on_the_first_call_under_jit(name, rng):
    fn, make = POSITIVE[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    got = jax.jit(opt)(*args)  # the first call
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    np.testing.assert_allclose(got, fn(*args), rtol=2e-5, atol=2e-5)
    # The gradient to the multiplier (the last argument but the bias table) too.
    assert_same_function(fn, flashpass.optimize(fn, kernel="blockwise"), *args)


def test_the_multiplier_is_no_kernel_operand(rng):
    # Folded into q: the spec has no bias for it, and the rewritten program
    # hands the kernel no array of the scores' size.
    args = POSITIVE["xca"][1](rng)
    (rewrite,) = flashpass.optimize(xca, kernel="reference").explain(*args).rewrites
    assert [op["op"] for op in rewrite.spec["score_ops"]] == []
    assert rewrite.spec["extras"] == []


def test_under_a_training_step(rng):
    # value_and_grad of a loss through the per-head temperature: the step's
    # gradient to every input equals JAX's.
    args = POSITIVE["xca"][1](rng)

    def loss(q, k, v, t):
        return jnp.sum(xca(q, k, v, t) ** 2)

    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    opt = flashpass.optimize(step, kernel="blockwise")
    (value, grads) = jax.jit(opt)(*args)
    want_value, want = step(*args)
    assert opt.reports[-1].rewrites and not opt.reports[-1].fallbacks, str(opt.reports[-1])
    np.testing.assert_allclose(value, want_value, rtol=2e-5)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- kept


def per_key(q, k, v, w):
    # A factor per key: each score column its own scale, no scale of q.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * w[None, None, None, :]
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def elementwise(q, k, v, w):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * w
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def head_scale_after_bias(q, k, v, t, bias):
    # Folding t into q would leave the bias unscaled.
    s = (jnp.einsum("bhtd,bhsd->bhts", q, k) + bias) * t
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


NEGATIVE = {
    "per_key": (per_key, lambda rng: _bhtd(rng, _normal(rng, S)), "varies along the keys"),
    "elementwise": (
        elementwise,
        lambda rng: _bhtd(rng, _normal(rng, 1, H, T, S)),
        "varies along the keys",
    ),
    "head_scale_after_bias": (
        head_scale_after_bias,
        lambda rng: _bhtd(rng, _normal(rng, H, 1, 1), _normal(rng, B, 1, T, S)),
        "after a bias or mask",
    ),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_kept_with_the_reason(name, rng):
    fn, make, reason = NEGATIVE[name]
    args = make(rng)
    assert_kept(fn, args, reason)
