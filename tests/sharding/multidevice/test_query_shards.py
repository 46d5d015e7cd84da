"""Queries sequence-sharded, keys whole on every device (8 CPU devices).

Each device runs its own query rows against every key (`QueryShards`): no
collective is added, and the numerics and gradients (k and v's summed over the
query shards) equal the unsharded original's.  Shard ``i``'s position masks
are the site's at its rows' offset; masks that depend on the device beyond
that offset keep the site as written, saying why.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharded_testing import P, assert_close, assert_like_original, mesh, normal, put, run, unsharded

import flashpass

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")


def decoder(q, k, v, lengths):
    """``[B, T, H, D]`` queries at the end of ``S`` keys (bottom-right causal),
    with per-example key lengths."""
    t, s = q.shape[1], k.shape[1]
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / 4.0
    keep = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)
    keep = keep & (jnp.arange(s) < lengths[:, None, None, None])
    scores = jnp.where(keep, scores, -1e9)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)


def packed(q, k, v, q_ids, kv_ids):
    """Packed documents: a key is seen where its segment id is the query's."""
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k) / 4.0
    same = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    scores = jnp.where(same, scores, -1e9)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(scores, axis=-1), v)


def chunked(q, k, v):
    """Chunked attention (blocks of 24 keys): its mask depends on the device."""
    t = q.shape[2]
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k) / 4.0
    same = (jnp.arange(t)[:, None] // 24) == (jnp.arange(t)[None, :] // 24)
    scores = jnp.where(same, scores, -1e9)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(scores, axis=-1), v)


def _rewritten(opt, args, calls):
    """Rewritten at trace time, in a ``shard_map`` holding ``calls`` kernel
    calls: one per shard (a switch on the shard's index) where the shards'
    specs differ, else one."""
    report = opt.explain(*args)
    assert report.kernels == ["blockwise"], str(report)
    assert report.rewrites[0].placement == "", report.rewrites[0]  # known at trace time
    text = str(opt.rewritten_jaxpr(*args))
    assert "shard_map" in text and text.count("name=flashpass_blockwise") == calls, text


def test_decoder_queries_sharded_keys_whole_2d():
    """Batch over ``data``, query rows over ``seq``; the causal edge moves with
    each shard's offset, so each runs its own spec (a switch on the index)."""
    m = mesh((2, 4), ("data", "seq"))
    q = put(m, P("data", "seq"), normal(0, (2, 64, 2, 16)))
    k, v = (put(m, P("data"), normal(i, (2, 128, 2, 16))) for i in (1, 2))
    lengths = put(m, P("data"), np.array([128, 100], np.int32))
    args = [q, k, v, lengths]
    opt = flashpass.optimize(decoder, kernel="blockwise")
    with jax.set_mesh(m):
        _rewritten(opt, args, calls=4)
        got, orig = run(opt, args), run(decoder, args)
    assert_like_original(got, orig, run(decoder, unsharded(args)))
    assert tuple(got.out.sharding.spec[:2]) == ("data", "seq")


def test_segment_ids_read_per_shard():
    """The query-side ids are sharded with the queries, the key-side ids whole:
    no op reads the rows' offset, so every shard runs one spec (no switch).
    One id array read at both positions would need two shardings: kept."""
    m = mesh((8,), ("seq",))
    ids = np.sort(np.random.default_rng(3).integers(0, 5, (2, 128)), axis=1).astype(np.int32)
    q = put(m, P(None, None, "seq"), normal(0, (2, 2, 128, 16)))
    k, v = (put(m, P(), normal(i, (2, 2, 128, 16))) for i in (1, 2))
    args = [q, k, v, put(m, P(None, "seq"), ids), put(m, P(), ids)]
    opt = flashpass.optimize(packed, kernel="blockwise")
    with jax.set_mesh(m):
        _rewritten(opt, args, calls=1)
        got, orig = run(opt, args), run(packed, args)
        one = flashpass.optimize(lambda q, k, v, ids: packed(q, k, v, ids, ids), kernel="blockwise")
        (kept,) = one.explain(*args[:3], args[4]).fallbacks
    assert_like_original(got, orig, run(packed, unsharded(args)))
    assert "segment ids at the query and at the key positions" in kept.reason, kept


def test_training_step_in_the_program():
    """A value_and_grad step optimized whole: the backward is the kernel's, per shard."""
    m = mesh((4,), ("seq",))
    q = put(m, P(None, "seq"), normal(0, (2, 64, 2, 16)))
    k, v = (put(m, P(), normal(i, (2, 96, 2, 16))) for i in (1, 2))
    lengths = put(m, P(), np.array([96, 70], np.int32))

    def step(q, k, v, lengths):
        return jax.value_and_grad(lambda *a: jnp.sum(decoder(*a, lengths) ** 2), argnums=(0, 1, 2))(
            q, k, v
        )

    opt = flashpass.optimize(step, kernel="blockwise")
    with jax.set_mesh(m):
        assert opt.explain(q, k, v, lengths).kernels == ["blockwise"]
        (value, grads), (want, wants) = jax.jit(opt)(q, k, v, lengths), step(q, k, v, lengths)
    assert_close(value, want)
    for g, w in zip(grads, wants, strict=True):
        assert_close(g, w)


def test_masks_that_depend_on_the_device_keep_the_site():
    m = mesh((4,), ("seq",))
    q = put(m, P(None, None, "seq"), normal(0, (1, 2, 96, 16)))
    k, v = (put(m, P(), normal(i, (1, 2, 96, 16))) for i in (1, 2))
    opt = flashpass.optimize(chunked, kernel="blockwise")
    with jax.set_mesh(m):
        report = opt.explain(q, k, v)
        assert report.kernels == [] and len(report.fallbacks) == 1, str(report)
        reason = report.fallbacks[0].reason
        assert reason.startswith("sequence-sharded queries over mesh axis seq (keys whole)"), reason
        assert "Chunk masks depend on the device's position" in reason, reason
        got, orig = run(opt, [q, k, v]), run(chunked, [q, k, v])
    assert_like_original(got, orig, run(chunked, unsharded([q, k, v])))
