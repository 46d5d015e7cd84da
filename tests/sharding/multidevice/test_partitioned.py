"""Sites placed at partitioning time (8 CPU devices): Auto mesh axes, inputs
``device_put`` with a `NamedSharding`, no annotation in the function, called
as ``jax.jit(flashpass.optimize(f))``.

The shardings are not in the types, so the pass emits a call XLA's
partitioner places (`flashpass.placement.deferred`).  Each case compiles one
program (output and gradients), checks its collectives in the compiled HLO
and its numerics against the unsharded original, and reads the decision the
partitioner took (`flashpass.placement.decisions`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharded_testing import P, assert_close, mesh, normal, put, run, unsharded

import flashpass
from flashpass import placement
from flashpass.pipeline import PLACED_AT_PARTITIONING

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")

SHAPE = (2, 128, 2, 16)  # [B, T, H, D]


def full(q, k, v):
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def causal(q, k, v):
    t = q.shape[1]
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def _moved(got, kind: str, at_least: int) -> dict:
    """Collectives of ``kind`` moving arrays of ``at_least`` elements or more."""
    return {c: n for c, n in got.collectives.items() if c[0] == kind and c[2] >= at_least}


def _decided(fn_name: str) -> list:
    return [d for d in placement.decisions() if d.location and fn_name in d.location]


def _check(fn, args, how: str, argnums=(0, 1, 2)):
    """The optimized program, checked against the unsharded original; the
    partitioner's decisions (forward and backward) start with ``how``."""
    placement.clear_decisions()
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert [r.placement for r in report.rewrites] == [PLACED_AT_PARTITIONING], str(report)
    assert PLACED_AT_PARTITIONING in str(report)
    got = run(opt, args, argnums)
    want = run(fn, unsharded(args), argnums)
    assert_close(got.out, want.out)
    for g, w in zip(got.grads, want.grads, strict=True):
        assert_close(g, w)
    decided = {(d.pass_, d.how) for d in placement.decisions()}
    assert {p for p, _ in decided} == {"forward", "backward"}, decided
    assert all(h.startswith(how) for _, h in decided), decided
    return got


@pytest.mark.parametrize("fn", [causal, full], ids=["causal", "full"])
def test_sequence_sharded_runs_as_a_ring(fn):
    """The issue's program: q/k/v ``device_put`` along the sequence, nothing
    annotated.  Before: a local kernel, K/V all-gathered to full length."""
    m = mesh((8,), ("seq",), explicit=False)
    args = [put(m, P(None, "seq"), normal(i, SHAPE)) for i in range(3)]
    got = _check(fn, args, "ring over seq")
    assert _moved(got, "collective-permute", 1), dict(got.collectives)
    block = int(np.prod(SHAPE)) // 8
    # No K/V (or anything q/k/v-sized) gathered beyond one device's block.
    assert not _moved(got, "all-gather", block + 1), dict(got.collectives)
    assert not _moved(got, "all-to-all", 1), dict(got.collectives)
    assert got.out.sharding.spec[1] == "seq", got.out.sharding
    if fn is causal:  # balanced: every step the same work on every device
        assert all("zig-zag" in d.how for d in placement.decisions())
    # The original, for contrast: XLA gathers K/V to full length.
    assert _moved(run(fn, args), "all-gather", int(np.prod(SHAPE)))


def test_batch_sharded_runs_per_shard_without_collectives():
    m = mesh((8,), ("data",), explicit=False)
    args = [put(m, P("data"), normal(i, (8, 64, 2, 16))) for i in range(3)]
    got = _check(causal, args, "per shard")
    assert not got.collectives, dict(got.collectives)
    assert got.out.sharding.spec[0] == "data"
    # What `partitioning` shows for concrete arguments (the forward only).
    [decision] = flashpass.optimize(causal, kernel="blockwise").partitioning(*args)
    assert (decision.pass_, decision.how, decision.mesh) == ("forward", "per shard", "data=8")
    assert "per shard" in str(decision) and decision.in_specs[0] == P("data", None, None, None)


def test_data_by_sequence_mesh():
    """A 2-D mesh: batch over ``data``, sequences over ``seq``: the ring runs
    over ``seq`` within each ``data`` group."""
    m = mesh((2, 4), ("data", "seq"), explicit=False)
    args = [put(m, P("data", "seq"), normal(i, SHAPE)) for i in range(3)]
    got = _check(causal, args, "ring over seq")
    assert _moved(got, "collective-permute", 1), dict(got.collectives)
    assert not _moved(got, "all-gather", int(np.prod(SHAPE)) // 8 + 1), dict(got.collectives)


def test_unsupported_sharding_is_gathered_with_the_reason():
    """Only q sharded along its sequence: the ring needs k/v sharded alike;
    the partitioner gathers q and runs the kernel whole, saying why."""
    m = mesh((4,), ("seq",), explicit=False)
    q = put(m, P(None, "seq"), normal(0, SHAPE))
    k, v = (put(m, P(), normal(i, SHAPE)) for i in (1, 2))
    _check(full, [q, k, v], "gathered")
    reasons = {d.reason for d in placement.decisions()}
    assert all(r.startswith("sequence-sharded: q's query sequence axis") for r in reasons), reasons


def test_training_step():
    """A training step optimized as one function (its backward in the same
    program): q/k/v projected from a sequence-sharded input."""
    m = mesh((8,), ("seq",), explicit=False)
    x = put(m, P(None, "seq"), normal(0, (2, 128, 32)))
    w = put(m, P(), normal(1, (3, 32, 2, 16)) * 0.2)

    def step(w, x):
        def loss(w):
            q, k, v = (jnp.einsum("bte,ehd->bthd", x, w[i]) for i in range(3))
            return jnp.sum(causal(q, k, v) ** 2)

        value, grad = jax.value_and_grad(loss)(w)
        return value, w - 0.1 * grad

    placement.clear_decisions()
    opt = flashpass.optimize(step, kernel="blockwise")
    report = opt.explain(w, x)
    assert [(r.placement, r.passes) for r in report.rewrites] == [
        (PLACED_AT_PARTITIONING, "forward+backward")
    ], str(report)
    compiled = jax.jit(opt).lower(w, x).compile()
    (value, new_w), hlo = compiled(w, x), compiled.as_text()
    want_value, want_w = jax.jit(step)(*unsharded([w, x]))
    assert_close(value, want_value)
    assert_close(new_w, want_w)
    assert "collective-permute" in hlo
    assert all(d.how.startswith("ring over seq") for d in placement.decisions())


def test_unsharded_inputs_stay_local():
    """Single-device arrays on an 8-device host: nothing to partition, the
    site runs where it stands (as on one device)."""
    args = unsharded([normal(i, SHAPE) for i in range(3)])
    report = flashpass.optimize(causal, kernel="blockwise").explain(*args)
    assert [r.placement for r in report.rewrites] == [""], str(report)


def test_gspmd_propagation():
    """With Shardy off, XLA's GSPMD propagation asks the call for its output
    sharding (``infer_sharding_from_operands``): the same ring."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        m = mesh((8,), ("seq",), explicit=False)
        args = [put(m, P(None, "seq"), normal(i, SHAPE)) for i in range(3)]
        got = _check(full, args, "ring over seq")
        assert not _moved(got, "all-gather", int(np.prod(SHAPE)) // 8 + 1)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)


def test_grouped_query_attention_with_a_padding_mask_as_a_ring():
    """The key padding mask travels with its K/V block round the ring."""
    m = mesh((4,), ("seq",), explicit=False)
    q = put(m, P(None, "seq"), normal(0, (2, 64, 4, 16)))
    k, v = (put(m, P(None, "seq"), normal(i, (2, 64, 2, 16))) for i in (1, 2))
    mask = put(m, P(None, "seq"), np.arange(64)[None, :] < np.array([[64], [40]]))

    def gqa_masked(q, k, v, mask):
        mask = mask[:, None, None, :]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation="xla"
        )

    got = _check(gqa_masked, [q, k, v, mask], "ring over seq")
    assert not _moved(got, "all-gather", 1), dict(got.collectives)


def test_replicated_bias_gradient_sums_over_the_shards():
    """A bias shared by every batch shard: its gradient is the sum of each
    shard's part (one all-reduce), as the original's."""
    m = mesh((8,), ("data",), explicit=False)
    args = [put(m, P("data"), normal(i, (8, 2, 32, 16))) for i in range(3)]
    args.append(put(m, P(), normal(3, (1, 2, 32, 32))))

    def biased(q, k, v, bias):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25 + bias
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)

    got = _check(biased, args, "per shard", argnums=(0, 1, 2, 3))
    assert set(got.collectives) == {("all-reduce", "f32", 2 * 32 * 32)}, dict(got.collectives)


def test_trace_time_only_lets_the_program_be_exported():
    """A deferred site's ``custom_partitioning`` keeps Python callbacks, which
    ``jax.export`` cannot serialize; inside `placement.trace_time_only` the same
    program is placed at trace time and exports (as `flashpass.export` does)."""
    m = mesh((8,), ("seq",), explicit=False)
    args = [put(m, P(None, "seq"), normal(i, SHAPE)) for i in range(3)]
    with placement.trace_time_only():
        report = flashpass.optimize(causal, kernel="blockwise").explain(*args)
        exp = jax.export.export(jax.jit(flashpass.optimize(causal, kernel="blockwise")))(*args)
    assert [r.placement for r in report.rewrites] == [""], str(report)
    assert_close(exp.call(*args), causal(*unsharded(args)))
