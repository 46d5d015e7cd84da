"""Attention sinks (gpt-oss, StreamingLLM): ``softmax([s, sink])[..., :-1] @ v``.

Positive: the spellings real code uses (keras-hub's gpt-oss: a per-head logit
broadcast and concatenated, the row max over scores and sink subtracted
before ``jax.nn.softmax``; the column first; a hand-written softmax; GQA; a
fully masked row) become one `Sink` op, forward and gradient (sink logits
included) equal to the original's, first call under ``jax.jit``, and in a
whole training step (forward+backward).  Negative: a score operation after
the concatenation, a slice that keeps the sink, a column with a value, two
columns, a concatenation along the query axis: kept, with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.kernels import reference
from flashpass.spec import AttentionSpec, Causal, ExtraSpec, Sink, Window

B, T, H, D = 2, 24, 4, 8


def _qkv(seed=0, hkv=H, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D))
    k, v = (rng.standard_normal((B, T, hkv, D)) for _ in range(2))
    sinks = rng.standard_normal(H) * 2
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, sinks))


def _scores(q, k):
    return jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)


def _column(sinks, s):
    return jnp.broadcast_to(sinks.reshape(1, -1, 1, 1), (*s.shape[:-1], 1)).astype(s.dtype)


def gpt_oss(q, k, v, sinks):
    """keras-hub's GptOssAttention: causal, max over scores and sink subtracted."""
    s = _scores(q, k)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    c = jnp.concatenate([s, _column(sinks, s)], axis=-1)
    c = c - jax.lax.stop_gradient(c.max(-1, keepdims=True))
    p = jax.nn.softmax(c, axis=-1)[..., :-1]
    return jnp.einsum("bhts,bshd->bthd", p, v)


def sink_first(q, k, v, sinks):
    s = _scores(q, k)
    p = jax.nn.softmax(jnp.concatenate([_column(sinks, s), s], axis=-1), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p[..., 1:], v)


def hand_written(q, k, v, sinks):
    """A hand-written softmax; the sink a per-(batch, head, query) array."""
    s = _scores(q, k)
    col = jnp.broadcast_to(sinks[None, :, None, None], (B, H, T, 1)) * jnp.ones((B, 1, T, 1))
    c = jnp.concatenate([s, col], axis=-1)
    e = jnp.exp(c - c.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    return jnp.einsum("bhts,bshd->bthd", p[:, :, :, :T], v)


def grouped(q, k, v, sinks):
    """GQA as a 5-D einsum ([B, T, Hkv, G, D]), the sink per query head."""
    q5 = q.reshape(B, T, 2, H // 2, D)
    s = jnp.einsum("btkgd,bskd->bkgts", q5, k) / np.sqrt(D)
    col = jnp.broadcast_to(sinks.reshape(1, 2, H // 2, 1, 1), (B, 2, H // 2, T, 1))
    p = jax.nn.softmax(jnp.concatenate([s, col], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(B, T, H, D)


def padded(q, k, v, sinks, keep):
    """A key-padding mask with -inf: example 1 keeps no key, its rows put all
    their weight on the sink (output 0, not nan)."""
    s = jnp.where(keep[:, None, None, :], _scores(q, k), -jnp.inf)
    p = jax.nn.softmax(jnp.concatenate([s, _column(sinks, s)], axis=-1), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p[..., :-1], v)


def deferred(q, k, v, sinks):
    """Normalisation deferred past P·V: the sum over scores and sink divides."""
    s = _scores(q, k)
    c = jnp.concatenate([s, _column(sinks, s)], axis=-1)
    e = jnp.exp(c - c.max(-1, keepdims=True))
    return jnp.einsum("bhts,bshd->bthd", e[..., :-1], v) / jnp.swapaxes(e.sum(-1), 1, 2)[..., None]


def windowed(q, k, v, sinks):
    """gpt-oss' sliding-window layers: causal, a window of 6 keys, sinks."""
    s = _scores(q, k)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = jnp.where((j <= i) & (j >= i - 6), s, -1e9)
    c = jnp.concatenate([s, _column(sinks, s)], axis=-1)
    c = c - jax.lax.stop_gradient(c.max(-1, keepdims=True))
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(c, axis=-1)[..., :-1], v)


def _keep():
    keep = np.zeros((B, T), bool)
    keep[0, :10] = True
    return jnp.asarray(keep)


CASES = {
    "gpt_oss": (gpt_oss, {}),
    "sink_first": (sink_first, {}),
    "hand_written": (hand_written, {}),
    "grouped": (grouped, {"hkv": 2}),
    "padded": (padded, {}),
    "windowed": (windowed, {}),
    "deferred": (deferred, {}),
}


def _args(name, dtype=jnp.float32):
    fn, kw = CASES[name]
    args = _qkv(hkv=kw.get("hkv", H), dtype=dtype)
    return fn, (*args, _keep()) if name == "padded" else args


def _loss(fn):
    return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("kernel", ["blockwise", "reference"])
@pytest.mark.parametrize("name", list(CASES))
def test_sink_spellings_are_rewritten_forward_and_gradient(name, kernel):
    fn, args = _args(name)
    opt = flashpass.optimize(fn, kernel=kernel)
    # First call under jax.jit, differentiated (the sink logits too).
    out, grads = jax.jit(jax.value_and_grad(_loss(opt), argnums=(0, 1, 2, 3)))(*args)
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    ops = [op["op"] for op in report.rewrites[0].spec["score_ops"]]
    assert ops.count("sink") == 1 and "sinks" in report.rewrites[0].mask, ops
    ref_out, ref_grads = jax.value_and_grad(_loss(fn), argnums=(0, 1, 2, 3))(*args)
    np.testing.assert_allclose(out, ref_out, rtol=2e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5 * float(jnp.abs(r).max()))
    np.testing.assert_allclose(opt(*args), fn(*args), rtol=2e-5, atol=2e-6)


def test_window_and_sinks_skip_tiles_exactly():
    # 8-wide tiles: the window skips whole key tiles; the sink still joins every row.
    from flashpass.kernels.blockwise import BlockwiseKernel

    fn, args = _args("windowed")
    kernel = BlockwiseKernel(block_q=8, block_k=8)
    opt = flashpass.optimize(fn, kernel=kernel)
    ops = [op["op"] for op in opt.explain(*args).rewrites[0].spec["score_ops"]]
    assert "window" in ops and "sink" in ops, ops
    # The sink after the structured ops leaves their blocks skippable.
    plan = kernel.plan(
        AttentionSpec(
            B,
            H,
            H,
            T,
            T,
            D,
            D,
            *(np.float32,) * 6,
            score_ops=(Causal(0, -1e9), Window(6, None, -1e9), Sink(0, (1, H, 1, 1))),
            extras=(ExtraSpec((1, H, 1, 1), np.float32),),
        )
    )
    assert plan.kstart[-1] > 0, plan  # the last query tile starts past key tile 0
    out, grads = jax.value_and_grad(_loss(opt), argnums=(0, 1, 2, 3))(*args)
    ref_out, ref_grads = jax.value_and_grad(_loss(fn), argnums=(0, 1, 2, 3))(*args)
    np.testing.assert_allclose(out, ref_out, rtol=2e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5 * float(jnp.abs(r).max()))


def test_fully_masked_rows_weigh_the_sink_only():
    fn, args = _args("padded")
    out = flashpass.optimize(fn, kernel="blockwise")(*args)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[1], 0.0)  # example 1 keeps no key
    np.testing.assert_allclose(out, fn(*args), rtol=2e-5, atol=1e-6)


def test_bfloat16_sinks():
    fn, args = _args("gpt_oss", jnp.bfloat16)
    opt = flashpass.optimize(fn, kernel="blockwise")
    out = jax.jit(opt)(*args)
    assert opt.reports[-1].rewrites and out.dtype == fn(*args).dtype
    assert opt.reports[-1].rewrites[0].dtype == "bfloat16"
    ref = fn(*(a.astype(jnp.float32) for a in args))
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2 * float(jnp.abs(ref).max()))


def test_the_sink_extra_is_kept_unbroadcast():
    fn, args = _args("gpt_oss")
    spec = flashpass.optimize(fn, kernel="blockwise").explain(*args).rewrites[0].spec
    (op,) = [o for o in spec["score_ops"] if o["op"] == "sink"]
    assert op["shape"] == [1, H, 1, 1]  # one logit per head, never [B, H, T, 1]


def test_training_step_with_sinks_is_rewritten_forward_and_backward():
    q, k, v, sinks = _qkv()
    params = {"sinks": sinks, "w": jnp.eye(D) * 0.7}

    def loss(p, x):
        return jnp.mean(gpt_oss(x @ p["w"], x, x @ p["w"].T, p["sinks"]) ** 2)

    def step(p, x):
        value, grads = jax.value_and_grad(loss)(p, x)
        return value, jax.tree.map(lambda a, g: a - 0.5 * g, p, grads)

    opt = flashpass.optimize(step, kernel="blockwise")
    value, new = jax.jit(opt)(params, q)
    report = opt.reports[-1]
    assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)
    ref_value, ref_new = step(params, q)
    np.testing.assert_allclose(value, ref_value, rtol=2e-5)
    for key in params:
        np.testing.assert_allclose(new[key], ref_new[key], rtol=2e-5, atol=1e-6)
    assert float(jnp.abs(new["sinks"] - params["sinks"]).max()) > 0  # the sinks learn


def test_reference_semantics_of_the_sink_op():
    # The spec's definition: softmax over [s, sink], the sink column dropped.
    fn, args = _args("gpt_oss")
    spec = flashpass.optimize(fn, kernel="reference").explain(*args).rewrites[0].spec
    assert spec["score_ops"][-1]["op"] == "sink"
    s = jnp.ones((1, 1, 2, 3))
    sink_spec = type("S", (), {"sink": Sink(0, (1, 1, 1, 1))})()
    p = reference.softmax_with_sink(sink_spec, s, [jnp.full((1, 1, 1, 1), 1 + jnp.log(3.0))])
    np.testing.assert_allclose(p, 1 / 6, rtol=1e-6)  # three keys of e, a sink of 3e


# --------------------------------------------------------------------------- negative


def _scaled_after(q, k, v, sinks):
    s = _scores(q, k)
    c = jnp.concatenate([s, _column(sinks, s)], axis=-1) * 0.5  # scales the sink too
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(c)[..., :-1], v)


def _masked_after(q, k, v, sinks):
    s = _scores(q, k)
    c = jnp.concatenate([s, _column(sinks, s)], axis=-1)
    c = jnp.where(jnp.tril(jnp.ones((T, T + 1), bool)), c, -1e9)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(c)[..., :-1], v)


def _keeps_the_sink(q, k, v, sinks):
    s = _scores(q, k)
    p = jax.nn.softmax(jnp.concatenate([s, _column(sinks, s)], axis=-1))
    return jnp.einsum("bhts,bshd->bthd", p[..., 1:], v)  # drops key 0, not the sink


def _sink_with_value(q, k, v, sinks):
    s = _scores(q, k)
    p = jax.nn.softmax(jnp.concatenate([s, _column(sinks, s)], axis=-1))
    v1 = jnp.concatenate([v, jnp.ones((B, 1, H, D))], axis=1)  # the sink has a value
    return jnp.einsum("bhts,bshd->bthd", p, v1)


def _two_columns(q, k, v, sinks):
    s = _scores(q, k)
    col = _column(sinks, s)
    p = jax.nn.softmax(jnp.concatenate([s, col, col], axis=-1))[..., :-2]
    return jnp.einsum("bhts,bshd->bthd", p, v)


def _query_axis(q, k, v, sinks):
    s = _scores(q, k)
    row = jnp.broadcast_to(sinks.reshape(1, -1, 1, 1), (B, H, 1, T))
    p = jax.nn.softmax(jnp.concatenate([s, row], axis=-2), axis=-1)[:, :, :-1]
    return jnp.einsum("bhts,bshd->bthd", p, v)


def _sink_from_the_scores(q, k, v, sinks):
    s = _scores(q, k)
    col = _column(sinks, s) + jax.lax.stop_gradient(s.mean(-1, keepdims=True))
    c = jnp.concatenate([s, col], axis=-1)
    e = jnp.exp(c - c.max(-1, keepdims=True))  # (the shift's cone reads the sink too)
    return jnp.einsum("bhts,bshd->bthd", (e / e.sum(-1, keepdims=True))[..., :-1], v)


def _shift_before_the_sink(q, k, v, sinks):
    # A row shift of the scores alone is not a shift of [scores, sink]: not invariant.
    s = _scores(q, k)
    s = s - jax.lax.stop_gradient(s.max(-1, keepdims=True))
    p = jax.nn.softmax(jnp.concatenate([s, _column(sinks, s)], axis=-1))[..., :-1]
    return jnp.einsum("bhts,bshd->bthd", p, v)


NEGATIVE = {
    "scaled_after": (_scaled_after, "after the sink column"),
    "masked_after": (_masked_after, "after the sink column"),
    "keeps_the_sink": (_keeps_the_sink, "other than to drop the sink"),
    "sink_with_value": (_sink_with_value, "keep the sink column"),
    "two_columns": (_two_columns, "3 arrays concatenated"),
    "query_axis": (_query_axis, "query axis"),
    "sink_from_the_scores": (_sink_from_the_scores, "computed from the scores"),
}


@pytest.mark.parametrize("name", list(NEGATIVE))
def test_not_a_sink_is_kept_with_the_reason(name):
    fn, words = NEGATIVE[name]
    args = _qkv()
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert not report.rewrites, str(report)
    assert any(words in f.reason for f in report.fallbacks), str(report)
    np.testing.assert_allclose(opt(*args), fn(*args), rtol=1e-5, atol=1e-6)


def test_a_shift_of_the_scores_alone_is_a_bias_not_ignored():
    # s - max(s) before the concatenation changes the sink's share: the site is
    # either kept or computed exactly, never with the shift dropped.
    args = _qkv()
    opt = flashpass.optimize(_shift_before_the_sink, kernel="blockwise")
    np.testing.assert_allclose(opt(*args), _shift_before_the_sink(*args), rtol=2e-5, atol=1e-6)


def test_pallas_tpu_rejects_sinks_with_the_reason():
    fn, args = _args("gpt_oss")
    report = flashpass.optimize(fn, kernel=["pallas_tpu", "blockwise"], interpret=True).explain(
        *args
    )
    assert report.kernels == ["blockwise"], str(report)
    assert "attention sinks" in " ".join(report.rewrites[0].rejected["pallas_tpu"])


def test_splash_takes_per_head_sinks_forward_and_gradient():
    # splash's own `sinks` (one logit per head), in TPU interpret mode on CPU.
    fn, args = _args("gpt_oss")
    opt = flashpass.optimize(fn, kernel="splash", interpret=True)
    out, grads = jax.jit(jax.value_and_grad(_loss(opt), argnums=(0, 1, 2, 3)))(*args)
    assert opt.reports[-1].kernels == ["splash"], str(opt.reports[-1])
    ref_out, ref_grads = jax.value_and_grad(_loss(fn), argnums=(0, 1, 2, 3))(*args)
    np.testing.assert_allclose(out, ref_out, rtol=2e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5 * float(jnp.abs(r).max()))


def test_splash_rejects_sinks_that_vary_over_queries():
    fn, args = _args("hand_written")  # a sink per (batch, head, query)
    report = flashpass.optimize(fn, kernel=["splash", "blockwise"], interpret=True).explain(*args)
    assert report.kernels == ["blockwise"], str(report)
    assert "one sink logit per head" in " ".join(report.rewrites[0].rejected["splash"])
