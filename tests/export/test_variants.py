"""Attention programs exported with jax.export, loaded, rewritten, serialized and
called again: same values forward and backward, no T×S array left."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from txs import txs_shapes
from variants import NEGATIVES, VARIANTS

import flashpass.export as fx
from flashpass.kernels.blockwise import BlockwiseKernel

# Small tiles, so a T×S array in the compiled program can only be a missed site.
KERNEL = BlockwiseKernel(block_q=64, block_k=64)


def _export(variant):
    exp = jax.export.export(jax.jit(variant.fn))(*variant.structs())
    return fx.load(exp.serialize())


def _round_trip(exp):
    return jax.export.deserialize(exp.serialize(vjp_order=1))


def _loss(call):
    def loss(*args):
        return jnp.sum(call(*args).astype(jnp.float32) ** 2)

    return loss


def _float_args(variant):
    return tuple(i for i, (_, d) in enumerate(variant.shapes) if jnp.issubdtype(d, jnp.floating))


#: The round trips run by default (the other variants' spellings are each the
#: matcher's, tested in tests/test_matching.py; the slow set runs them here too).
QUICK_ROUND_TRIPS = {"plain", "causal", "padding", "bias", "gqa", "cross", "bf16"}


@pytest.mark.parametrize(
    "variant",
    [
        v if v.name in QUICK_ROUND_TRIPS else pytest.param(v, marks=pytest.mark.slow)
        for v in VARIANTS
    ],
    ids=lambda v: v.name,
)
def test_rewrite_round_trip(variant):
    exp = _export(variant)
    report = fx.explain(exp, kernel=KERNEL)
    assert report.route == "lift", str(report)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    new = _round_trip(fx.rewrite(exp, kernel=KERNEL))
    assert new.platforms == exp.platforms
    assert new.in_avals == exp.in_avals and new.out_avals == exp.out_avals

    args = variant.args()
    want = variant.fn(*args)
    got = jax.jit(new.call)(*args)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=variant.tol, rtol=0
    )

    argnums = _float_args(variant)
    grad_new = jax.jit(jax.grad(_loss(new.call), argnums=argnums))
    grad_old = jax.grad(_loss(variant.fn), argnums=argnums)
    for g, w in zip(grad_new(*args), grad_old(*args), strict=True):
        scale = max(1.0, float(np.abs(np.asarray(w, np.float32)).max()))
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), atol=variant.tol * scale
        )

    if not variant.dense_input:
        forward = jax.jit(new.call).lower(*args).compile().as_text()
        backward = grad_new.lower(*args).compile().as_text()
        assert not txs_shapes(forward, variant.t, variant.s)
        assert not txs_shapes(backward, variant.t, variant.s)


def test_the_original_does_hold_a_txs_array():
    """The shape check can fail: the original program's gradient has T×S arrays."""
    variant = VARIANTS[1]
    exp = _round_trip(jax.export.export(jax.jit(variant.fn))(*variant.structs()))
    args = variant.args()
    grad = jax.jit(jax.grad(_loss(exp.call), argnums=(0, 1, 2)))
    assert txs_shapes(grad.lower(*args).compile().as_text(), variant.t, variant.s)


@pytest.mark.parametrize("variant", NEGATIVES, ids=lambda v: v.name)
def test_negative_programs_are_kept(variant):
    exp = _export(variant)
    report = fx.explain(exp, kernel=KERNEL)
    assert report.route == "lift" and not report.rewrites, str(report)
    new = fx.rewrite(exp, kernel=KERNEL)
    args = variant.args()
    np.testing.assert_allclose(jax.jit(new.call)(*args), variant.fn(*args), atol=2e-5)
