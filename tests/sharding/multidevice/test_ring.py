"""Sequence-sharded attention runs as a ring (flashpass/ring/), 8 CPU devices.

With Explicit mesh axes, code attending a sequence-sharded q to k/v gathers
k and v itself (``jax.sharding.reshard(k, P())``): the original program
all-gathers K and V to full length on every device.  The rewrite reads k/v
from before the gather and runs a ring of per-block steps with
collective-permutes; the gathers disappear.  Checked against the unsharded
original: outputs and gradients, the collectives, and that per-device
temporary memory falls as devices are added.
"""

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sharded_testing import P, assert_close, collectives, mesh, normal, put, run, unsharded

import flashpass
from flashpass.ring import backward as ring_backward
from flashpass.ring import forward as ring_forward

from jax_versions import requires_triton

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")

REPLICATED = P(None, None, None, None)


def attention(q, k, v, causal):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def gathering(causal, batch=None):
    """What users write with Explicit axes: gather k and v along the sequence
    (keeping a ``batch``-sharded batch axis), then attend."""
    gathered = P(batch, None, None, None)

    def fn(q, k, v):
        k = jax.sharding.reshard(k, gathered)
        v = jax.sharding.reshard(v, gathered)
        return attention(q, k, v, causal)

    return fn


def _full_length_gathers(hlo: str, elements: int) -> int:
    """All-gathers that build a whole K or V (``elements``: one device's batch
    rows, all heads, the full sequence)."""
    return sum(
        n
        for (kind, _, size), n in collectives(hlo).items()
        if kind == "all-gather" and size >= elements
    )


# (``reference``'s plain steps: the slow set; ``blockwise`` runs every case here.)
@pytest.mark.parametrize("kernel", [pytest.param("reference", marks=pytest.mark.slow), "blockwise"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "mesh_shape, names, spec",
    [((8,), ("seq",), P(None, "seq")), ((2, 4), ("data", "seq"), P("data", "seq"))],
    ids=["seq8", "data2xseq4"],
)
def test_sequence_sharded_site_runs_as_a_ring(causal, mesh_shape, names, spec, kernel):
    """Every step in the ring's plain JAX (``reference`` declares no ring
    steps), or every step the blockwise kernel's (``Kernel.ring_step``); a
    causal ring with kernel steps is load-balanced (`flashpass.ring.zigzag`)."""
    m = mesh(mesh_shape, names)
    shape = (2, 64, 4, 16)
    args = [put(m, spec, normal(i, shape)) for i in range(3)]
    fn = gathering(causal, spec[0])  # (newer JAX: the batch sharding must match q's)
    opt = flashpass.optimize(fn, kernel=kernel)
    with jax.set_mesh(m):
        report = opt.explain(*args)
        got, orig = run(opt, args), run(fn, args)
    assert report.kernels == ["ring"] and not report.fallbacks, str(report)
    steps = {"reference": "plain JAX", "blockwise": "blockwise"}[kernel]
    steps += ", zig-zag" if causal and kernel == "blockwise" else ""
    assert report.rewrites[0].ring_steps == steps, str(report)
    ref = run(lambda q, k, v: attention(q, k, v, causal), unsharded(args))
    assert_close(got.out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)
    assert got.out.sharding.is_equivalent_to(orig.out.sharding, 4)
    moved = collectives(got.hlo)
    assert any(kind == "collective-permute" for kind, _, _ in moved), dict(moved)
    b, t, h, d = shape
    whole = (b // mesh_shape[0] if len(mesh_shape) == 2 else b) * t * h * d
    assert _full_length_gathers(orig.hlo, whole) > 0  # the original gathers K and V
    assert _full_length_gathers(got.hlo, whole) == 0, dict(moved)


class _CountingLax:
    """``jax.lax`` for the ring's forward and backward (flashpass.ring), whose
    ``lax.cond`` records, at run time, each device's predicate of each step's
    visibility test (their outermost conditionals: one per step)."""

    def __init__(self, axis):
        self.axis, self.depth, self.conds = axis, 0, 0
        self.seen = collections.defaultdict(dict)  # cond number -> {device: pred}

    def __getattr__(self, name):
        return getattr(jax.lax, name)

    def cond(self, pred, true_fn, false_fn, *operands):
        if self.depth == 0:
            record = functools.partial(self._record, self.conds)
            jax.debug.callback(record, jax.lax.axis_index(self.axis), pred)
            self.conds += 1

        def nested(fn):
            def traced(*a):
                self.depth += 1
                try:
                    return fn(*a)
                finally:
                    self.depth -= 1

            return traced

        return jax.lax.cond(pred, nested(true_fn), nested(false_fn), *operands)

    def _record(self, cond, device, pred):
        self.seen[cond][int(device)] = bool(pred)


def test_causal_ring_skips_masked_steps(monkeypatch):
    """A causal ring skips, on each device, exactly the steps whose K/V block
    follows its query block: on device i, step s visits the block of device
    (i - s) mod n, which is skipped when that is above i.  Counted at run time
    from the ring's conditionals, forward and backward (28 of the 64 steps of
    8 devices, each way), and the result is still the original's."""
    n = 8
    m = mesh((n,), ("seq",))
    args = [put(m, P(None, "seq"), normal(i, (1, 64, 2, 16))) for i in range(3)]
    counting = _CountingLax("seq")
    monkeypatch.setattr(ring_forward, "lax", counting)
    monkeypatch.setattr(ring_backward, "lax", counting)
    opt = flashpass.optimize(gathering(True), kernel="reference")
    with jax.set_mesh(m):
        got = run(opt, args)
        jax.effects_barrier()
    want = [{i: (i - s) % n <= i for i in range(n)} for s in range(n)]
    # The conditionals come n at a time (one per step) from each trace of the
    # ring: its forward (traced for the primal and for the vjp's forward rule,
    # of which the program runs one) and its backward, the last.  Those that
    # ran ran on every device, and skipped exactly the masked steps.
    assert counting.conds % n == 0, counting.conds
    ran = sorted({c // n for c in counting.seen})
    assert len(ran) >= 2 and ran[-1] == counting.conds // n - 1, (ran, counting.conds)
    for trace in ran:
        got_steps = [counting.seen[trace * n + s] for s in range(n)]
        assert got_steps == want, (trace, got_steps)
    skipped = sum(not p for step in want for p in step.values())
    assert skipped == n * (n - 1) // 2  # 28 of 64 steps
    ref = run(lambda q, k, v: attention(q, k, v, True), unsharded(args))
    assert_close(got.out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)


def test_per_device_memory_falls_with_devices():
    temps = []
    for n in (2, 4, 8):
        m = mesh((n,), ("seq",))
        args = [put(m, P(None, "seq"), normal(i, (1, 1024, 2, 32))) for i in range(3)]
        opt = flashpass.optimize(gathering(True), kernel="reference")
        with jax.set_mesh(m):
            compiled = jax.jit(opt).lower(*args).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    assert temps[0] > temps[1] > temps[2], temps


def _dropped(q, k, v, key):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), s, -1e9)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jax.random.bernoulli(key, 0.9, p.shape), p / 0.9, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize(
    "mesh_shape, names, spec",
    [
        ((8,), ("seq",), P(None, "seq")),
        pytest.param((2, 4), ("data", "seq"), P("data", "seq"), marks=pytest.mark.slow),
        ((4, 2), ("seq", "model"), P(None, "seq", "model")),
    ],
    ids=["seq8", "data2xseq4", "seq4xheads2"],
)
def test_dropout_ring(mesh_shape, names, spec):
    """Dropout in a sequence-sharded training site: the replicated keep-mask
    laid out like the sharded weights (a `reshard`) is read; the ring
    regenerates it from the key at global positions (batch and heads too, where
    they are sharded: `ring.ShardedIndex`), forward and backward: outputs and
    gradients equal the original program's, with no full-length gather of K or
    V."""
    m = mesh(mesh_shape, names)
    args = [put(m, spec, normal(i, (2, 64, 2, 16))) for i in range(3)]
    key = jax.random.key(0)
    gathered = P(spec[0], None, *spec[2:])

    def fn(q, k, v, key):
        k, v = jax.sharding.reshard(k, gathered), jax.sharding.reshard(v, gathered)
        return _dropped(q, k, v, key)

    opt = flashpass.optimize(fn, kernel="reference")
    with jax.set_mesh(m):
        report = opt.explain(*args, key)
        got = run(lambda q, k, v: opt(q, k, v, key), args)
        want = run(lambda q, k, v: fn(q, k, v, key), args)
    assert report.kernels == ["ring"], str(report)
    assert_close(got.out, want.out)
    for g, w in zip(got.grads, want.grads, strict=True):
        assert_close(g, w)
    whole = 2 * 64 * 2 * 16 // (mesh_shape[0] if len(mesh_shape) == 2 else 1)
    assert _full_length_gathers(got.hlo, whole // 2) == 0, dict(collectives(got.hlo))


def test_unsupported_ring_is_kept_with_a_reason():
    """An op the ring does not know is named by `ring.unsupported`."""
    from flashpass import ring
    from flashpass.spec import AttentionSpec, Scale

    @dataclasses.dataclass(frozen=True)
    class Unknown:
        pass

    spec = AttentionSpec(1, 2, 2, 64, 64, 16, 16, *(np.float32,) * 6, score_ops=(Scale(0.25),))
    assert ring.unsupported(spec) is None
    assert "not Unknown" in ring.unsupported(dataclasses.replace(spec, score_ops=(Unknown(),)))


def test_auto_axes_without_annotations_keep_xla_partitioning():
    """Auto axes keep shardings out of the types, and the pass must give the same
    program whatever the first call's context (a direct call's arrays are not
    read): unannotated sequence-sharded inputs are left to XLA, as before."""
    m = mesh((8,), ("seq",), explicit=False)
    args = [put(m, P(None, "seq"), normal(i, (2, 64, 4, 16))) for i in range(3)]
    fn = functools.partial(attention, causal=True)
    direct = flashpass.optimize(fn, kernel="blockwise")
    direct(*args)
    under_jit = flashpass.optimize(fn, kernel="blockwise")
    jax.jit(under_jit)(*args)
    assert direct.reports[-1].kernels == under_jit.reports[-1].kernels == ["blockwise"]


def test_auto_axes_ring_from_sharding_constraints():
    """Model code under Auto axes annotates q/k/v (``with_sharding_constraint``,
    as logical-axis rules do): read from the program, under an outer jit too;
    the ring replaces XLA's all-gathers of K and V."""
    m = mesh((8,), ("seq",), explicit=False)
    seq = jax.sharding.NamedSharding(m, P(None, "seq"))

    def fn(q, k, v):
        q, k, v = (jax.lax.with_sharding_constraint(x * 1.0, seq) for x in (q, k, v))
        return attention(q, k, v, True)

    shape = (2, 64, 4, 16)
    args = [put(m, P(None, "seq"), normal(i, shape)) for i in range(3)]
    opt = flashpass.optimize(fn, kernel="blockwise")
    out = jax.jit(opt)(*args)
    assert opt.reports[-1].kernels == ["ring"], str(opt.reports[-1])
    got, orig = run(opt, args), run(fn, args)
    ref = run(fn, unsharded(args))
    assert_close(out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)
    whole = shape[0] * shape[1] * shape[2] * shape[3]
    assert _full_length_gathers(orig.hlo, whole) > 0
    assert _full_length_gathers(got.hlo, whole) == 0, dict(collectives(got.hlo))


def _windowed(q, k, v):
    t = q.shape[1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    s = jnp.where((j <= i) & (j > i - 12), s, -jnp.inf)  # a causal window of 12
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _bidirectional(q, k, v):
    t = q.shape[1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    s = jnp.where((j > i - 12) & (j < i + 12), s, -jnp.inf)  # 11 keys on each side
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _streaming(q, k, v):
    """StreamingLLM: 4 sink keys and a causal window of 12 (a `SinkWindow`)."""
    t = q.shape[1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    s = jnp.where((j < 4) | ((j <= i) & (j > i - 12)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _block_causal(q, k, v):
    """Block diffusion: causal between blocks of 12 keys (a `BlockCausal`), which
    cross the device blocks of 8."""
    block = jnp.arange(q.shape[1]) // 12
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    s = jnp.where(block[:, None] >= block[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _padded(q, k, v, lengths):
    keep = jnp.arange(k.shape[1])[None, :] < lengths[:, None]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    s = jnp.where(keep[:, None, None, :], s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _softcapped(q, k, v):
    """Gemma 2: a logit soft-cap, then a causal window of 12."""
    t = q.shape[1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    s = 5.0 * jnp.tanh(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25 / 5.0)
    s = jnp.where((j <= i) & (j > i - 12), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _sinks(q, k, v, sinks):
    """gpt-oss: a causal window and a learned sink logit per head."""
    t = q.shape[1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    s = jnp.where((j <= i) & (j > i - 12), s, -1e9)
    # (zeros_like: the column sharded like the scores, as concatenate requires)
    col = jnp.zeros_like(s[..., :1]) + sinks.reshape(1, -1, 1, 1)
    c = jnp.concatenate([s, col], axis=-1)
    c = c - jax.lax.stop_gradient(c.max(-1, keepdims=True))
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(c, axis=-1)[..., :-1], v)


def _packed(q, k, v, ids, kv_ids):
    """Packed documents: segment ids compared with ``==``, combined with causal."""
    t = q.shape[1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    same = ids[:, None, :, None] == kv_ids[:, None, None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    s = jnp.where(same & (j <= i), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _biased(q, k, v, bias):
    """A learned relative-position bias ``[1, H, T, S]`` and a causal mask."""
    t = q.shape[1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25 + bias
    s = jnp.where(j <= i, s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _key_masked(q, k, v, keep, mask):
    """A key padding mask ``[B, S]`` and a dense boolean mask ``[T, S]``."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    s = jnp.where(keep[:, None, None, :] & mask, s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


#: The kernels a blockwise ring's steps run per case (`flashpass.ring.cases`):
#: a window of 12 over blocks of 8 has steps whose lower edge lies above the
#: diagonal (plain JAX); packed documents with two id arrays may leave a row no
#: key, so the later blocks a causal mask excludes still run (plain JAX); the
#: others translate every step.
BLOCKWISE_STEPS = {
    "window": "blockwise, plain JAX",
    "bidirectional": "blockwise, plain JAX",
    "softcap": "blockwise, plain JAX",
    "sinks": "blockwise, plain JAX",
    "packed": "blockwise, plain JAX",
    "streaming": "plain JAX",
    "block_causal": "plain JAX",
}


@pytest.mark.parametrize("kernel", [pytest.param("reference", marks=pytest.mark.slow), "blockwise"])
@pytest.mark.parametrize(
    "case",
    [
        "window",
        "bidirectional",
        "padded",
        "sinks",
        "softcap",
        "packed",
        "bias",
        "masks",
        "streaming",
        "block_causal",
    ],
)
def test_windowed_and_padded_rings(case, kernel):
    """Window masks skip the steps outside the window; kv lengths (a padded
    batch, one row fully padded) are applied per step with the program's fill;
    attention sinks start every row's statistics (their gradient included); a
    soft-cap is differentiated through in the backward ring; packed documents'
    key segment ids travel with their K/V block (documents that straddle
    devices, and one query row whose id no key before it has); a ``[1, H, T,
    S]`` bias is read by query block and sliced at the visiting block (its
    gradient too); a key padding mask travels with K/V, a dense mask is
    sliced (a row that both exclude entirely averages every key's fill)."""
    m = mesh((8,), ("seq",))
    args = [put(m, P(None, "seq"), normal(i, (2, 64, 2, 16))) for i in range(3)]
    argnums = (0, 1, 2)
    if case == "window":
        attend, extra = _windowed, []
    elif case == "bidirectional":  # wrapped blocks the window reaches: kernel steps too
        attend, extra = _bidirectional, []
    elif case == "streaming":  # sink keys on device 0: every step whose block they hold runs
        attend, extra = _streaming, []
    elif case == "block_causal":  # steps past a row's block skipped at run time (`meets_block`)
        attend, extra = _block_causal, []
    elif case == "padded":
        attend, extra = _padded, [put(m, P(), np.array([40, 0], np.int32))]
    elif case == "softcap":
        attend, extra = _softcapped, []
    elif case == "bias":
        attend, argnums = _biased, (0, 1, 2, 3)
        extra = [put(m, P(None, None, "seq", None), normal(7, (1, 2, 64, 64)))]
    elif case == "masks":
        keep = np.ones((2, 64), bool)
        keep[0, 50:] = keep[1, 3:9] = False
        mask = np.random.default_rng(3).random((64, 64)) < 0.7
        mask[20] = False  # query row 20 keeps no key
        attend = _key_masked
        extra = [put(m, P(None, "seq"), keep), put(m, P(None, None), mask)]
    elif case == "packed":
        # Documents of 5, 20, 30 and 9 keys in row 0 (crossing device blocks of
        # 8); row 1: one document, but query 40's id is a key's only after it,
        # so that row keeps no key and averages every key's fill.
        ids = np.repeat(np.array([[0, 1, 2, 3], [7, 7, 7, 7]], np.int32), [5, 20, 30, 9], axis=1)
        kv_ids = ids.copy()
        ids[1, 40], kv_ids[1, 50] = 9, 9
        attend, extra = _packed, [put(m, P(None, "seq"), x) for x in (ids, kv_ids)]
    else:
        attend, extra = _sinks, [put(m, P(), np.array([0.5, -1.0], np.float32))]
        argnums = (0, 1, 2, 3)

    def fn(q, k, v, *rest):
        k, v = jax.sharding.reshard(k, REPLICATED), jax.sharding.reshard(v, REPLICATED)
        gathered = lambda x: jax.sharding.reshard(x, P(None, None))  # noqa: E731
        if case == "packed":  # the key ids, gathered like k and v
            return attend(q, k, v, rest[0], gathered(rest[1]))
        if case == "masks":  # the key padding mask too
            return attend(q, k, v, gathered(rest[0]), rest[1])
        return attend(q, k, v, *rest)

    opt = flashpass.optimize(fn, kernel=kernel)
    with jax.set_mesh(m):
        report = opt.explain(*args, *extra)
        got = run(opt, [*args, *extra], argnums)
    assert report.kernels == ["ring"], str(report)
    steps = "plain JAX" if kernel == "reference" else BLOCKWISE_STEPS.get(case, "blockwise")
    assert report.rewrites[0].ring_steps == steps, str(report)
    ref = run(attend, unsharded([*args, *extra]), argnums)
    assert_close(got.out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)
    assert any(kind == "collective-permute" for kind, _, _ in collectives(got.hlo))


@pytest.mark.parametrize(
    "causal, kernel",
    [(False, "reference"), (True, "reference"), (True, "blockwise")],
    ids=["full", "causal", "causal-zigzag"],
)
def test_ring_training_step(causal, kernel):
    """A train step over a sequence-sharded site: the ring reads k/v before the
    program's gather, so the backward is proven again with those reads (the gathers
    join the forward, their transposes the backward) and the whole step runs as a
    ring (with blockwise steps: the load-balanced zig-zag ring): same loss and
    gradients, no full-length all-gather left."""
    m = mesh((8,), ("seq",))
    shape = (1, 64, 2, 16)
    args = [put(m, P(None, "seq"), normal(i, shape)) for i in range(3)]
    fn = gathering(causal)

    def step(q, k, v):
        return jax.value_and_grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2))(q, k, v)

    opt = flashpass.optimize(step, kernel=kernel)
    with jax.set_mesh(m):
        report = opt.explain(*args)
        got, want = jax.jit(opt)(*args), jax.jit(step)(*args)
        hlo = jax.jit(opt).lower(*args).compile().as_text()
    assert report.kernels == ["ring"] and not report.fallbacks, str(report)
    assert [r.passes for r in report.rewrites] == ["forward+backward"]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w)
    assert _full_length_gathers(hlo, math.prod(shape)) == 0


def test_batch_sharded_training_step_is_rewritten():
    """Batch-sharded (Explicit axes) train step: the site and its backward are rewritten,
    gradients equal the original's."""
    m = mesh((8,), ("data",))
    args = [put(m, P("data"), normal(i, (8, 32, 2, 16))) for i in range(3)]

    def step(q, k, v):
        loss = lambda *a: jnp.sum(attention(*a, True) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    opt = flashpass.optimize(step, kernel="blockwise")
    with jax.set_mesh(m):
        report = opt.explain(*args)
        got, want = jax.jit(opt)(*args), jax.jit(step)(*args)
    assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def _in_body(causal):
    """Code inside the user's shard_map: gather k and v over the sequence axis,
    attend the local queries to them (causal through global query positions)."""

    def body(q, k, v):
        kk = jax.lax.all_gather(k, "seq", axis=1, tiled=True)
        vv = jax.lax.all_gather(v, "seq", axis=1, tiled=True)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * 0.25
        if causal:
            i = jax.lax.axis_index("seq") * q.shape[1] + jnp.arange(q.shape[1])
            s = jnp.where(jnp.arange(kk.shape[1])[None, :] <= i[:, None], s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vv)

    return body


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "mesh_shape, names, spec",
    [((8,), ("seq",), P(None, "seq")), ((2, 4), ("data", "seq"), P("data", "seq"))],
    ids=["seq8", "data2xseq4"],
)
def test_ring_inside_the_users_shard_map(causal, mesh_shape, names, spec):
    """k/v all-gathered inside the user's shard_map: the site runs as a ring where
    it stands (the causal mask on axis_index positions is per-query kv lengths);
    the gathers are gone, collective-permutes carry K/V; outputs and gradients
    equal the unsharded original's."""
    m = mesh(mesh_shape, names)
    args = [put(m, spec, normal(i, (2, 64, 2, 16))) for i in range(3)]
    fn = jax.shard_map(_in_body(causal), mesh=m, in_specs=spec, out_specs=spec)
    opt = flashpass.optimize(fn, kernel="blockwise")
    with jax.set_mesh(m):
        report = opt.explain(*args)
        got, orig = run(opt, args), run(fn, args)
    assert report.kernels == ["ring"], str(report)
    ref = run(functools.partial(attention, causal=causal), unsharded(args))
    assert_close(got.out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)
    whole = 2 * 64 * 2 * 16 // (2 if "data" in names else 1)
    assert _full_length_gathers(orig.hlo, whole) > 0
    assert _full_length_gathers(got.hlo, whole) == 0, dict(collectives(got.hlo))
    assert any(kind == "collective-permute" for kind, _, _ in collectives(got.hlo))


def test_packed_ring_inside_the_users_shard_map():
    """Packed documents in the user's shard_map: the body gathers the key ids
    with k and v; the ring slices the gathered ids at each visiting block."""
    m = mesh((8,), ("seq",))

    def body(q, k, v, ids):
        kk, vv, kv_ids = (jax.lax.all_gather(x, "seq", axis=1, tiled=True) for x in (k, v, ids))
        i = jax.lax.axis_index("seq") * q.shape[1] + jnp.arange(q.shape[1])
        keep = (jnp.arange(kk.shape[1])[None, :] <= i[:, None]) & (
            ids[:, None, :, None] == kv_ids[:, None, None, :]
        )
        s = jnp.where(keep, jnp.einsum("bqhd,bkhd->bhqk", q, kk) * 0.25, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vv)

    spec = P(None, "seq")
    args = [put(m, spec, normal(i, (2, 64, 2, 16))) for i in range(3)]
    ids = np.repeat(np.array([[0, 1, 2, 3], [5, 6, 6, 7]], np.int32), [5, 20, 30, 9], axis=1)
    args.append(put(m, spec, ids))
    fn = jax.shard_map(body, mesh=m, in_specs=spec, out_specs=spec)
    opt = flashpass.optimize(fn, kernel="blockwise")
    with jax.set_mesh(m):
        report = opt.explain(*args)
        got = run(opt, args, (0, 1, 2))
    assert report.kernels == ["ring"], str(report)
    ref = run(lambda q, k, v, ids: _packed(q, k, v, ids, ids), unsharded(args), (0, 1, 2))
    assert_close(got.out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)


def test_kv_length_steps_are_skipped_when_every_row_keeps_a_key():
    """White-box: with kv lengths >= 1 in every row (and no other excluding op
    than causal), a K/V block past every row's length is not computed (its
    NaN values never reach the output); with a row of length 0 every block is
    (that row averages every key's fill, as the original does)."""
    from flashpass import ring
    from flashpass.spec import AttentionSpec, ExtraSpec, KvLengths

    m = mesh((8,), ("seq",))
    b, t, h, d = 1, 64, 2, 16
    spec = AttentionSpec(
        b, h, h, t // 8, t // 8, d, d, *(np.float32,) * 6,
        score_ops=(KvLengths(0, (b, 1, 1, 1), -1e9, 0),),
        extras=(ExtraSpec((b, 1, 1, 1), np.int32),),
    )  # fmt: skip
    seq = P(None, None, "seq")
    q, k = put(m, seq, normal(0, (b, h, t, d))), put(m, seq, normal(1, (b, h, t, d)))
    v = np.array(normal(2, (b, h, t, d)))
    v[:, :, 40:48] = np.nan  # the sixth device's block, past every length below
    v = put(m, seq, v)

    def run_ring(lengths):
        def body(q, k, v, n):
            return ring.ring_attention(q, k, v, (n,), spec, "seq", 8)

        fn = jax.shard_map(
            body,
            mesh=m,
            in_specs=(seq,) * 3 + (P(),),
            out_specs=seq,
            check_vma=False,
        )
        n = put(m, P(), np.full((b, 1, 1, 1), lengths, np.int32))
        with jax.set_mesh(m):
            return np.asarray(jax.jit(fn)(q, k, v, n))

    assert np.all(np.isfinite(run_ring(20)))  # blocks from key 24 on: skipped
    assert np.isnan(run_ring(0)).any()  # a row with no key reads every block


@pytest.mark.parametrize("same", [True, False], ids=["one_id_array", "two_id_arrays"])
def test_segment_steps_are_skipped_when_every_row_keeps_itself(same):
    """White-box: packed documents of one device block each, causal.  With one
    id array read at both positions (every row keeps its own key) a step
    whose key ids meet no query id is not computed (the NaN values of block 5
    never reach another block's rows); with two id arrays a row could keep no
    key and average every key's fill, so every step is computed."""
    from flashpass import ring
    from flashpass.spec import AttentionSpec, Causal, ExtraSpec, Segments

    m = mesh((8,), ("seq",))
    b, t, h, d = 1, 64, 2, 16
    shapes = ((b, 1, t // 8, 1), (b, 1, 1, t // 8))
    spec = AttentionSpec(
        b, h, h, t // 8, t // 8, d, d, *(np.float32,) * 6,
        score_ops=(Causal(0, -1e9), Segments(0, 1, -1e9, same)),
        extras=tuple(ExtraSpec(s, np.int32) for s in shapes),
    )  # fmt: skip
    seq = P(None, None, "seq")
    q, k = put(m, seq, normal(0, (b, h, t, d))), put(m, seq, normal(1, (b, h, t, d)))
    v = np.array(normal(2, (b, h, t, d)))
    v[:, :, 40:48] = np.nan  # the sixth device's block: its own document
    v = put(m, seq, v)
    ids = np.repeat(np.arange(8, dtype=np.int32), 8)

    def body(q, k, v, qi, ki):
        return ring.ring_attention(q, k, v, (qi, ki), spec, "seq", 8)

    fn = jax.shard_map(
        body,
        mesh=m,
        in_specs=(seq,) * 3 + (P(None, None, "seq"), P(None, None, None, "seq")),
        out_specs=seq,
        check_vma=False,
    )
    qi = put(m, P(None, None, "seq"), ids.reshape(1, 1, t, 1))
    ki = put(m, P(None, None, None, "seq"), ids.reshape(1, 1, 1, t))
    with jax.set_mesh(m):
        out = np.asarray(jax.jit(fn)(q, k, v, qi, ki))
    others = np.delete(out, np.s_[40:48], axis=2)
    assert np.all(np.isfinite(others)) == same


def test_packed_documents_ring_under_auto_axes():
    """Packed documents written as MaxText does (one id array compared with
    itself, causal), q/k/v annotated under Auto axes: a ring whose key ids
    travel with K/V, outputs and gradients as the unsharded original, no
    full-length gather of K or V."""
    m = mesh((8,), ("seq",), explicit=False)
    seq = jax.sharding.NamedSharding(m, P(None, "seq"))

    def fn(q, k, v, ids):
        q, k, v = (jax.lax.with_sharding_constraint(x * 1.0, seq) for x in (q, k, v))
        return _packed(q, k, v, ids, ids)

    shape = (2, 64, 2, 16)
    args = [put(m, P(None, "seq"), normal(i, shape)) for i in range(3)]
    ids = np.repeat(np.array([[0, 1, 2, 3], [5, 6, 6, 7]], np.int32), [5, 20, 30, 9], axis=1)
    args.append(put(m, P(None, "seq"), ids))
    opt = flashpass.optimize(fn, kernel="blockwise")
    out = jax.jit(opt)(*args)
    assert opt.reports[-1].kernels == ["ring"], str(opt.reports[-1])
    got = run(opt, args, (0, 1, 2))
    ref = run(fn, unsharded(args), (0, 1, 2))
    assert_close(out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)
    assert _full_length_gathers(got.hlo, shape[0] * shape[1] * shape[2] * shape[3]) == 0


def test_steps_run_over_query_chunks(monkeypatch):
    """A step runs over chunks of its query rows (`ring.ROW_CHUNK_SCORES`):
    the same outputs and gradients as one chunk, and less temporary memory
    per device, forward and backward."""
    from flashpass import ring

    m = mesh((8,), ("seq",))
    args = [put(m, P(None, "seq"), normal(i, (1, 1024, 2, 32))) for i in range(3)]
    results, temps = [], []
    for budget in (ring.ROW_CHUNK_SCORES, 2 * 128 * 16):  # one chunk; 8 chunks of 16 rows
        monkeypatch.setattr(ring, "ROW_CHUNK_SCORES", budget)
        opt = flashpass.optimize(gathering(True), kernel="reference")
        with jax.set_mesh(m):
            results.append(run(opt, args))
            loss = lambda *a, opt=opt: opt(*a).sum()  # noqa: E731
            compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    whole, chunked = results
    assert_close(chunked.out, whole.out)
    for g, r in zip(chunked.grads, whole.grads, strict=True):
        assert_close(g, r)
    assert temps[1] < temps[0] * 0.75, temps


@pytest.mark.parametrize(
    "balanced", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["zigzag", "contiguous"]
)
@pytest.mark.parametrize(
    "platform, kernel",
    [
        pytest.param("tpu", "splash", id="splash"),
        pytest.param("gpu", "pallas_gpu", id="pallas_gpu", marks=requires_triton),
    ],
)
def test_ring_steps_run_the_platform_kernel(platform, kernel, balanced):
    """Selecting for TPU or GPU, a causal ring's blocks run that platform's
    kernel (here in interpret mode), load-balanced (zig-zag) or, with the
    balancing switched off (``zigzag=False``), in the contiguous order: its logsumexp merges
    the blocks, its own backward kernels take the global statistics; outputs
    and gradients match the unsharded original, with collective-permutes and
    no full-length gather."""
    m = mesh((4,), ("seq",))
    shape = (1, 64, 2, 16)
    args = [put(m, P(None, "seq"), normal(i, shape)) for i in range(3)]
    opt = flashpass.optimize(
        gathering(True), kernel=kernel, platform=platform, interpret=True, zigzag=balanced
    )
    with jax.set_mesh(m):
        report = opt.explain(*args)
        got = run(opt, args)
    steps = kernel + (", zig-zag" if balanced else "")
    assert report.kernels == ["ring"] and report.rewrites[0].ring_steps == steps, str(report)
    ref = run(lambda q, k, v: attention(q, k, v, True), unsharded(args))
    assert_close(got.out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)
    assert _full_length_gathers(got.hlo, math.prod(shape)) == 0
    assert any(kind == "collective-permute" for kind, _, _ in collectives(got.hlo))


@requires_triton
def test_a_step_the_platform_kernel_declines_runs_the_next():
    """Selecting for GPU, a key-padding-masked ring: pallas_gpu takes the site
    but runs no ring step with a boolean mask (`step_reasons`), so the steps
    run the next kernel that declares them (blockwise); outputs and gradients
    still match."""
    m = mesh((4,), ("seq",))
    args = [put(m, P(None, "seq"), normal(i, (2, 32, 2, 16))) for i in range(3)]
    keep = np.ones((2, 32), bool)
    keep[0, 20:] = False
    extra = [put(m, P(None, "seq"), keep)]

    def fn(q, k, v, keep):
        k, v = jax.sharding.reshard(k, REPLICATED), jax.sharding.reshard(v, REPLICATED)
        return _key_masked(q, k, v, jax.sharding.reshard(keep, P(None, None)), True)

    opt = flashpass.optimize(fn, kernel=["pallas_gpu", "blockwise"], platform="gpu", interpret=True)
    with jax.set_mesh(m):
        report = opt.explain(*args, *extra)
        got = run(opt, [*args, *extra])
    assert report.kernels == ["ring"] and report.rewrites[0].ring_steps == "blockwise", str(report)
    ref = run(lambda q, k, v, keep: _key_masked(q, k, v, keep, True), unsharded([*args, *extra]))
    assert_close(got.out, ref.out)
    for g, r in zip(got.grads, ref.grads, strict=True):
        assert_close(g, r)
