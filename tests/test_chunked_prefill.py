"""Chunked prefill: a chunk of queries appended to a KV cache at per-row
offsets, each query seeing the keys up to its own position.

The mask ``k_pos[None, None, :] <= q_pos[:, :, None]`` with ``q_pos =
start[:, None] + arange(T)`` is a `KvLengths` op whose lengths vary over the
queries too: the program's ``[B, T]`` positions, O(T), never a ``T x S``
mask.  Checked: the descriptor, outputs and gradients (rows that keep no key
included) with blockwise tiles smaller than the cache, the first call under
``jax.jit`` and in a training step, and the kernels that take per-row lengths
only (the decode path, cuDNN) declining it with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.kernels import CheckContext, get_kernel
from flashpass.kernels.blockwise import BlockwiseKernel
from flashpass.spec import AttentionSpec, ExtraSpec, KvLengths, Scale

B, H, T, S, D = 3, 2, 8, 40, 16
#: Row 0 starts the cache, row 1 continues at 17, row 2's first query sees no key.
START = np.array([0, 17, -1], np.int32)


def prefill(q, k, v, start):
    q_pos = start[:, None] + jnp.arange(q.shape[2])[None, :]
    keep = jnp.arange(k.shape[2])[None, None, :] <= q_pos[:, :, None]
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25
    s = jnp.where(keep[:, None], s, -1e9)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


def _args(seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, H, S, D)), jnp.float32) for _ in range(2))
    return q, k, v, jnp.asarray(START)


def _loss(fn):
    return lambda *a: jnp.sum(fn(*a) ** 2)


@pytest.mark.parametrize(
    "kernel", ["reference", BlockwiseKernel(block_q=4, block_k=16)], ids=["reference", "blockwise"]
)
def test_per_query_lengths_forward_and_gradient(kernel):
    args = _args()
    opt = flashpass.optimize(prefill, kernel=kernel)
    got = jax.jit(jax.value_and_grad(_loss(opt), argnums=(0, 1, 2)))(*args)
    (rewrite,) = opt.reports[-1].rewrites
    assert rewrite.mask == "kv_lengths", rewrite.spec
    (op,) = [o for o in rewrite.spec["score_ops"] if o["op"] == "kvlengths"]
    assert op["shape"] == [B, 1, T, 1] and op["shift"] == 1  # j <= pos: j < pos + 1
    assert all(e["shape"][3] == 1 for e in rewrite.spec["extras"])  # nothing T x S
    want = jax.value_and_grad(_loss(prefill), argnums=(0, 1, 2))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * float(jnp.abs(w).max()))
    # Row 2, query 0 keeps no key: as the original, uniform weights over the fill.
    out = opt(*args)
    np.testing.assert_allclose(out[2, :, 0], args[2][2].mean(axis=1), rtol=1e-5, atol=1e-6)


def test_training_step_with_chunked_prefill():
    q, k, v, start = _args(1)

    def step(q, k, v, start):
        return jax.value_and_grad(lambda *a: _loss(prefill)(*a, start), argnums=(0, 1, 2))(q, k, v)

    opt = flashpass.optimize(step, kernel="blockwise")
    got = jax.jit(opt)(q, k, v, start)
    assert [r.passes for r in opt.reports[-1].rewrites] == ["forward+backward"]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(step(q, k, v, start)), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * float(jnp.abs(w).max()))


def _spec():
    op = KvLengths(0, (B, 1, T, 1), -1e9, 1)
    return AttentionSpec(
        B, H, H, T, S, D, D, *(np.float32,) * 3, np.float32, np.float32, np.float32,
        score_ops=(Scale(0.25), op), extras=(ExtraSpec((B, 1, T, 1), np.int32),),
    )  # fmt: skip


def test_kernels_for_per_row_lengths_decline_per_query_lengths():
    spec = _spec()
    assert not BlockwiseKernel().uses_decode(spec)  # the flash path, per-tile masks
    from flashpass import compat

    with compat.assume_cudnn():
        reasons = get_kernel("cudnn").check(spec, CheckContext(platform="gpu", explicit=True))
    assert any("lengths" in r for r in reasons), reasons


def test_limits_varying_over_keys_stay_a_dense_mask():
    # A per-key limit is no length: kept as the boolean mask it is.
    def fn(q, k, v, limits):
        keep = jnp.arange(S)[None, None, :] <= limits[:, :, None] + jnp.arange(S)[None, None, :] % 3
        s = jnp.where(keep[:, None], jnp.einsum("bhtd,bhsd->bhts", q, k), -1e9)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)

    q, k, v, start = _args()
    limits = start[:, None] + jnp.arange(T)[None, :]
    opt = flashpass.optimize(fn, kernel="blockwise")
    (rewrite,) = opt.explain(q, k, v, limits).rewrites
    assert "kv_lengths" not in rewrite.mask, rewrite.spec
    np.testing.assert_allclose(opt(q, k, v, limits), fn(q, k, v, limits), rtol=2e-5, atol=1e-6)
