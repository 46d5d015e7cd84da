"""Masks read through a transpose.

A transpose only moves axes, so a mask (or bias) the program transposes
before applying it is read from the array it transposed, axis for axis.
Keras' ``dot_product_attention`` with grouped heads does this: the combined
padding & causal mask (``min`` of int masks, cast to bool) is broadcast to
``[B, 1, 1, T, S]`` and transposed to ``[1, B, 1, T, S]`` before the 5-D
``where``; read through the transpose, its padding is an O(B·S) key mask and
its triangle a causal descriptor, never a ``[B, H, T, S]`` operand.  A
transpose that moves the key axis onto the queries is read as what it is
(a query mask), not as a key mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import flashpass
from flashpass.testing import assert_same_function

B, T, H, KV, D = 2, 32, 4, 2, 8
NEG = -2.381976325057654e38


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, KV, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, T, KV, D)), jnp.float32)
    return q, k, v


def _padding():
    return jnp.arange(T)[None, :] < jnp.asarray([T, 20])[:, None]


def _grouped(q, k, v, mask5):
    """5-D grouped attention: ``mask5`` is ``[1, B, 1, T, S]`` against scores
    ``[G, B, KV, T, S]`` (G query heads per kv head, first)."""
    qg = q.reshape(B, T, KV, H // KV, D)
    s = jnp.einsum("btkgd,bskd->gbkts", qg, k) / np.sqrt(D)
    s = jnp.where(mask5, s, NEG)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("gbkts,bskd->btkgd", p, v)
    return out.reshape(B, T, H, D)


def _keras_mask(padding):
    """keras-hub's merged mask: ``min(int(padding), int(causal))`` as bool,
    broadcast to ``[B, 1, 1, T, S]`` and transposed to ``[1, B, 1, T, S]``."""
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    merged = jnp.minimum(padding.astype(jnp.int32)[:, None, :], causal.astype(jnp.int32)[None])
    mask = merged[:, None].astype(bool)[:, :, None]  # [B, 1, 1, T, S]
    return jnp.transpose(mask, (2, 0, 1, 3, 4))


def _ops(report):
    return [(op["op"], op.get("shape")) for op in report.rewrites[0].spec["score_ops"]]


def test_transposed_merged_mask_is_a_key_mask_and_causal():
    def fn(q, k, v, padding):
        return _grouped(q, k, v, _keras_mask(padding))

    args = (*_qkv(), _padding())
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    ops = _ops(report)
    assert ("causal", None) in ops, ops
    masks = [shape for op, shape in ops if op == "mask"]
    assert masks == [[B, 1, 1, T]], ops  # the padding, O(B·S)
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


def test_transpose_onto_the_query_axis_is_not_a_key_mask():
    """The padding moved onto the queries masks rows, not keys: it must not
    be read as a ``[B, 1, 1, S]`` key mask (every kept row keeps every key)."""

    def fn(q, k, v, padding):
        rows = padding[:, None, None, None, :]  # [B, 1, 1, 1, T]
        mask5 = jnp.transpose(rows, (2, 0, 1, 4, 3)) | jnp.zeros((1, B, 1, T, T), bool)
        return _grouped(q, k, v, mask5)

    args = (*_qkv(1), _padding())
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    for r in report.rewrites:
        shapes = [op.get("shape") for op in r.spec["score_ops"] if op["op"] == "mask"]
        assert [B, 1, 1, T] not in shapes, str(report)
    np.testing.assert_allclose(
        np.asarray(opt(*args)), np.asarray(jax.jit(fn)(*args)), rtol=2e-5, atol=2e-5
    )
