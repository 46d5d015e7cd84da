"""The per-example mask kinds (ALiBi slopes, per-example prefix lengths,
positions from inputs) in a sequence-sharded site that runs as a ring, 8 CPU
devices: outputs and gradients (the slopes' too) equal the unsharded original.
ALiBi ``slope * (j - i)`` and positions run in the kernel's ring steps
(`ScoreOp.at_offset`); per-example prefix lengths in the ring's plain step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharded_testing import P, assert_close, mesh, normal, put, run, unsharded

import flashpass

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")

B, T, H, D = 2, 64, 2, 16


def _attend(q, k, v, keep, bias=None):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    if bias is not None:
        s = s + bias
    s = jnp.where(keep, s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _ij():
    return jnp.arange(T)[:, None], jnp.arange(T)[None, :]


def alibi(q, k, v, slopes):
    i, j = _ij()
    return _attend(q, k, v, j <= i, slopes[None, :, None, None] * (j - i).astype(jnp.float32))


def prefix_lengths(q, k, v, lengths):
    i, j = _ij()
    return _attend(q, k, v, (j <= i)[None, None] | (j[None, None] < lengths[:, None, None, None]))


def positions(q, k, v, pos):
    kv, qp = pos[:, None, :], pos[:, :, None]
    return _attend(q, k, v, ((kv > qp - 8) & (kv <= qp))[:, None])


KINDS = {
    "alibi": (alibi, np.array([0.5, -0.25], np.float32), P(None), (0, 1, 2, 3), "blockwise"),
    "prefix_lengths": (prefix_lengths, np.array([20, 0], np.int32), P(None), (0, 1, 2), "plain"),
    "positions": (
        positions,
        np.stack([np.arange(T), np.r_[np.arange(30), np.arange(T - 30)]]).astype(np.int32),
        P(None, "seq"),
        (0, 1, 2),
        "blockwise",
    ),
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_kind_runs_as_a_ring(name):
    fn, extra, extra_spec, argnums, steps = KINDS[name]
    m = mesh((8,), ("seq",))
    seq = P(None, "seq")
    args = [put(m, seq, normal(i, (B, T, H, D))) for i in range(3)]
    args.append(put(m, extra_spec, extra))

    def gathering(q, k, v, x):
        k, v = (jax.sharding.reshard(a, P()) for a in (k, v))
        if x.ndim == 2:
            x = jax.sharding.reshard(x, P())  # (self-attention: the keys' positions whole)
        return fn(q, k, v, x)

    opt = flashpass.optimize(gathering, kernel="blockwise")
    with jax.set_mesh(m):
        report = opt.explain(*args)
        got = run(opt, args, argnums)
    assert report.kernels == ["ring"] and not report.fallbacks, str(report)
    assert steps in report.rewrites[0].ring_steps, str(report)
    ref = run(fn, unsharded(args), argnums)
    assert_close(got.out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)
