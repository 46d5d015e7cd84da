"""Optimized functions under ``jax.jit`` with `NamedSharding` inputs (8 CPU devices).

Each case compiles one program (output + gradients) for the optimized
function and for the original, both on the sharded inputs, and one for the
original on unsharded inputs: numerics must match the unsharded original,
output/gradient shardings the sharded original's, and the optimized program
must not add a collective (no all-gather/all-to-all/collective-permute of
q/k/v or along a sequence axis).

The Pallas TPU kernel runs in interpret mode on 4-device meshes with one
batch element and head per device: the TPU interpreter synchronises all
devices with a barrier per kernel and, on 8 CPU devices, the backward of a
kernel with a grid of more than one block per device hangs (a test-harness
limit, not a property of the rewrite).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharded_testing import P, assert_close, assert_like_original, mesh, normal, put, run, unsharded

import flashpass
from flashpass.kernels import AttentionSpec, Scale
from flashpass.kernels.blockwise import BlockwiseKernel, head_loop_pays

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")


def mha(q, k, v):
    """Multi-head attention, ``[B, T, H, D]`` layout."""
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def gqa_masked(q, k, v, mask):
    """Grouped-query attention with a padding mask and causal masking."""
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None, None, :], is_causal=True, implementation="xla"
    )


def biased(q, k, v, bias):
    """``[B, H, T, D]`` layout with a learned ``[1, H, T, S]`` bias."""
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25 + bias
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


#: name -> (mesh shape, axis names, q/k/v spec, q/k/v shape [B, T, H, D])
MESHES = {
    "data_parallel": ((8,), ("data",), P("data"), (8, 64, 2, 16)),
    "head_parallel": ((8,), ("model",), P(None, None, "model"), (2, 64, 8, 16)),
    "2d": ((2, 4), ("data", "model"), P("data", None, "model"), (2, 64, 4, 16)),
}


def _check(fn, opt, m, args, argnums=(0, 1, 2), kernel="blockwise"):
    with jax.set_mesh(m):
        report = opt.explain(*args)
        assert report.kernels == [kernel], str(report)
        rewritten = str(opt.rewritten_jaxpr(*args))
        assert "shard_map" in rewritten and f"flashpass_{kernel}" in rewritten
        got = run(opt, args, argnums)
        orig = run(fn, args, argnums)
    assert_like_original(got, orig, run(fn, unsharded(args), argnums))
    return got


@pytest.mark.parametrize("name", sorted(MESHES))
def test_blockwise(name):
    shape, names, spec, qshape = MESHES[name]
    m = mesh(shape, names)
    args = [put(m, spec, normal(i, qshape)) for i in range(3)]
    _check(mha, flashpass.optimize(mha, kernel="blockwise"), m, args)


def test_blockwise_gqa_padding_mask_2d():
    """Key/value heads sharded (query groups follow), a boolean mask sharded on batch."""
    m = mesh((2, 4), ("data", "model"))
    spec = P("data", None, "model")
    q = put(m, spec, normal(0, (2, 64, 8, 16)))
    k, v = (put(m, spec, normal(i, (2, 64, 4, 16))) for i in (1, 2))
    mask = put(m, P("data"), np.arange(64)[None, :] < np.array([[64], [40]]))
    _check(gqa_masked, flashpass.optimize(gqa_masked, kernel="blockwise"), m, [q, k, v, mask])


def test_blockwise_replicated_bias_head_parallel():
    """A bias replicated across devices is sliced to each device's heads (locally)."""
    m = mesh((8,), ("model",))
    spec = P(None, "model")
    args = [put(m, spec, normal(i, (2, 8, 64, 16))) for i in range(3)]
    args.append(put(m, P(), normal(3, (1, 8, 64, 64))))
    _check(biased, flashpass.optimize(biased, kernel="blockwise"), m, args, argnums=(0, 1, 2, 3))


def test_pallas_tpu_interpret_2d():
    m = mesh((2, 2), ("data", "model"))
    spec = P("data", None, "model")
    args = [put(m, spec, normal(i, (2, 128, 2, 32))) for i in range(3)]
    opt = flashpass.optimize(mha, kernel="pallas_tpu", interpret=True)
    got = _check(mha, opt, m, args, kernel="pallas_tpu")
    assert got.out.sharding.spec == P("data", None, "model", None)


def test_query_sharded_site_runs_per_query_shard():
    """Queries sharded along the sequence (keys/values replicated): each device
    runs its query rows against every key, a Pallas kernel included
    (tests/sharding/multidevice/test_query_shards.py has the mask cases)."""
    m = mesh((4,), ("seq",))
    q = put(m, P(None, "seq"), normal(0, (2, 128, 2, 32)))
    k, v = (put(m, P(), normal(i, (2, 128, 2, 32))) for i in (1, 2))
    opt = flashpass.optimize(mha, kernel="pallas_tpu", interpret=True)
    with jax.set_mesh(m):
        assert opt.explain(q, k, v).kernels == ["pallas_tpu"]
        assert "shard_map" in str(opt.rewritten_jaxpr(q, k, v))
        got, orig = run(opt, [q, k, v]), run(mha, [q, k, v])
    assert_like_original(got, orig, run(mha, unsharded([q, k, v])))


def test_auto_axes_blockwise_is_partitioned_by_xla():
    """Auto axes: shardings are not in the types; XLA partitions plain-JAX kernels."""
    m = mesh((8,), ("data",), explicit=False)
    args = [put(m, P("data"), normal(i, (8, 64, 2, 16))) for i in range(3)]
    opt = flashpass.optimize(mha, kernel="blockwise")
    assert opt.explain(*args).kernels == ["blockwise"]
    assert "shard_map" not in str(opt.rewritten_jaxpr(*args))
    assert_like_original(run(opt, args), run(mha, args), run(mha, unsharded(args)))


def test_auto_axes_blockwise_keeps_the_batched_loops():
    """With several devices the blockwise default never loops over heads: under
    Auto axes XLA would all-gather head-sharded operands to slice them."""
    f32 = np.float32
    spec = AttentionSpec(2, 8, 8, 1024, 1024, 64, 64, f32, f32, f32, f32, f32, f32, (Scale(0.125),))
    assert head_loop_pays(spec)  # one device would take the head loop
    assert not BlockwiseKernel().uses_head_loop(spec)
    m = mesh((2, 4), ("data", "model"), explicit=False)
    args = [put(m, P("data", "model"), normal(i, spec.q_shape)) for i in range(3)]
    got = run(lambda q, k, v: BlockwiseKernel().apply(spec, q, k, v), args)
    assert not got.collectives, dict(got.collectives)
    # What the rule avoids: the forced head loop all-gathers.
    forced = run(lambda q, k, v: BlockwiseKernel(head_loop=True).apply(spec, q, k, v), args)
    assert any(kind == "all-gather" for kind, *_ in forced.collectives)


def test_auto_axes_pallas_falls_back():
    m = mesh((4,), ("data",), explicit=False)
    args = [put(m, P("data"), normal(i, (4, 128, 2, 32))) for i in range(3)]
    opt = flashpass.optimize(mha, kernel="pallas_tpu", interpret=True)
    report = opt.explain(*args)
    assert report.kernels == [], str(report)
    assert "mesh with Auto axes (data=4)" in report.fallbacks[0].reason
    assert_close(jax.jit(opt)(*args), mha(*unsharded(args)))


def gemma_head_bias(q, k, v, bias):
    """DeepMind gemma's GQA scores regrouped to ``[B, T, Hkv*G, S]`` with a
    per-head bias along that merged axis (split back into its roles when read)."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    s = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, kv, n // kv, h) * 0.25, k)
    s = s.reshape(b, t, n, k.shape[1]) + bias
    p = jax.nn.softmax(s, axis=-1).reshape(b, t, kv, n // kv, k.shape[1])
    return jnp.einsum("BTKGS,BSKH->BTKGH", p, v).reshape(b, t, n, h)


def test_merged_head_bias_data_parallel():
    """Batch-sharded: the merged-axis bias is read whole on every device."""
    m = mesh((8,), ("data",))
    q = put(m, P("data"), normal(0, (8, 32, 4, 16)))
    k, v = (put(m, P("data"), normal(i, (8, 32, 2, 16))) for i in (1, 2))
    bias = put(m, P(), normal(3, (1, 1, 4, 32)))
    opt = flashpass.optimize(gemma_head_bias, kernel="blockwise")
    _check(gemma_head_bias, opt, m, [q, k, v, bias], argnums=(0, 1, 2, 3))


def test_merged_head_bias_with_sharded_heads_is_kept():
    """Heads sharded: the merged axis would have to be split across devices; kept."""
    m = mesh((2,), ("model",))
    q = put(m, P(None, None, "model"), normal(0, (2, 32, 4, 16)))
    k, v = (put(m, P(None, None, "model"), normal(i, (2, 32, 2, 16))) for i in (1, 2))
    bias = put(m, P(), normal(3, (1, 1, 4, 32)))
    opt = flashpass.optimize(gemma_head_bias, kernel="blockwise")
    with jax.set_mesh(m):
        report = opt.explain(q, k, v, bias)
        assert not report.rewrites, str(report)
        assert "merged from several head axes" in report.fallbacks[0].reason, str(report)
        got = run(opt, [q, k, v, bias], (0, 1, 2, 3))
    want = run(gemma_head_bias, unsharded([q, k, v, bias]), (0, 1, 2, 3))
    assert_close(got.out, want.out)


def split_terms(q, k, v, rel_h):
    """Decomposed relative positions: a term added while the query and key
    axes are split into 8 x 8 grids (patterns/factored.py)."""
    b, h, t, _ = q.shape
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25
    spec = jax.typeof(s).sharding.spec  # (an Explicit mesh: the reshape says it)
    s = jax.lax.reshape(s, (b, h, 8, 8, 8, 8), out_sharding=spec) + rel_h[..., None]
    s = jax.lax.reshape(s, (b, h, t, t), out_sharding=spec)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


def test_split_terms_with_sharded_operands_are_kept():
    """The bias is built from its term whole (an `Unsplit` extra), not per
    shard: with batch-sharded operands the site is kept, and says why."""
    got, want = _kept_batch_sharded(
        split_terms, (8, 2, 64, 16), (8, 2, 8, 8, 8), "split into factors"
    )
    for a, b in zip(got.grads, want.grads, strict=True):
        assert_close(a, b)


def _kept_batch_sharded(fn, qkv_shape, term_shape, reason):
    """``fn(q, k, v, term)`` on batch-sharded operands: kept, the reason
    naming ``reason``, its output the original's.  Returns both runs."""
    m = mesh((8,), ("data",))
    args = [put(m, P("data"), normal(i, qkv_shape)) for i in range(3)]
    args.append(put(m, P("data"), normal(3, term_shape)))
    opt = flashpass.optimize(fn, kernel="blockwise")
    with jax.set_mesh(m):
        report = opt.explain(*args)
        assert not report.rewrites, str(report)
        assert reason in report.fallbacks[0].reason, str(report)
        got = run(opt, args, (0, 1, 2, 3))
        want = run(fn, unsharded(args), (0, 1, 2, 3))
    assert_close(got.out, want.out)
    return got, want


def block_term(q, k, v, rel):
    """A term added to every score but the first query row and key column
    (MViTv2's class token; patterns/block_bias.py)."""
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s.at[:, :, 1:, 1:].add(rel), -1), v)


def test_block_term_with_sharded_operands_is_kept():
    """The bias is padded from its term whole (a `Padded` extra), not per
    shard: with batch-sharded operands the site is kept, and says why."""
    _kept_batch_sharded(
        block_term, (8, 2, 17, 16), (8, 2, 16, 16), "added to a block of the scores"
    )


def test_split_terms_on_auto_axes_compute_the_original():
    """On Auto axes the decision waits for XLA's shardings; at partitioning the
    site with an `Unsplit` extra runs on whole arrays (gathered), exactly."""
    m = mesh((8,), ("data",), explicit=False)

    def fn(q, k, v, rel_h):  # (Auto axes: the plain reshapes need no sharding)
        b, h, t, _ = q.shape
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25
        s = (s.reshape(b, h, 8, 8, 8, 8) + rel_h[..., None]).reshape(b, h, t, t)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)

    args = [put(m, P("data"), normal(i, (8, 2, 64, 16))) for i in range(3)]
    args.append(put(m, P("data"), normal(3, (8, 2, 8, 8, 8))))
    opt = flashpass.optimize(fn, kernel="blockwise")
    with jax.set_mesh(m):
        report = opt.explain(*args)
        assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
        got = run(opt, args, (0, 1, 2, 3))
        want = run(fn, unsharded(args), (0, 1, 2, 3))
    assert_close(got.out, want.out)
    for a, b in zip(got.grads, want.grads, strict=True):
        assert_close(a, b)
