"""Rows a ``-inf`` mask leaves with no key, in training steps.

Such a row is NaN in the original, whatever the spelling.  Its gradient is
not: ``where(keep, s, -inf)`` drops the NaN score cotangent at every excluded
key, so q and k get none of it, while the additive ``s + where(keep, 0,
-inf)`` (PyTorch's boolean ``scaled_dot_product_attention`` mask as torchax
lowers it; ModernBERT's sliding-window layers with padding) passes it on: q's
row and every key of the example get NaN gradients.  Each case makes the
first call under ``jax.jit`` and checks the forward and the gradients equal
the original's, non-finite entries included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass

B, H, T, D = 2, 2, 64, 8
PAD = 20  # example 1 right-padded: its last queries keep no key in the window
WINDOW = 8  # keys j with |i - j| <= WINDOW


def _keep(window: bool):
    qi, kj = np.arange(T)[:, None], np.arange(T)[None, :]
    keys = np.ones((B, 1, 1, T), bool)
    keys[1, ..., T - PAD :] = False
    keep = keys & (np.abs(qi - kj) <= WINDOW) if window else keys
    if not window:
        keep = keep.copy()
        keep[0] = False  # a fully padded example
    return jnp.asarray(np.broadcast_to(keep, (B, 1, T, T)))


def _softmax_stopped_max(s):
    """As torchax lowers ``torch.softmax``: the row max under stop_gradient."""
    m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    e = jnp.exp(s - m)
    return e / jnp.sum(e, -1, keepdims=True)


def _scores(q, k):
    return jnp.einsum("bhtd,bhsd->bhts", q, k) * (1 / np.sqrt(D))


def _additive(q, k, v, keep, softmax=_softmax_stopped_max):
    bias = jnp.where(~keep, -jnp.inf, 0.0).astype(q.dtype)
    return jnp.einsum("bhts,bhsd->bhtd", softmax(_scores(q, k) + bias), v)


def _selected(q, k, v, keep):
    s = jnp.where(keep, _scores(q, k), -jnp.inf)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


def _floored(q, k, v, keep):
    """fairseq's clamp: ``max(s + mask, finfo.min)``; the rows are uniform."""
    bias = jnp.where(~keep, -jnp.inf, 0.0)
    s = jnp.maximum(_scores(q, k) + bias, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


CASES = {
    "additive_window_and_keys": (lambda q, k, v: _additive(q, k, v, _keep(True))),
    "additive_nn_softmax": (
        lambda q, k, v: _additive(q, k, v, _keep(True), lambda s: jax.nn.softmax(s, -1))
    ),
    "additive_fully_padded_example": (lambda q, k, v: _additive(q, k, v, _keep(False))),
    "selected_window_and_keys": (lambda q, k, v: _selected(q, k, v, _keep(True))),
    "floored_window_and_keys": (lambda q, k, v: _floored(q, k, v, _keep(True))),
}


def _assert_same(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(e))
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
        ok = np.isfinite(e)
        scale = max(float(np.max(np.abs(e[ok]), initial=0.0)), 1e-6)
        assert float(np.max(np.abs(a[ok] - e[ok]), initial=0.0)) <= 1e-5 * scale


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_step_equals_the_original_in_empty_rows(name):
    attention = CASES[name]
    rng = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(rng.normal(size=(B, H, T, D)), jnp.float32) for _ in range(4))

    def step(q, k, v):
        def loss(q, k, v):
            out = attention(q, k, v)
            return jnp.sum(out * w), out  # the cotangent w is finite everywhere

        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    opt = flashpass.optimize(step, kernel="blockwise")
    got = jax.jit(opt)(q, k, v)  # the first call, under jit
    want = jax.jit(step)(q, k, v)
    report = opt.reports[-1]
    assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)
    _assert_same(got, want)
    # The original has non-finite rows here (not floored), so the case tests them.
    (_, out), _ = want
    assert name.startswith("floored") or not np.isfinite(np.asarray(out)).all()
