"""The common attention mistakes get the explanation that names them.

Each function below is attention with one typical error.  The site must be
kept as written and the reason must say what is wrong *in the user's terms*
(the reading of the score product that keeps their q and k) and what to
change; no text about another reading (autodiff's dV, ``jax.checkpoint``).
The first call is under ``jax.jit``, as users call it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass

# q and k of equal shapes: both readings of Q·Kᵀ are possible.
SHAPE = (2, 4, 16, 8)  # [batch, heads, seq, head_dim]


def _args():
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(k, SHAPE) for k in keys)


def _reason(fn, *extra) -> str:
    opt = flashpass.optimize(fn, kernel="blockwise")
    args = (*_args(), *extra)
    out = jax.jit(opt)(*args)  # the first call, under jit
    np.testing.assert_allclose(
        np.asarray(jax.tree.leaves(out)[0]),
        np.asarray(jax.tree.leaves(fn(*args))[0]),
        rtol=1e-5,
        atol=1e-6,
    )
    (report,) = opt.reports
    assert not report.rewrites, str(report)
    (fallback,) = report.fallbacks
    return fallback.reason


def _scores(q, k):
    return jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1])


@pytest.mark.parametrize("spelling", ["einsum", "matmul"])
def test_softmax_over_the_query_axis(spelling):
    def fn(q, k, v):
        if spelling == "einsum":
            p = jax.nn.softmax(_scores(q, k), axis=-2)
            return jnp.einsum("bhqk,bhkd->bhqd", p, v)
        return jax.nn.softmax(q @ k.swapaxes(-1, -2), axis=-2) @ v

    reason = _reason(fn)
    assert reason.startswith("softmax is over the query axis, not the key axis"), reason
    assert "normalise over the key axis" in reason and "(axis=-1)" in reason, reason
    assert "dV" not in reason and "checkpoint" not in reason, reason


def test_mask_after_the_softmax():
    def fn(q, k, v):
        p = jax.nn.softmax(_scores(q, k), axis=-1)
        p = jnp.where(jnp.tril(jnp.ones((SHAPE[2], SHAPE[2]), bool)), p, 0.0)
        return jnp.einsum("bhqk,bhkd->bhqd", p, v)

    reason = _reason(fn)
    assert reason.startswith("the probabilities are masked by a mask that did not mask the scores")
    assert "mask the scores before the softmax instead" in reason, reason


def test_weights_returned():
    def fn(q, k, v):
        p = jax.nn.softmax(_scores(q, k), axis=-1)
        return jnp.einsum("bhqk,bhkd->bhqd", p, v), p

    reason = _reason(fn)
    assert "is returned by the function" in reason, reason
    assert "do not return or reuse the attention weights" in reason, reason


def test_scale_on_the_probabilities_along_keys():
    """A per-key weight multiplies P (it belongs on v, or in the scores)."""

    def fn(q, k, v, w):
        p = jax.nn.softmax(_scores(q, k), axis=-1) * w
        return jnp.einsum("bhqk,bhkd->bhqd", p, v)

    reason = _reason(fn, jnp.linspace(0.5, 1.5, SHAPE[2]))
    assert reason.startswith("the probabilities are scaled by a tensor that varies along the key")
    assert "scale v by it instead" in reason, reason


def test_a_real_dv_product_keeps_its_own_explanation():
    """The key read from the softmax axis stays when it is the second operand:
    a product contracting the query axis of P (autodiff's dV shape) is still
    explained as such."""

    def fn(q, k, v):
        p = jax.nn.softmax(_scores(q, k), axis=-1)
        return jnp.einsum("bhqk,bhqd->bhkd", p, v)

    reason = _reason(fn)
    assert reason.startswith("P·V contracts the query axis"), reason
