"""Decode steps: per-row kv lengths, the decode path, the cost-based choice.

* `KvLengths` is recognised from the ways a KV cache's valid lengths are
  written, with the right shift, and near misses stay dense masks; either way
  the rewrite computes the original function.
* The blockwise kernel's decode path (chunks past each row's length skipped)
  equals the reference forward and gradient, rows of length 0 (fully masked:
  the original's uniform weights, or NaN for a -inf fill) and of the full
  cache included, through both of its branches (the chunk loop and the
  single pass) and a cache length that is not a multiple of the chunk.
* The choice: where the original is faster the site is kept with the reason
  "kept: faster as written"; naming the kernel forces it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import flashpass
from flashpass.kernels import CheckContext
from flashpass.kernels.blockwise import BlockwiseKernel
from flashpass.kernels.blockwise.cost import (
    DECODE_MIN_KV_LEN,
    DECODE_MIN_KV_LEN_NARROW,
    DECODE_MIN_KV_LEN_ONE_ROW,
    faster_as_written,
)
from flashpass.kernels.reference import reference_attention
from flashpass.spec import AttentionSpec, Causal, ExtraSpec, KvLengths, Scale, Softcap

B, H, D = 3, 4, 8


def _qkv(t, s, seed=0, hkv=H):
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal(shape).astype(np.float32))
        for shape in ((B, H, t, D), (B, hkv, s, D), (B, hkv, s, D))
    )


def _attend(keep_fn, fill=-1e9):
    """Decode-style attention masking keys with ``keep_fn(S, lengths)``."""

    def attend(q, k, v, lengths):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25
        keep = keep_fn(k.shape[2], lengths)
        s = jnp.where(keep if keep.ndim == 4 else keep[:, None, None, :], s, fill)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)

    return attend


def _ar(s):
    return jnp.arange(s)[None, :]


# name -> (keep_fn, the shift KvLengths must get)
KV_SPELLINGS = {
    "arange_lt": (lambda s, n: _ar(s) < n[:, None], 0),
    "flipped_gt": (lambda s, n: n[:, None] > _ar(s), 0),
    "arange_le": (lambda s, n: _ar(s) <= n[:, None], 1),
    "flipped_ge": (lambda s, n: n[:, None] >= _ar(s), 1),
    "offset": (lambda s, n: _ar(s) + 2 < n[:, None], -2),
    "negated": (lambda s, n: ~(_ar(s) >= n[:, None]), 0),
    "iota_4d": (
        lambda s, n: lax.broadcasted_iota(jnp.int32, (B, H, 1, s), 3) < n[:, None, None, None],
        0,
    ),
}


@pytest.mark.parametrize("name", sorted(KV_SPELLINGS))
def test_kv_lengths_spellings(name):
    keep_fn, shift = KV_SPELLINGS[name]
    fn = _attend(keep_fn)
    q, k, v = _qkv(1, 40)
    lengths = jnp.asarray([0, 17, 40], jnp.int32)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(q, k, v, lengths)
    assert len(report.rewrites) == 1, report
    rewrite = report.rewrites[0]
    assert rewrite.mask == "kv_lengths"
    ops = [op for op in rewrite.spec["score_ops"] if op["op"] == "kvlengths"]
    assert len(ops) == 1 and ops[0]["shift"] == shift and ops[0]["shape"] == [B, 1, 1, 1]
    np.testing.assert_allclose(opt(q, k, v, lengths), fn(q, k, v, lengths), rtol=1e-5, atol=1e-6)


def test_keep_when_false_spelling():
    """``where(j >= L, fill, s)``: the scores survive where the predicate is False."""

    def fn(q, k, v, lengths):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k)
        past = jnp.arange(k.shape[2])[None, None, None, :] >= lengths[:, None, None, None]
        s = jnp.where(past, -jnp.inf, s)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)

    q, k, v = _qkv(2, 24)
    lengths = jnp.asarray([3, 24, 10], jnp.int32)
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert opt.explain(q, k, v, lengths).rewrites[0].mask == "kv_lengths"
    np.testing.assert_allclose(opt(q, k, v, lengths), fn(q, k, v, lengths), rtol=1e-5, atol=1e-6)


# Near misses: each keeps a dense boolean mask (never KvLengths) and stays exact.
NEAR_MISSES = {
    "tail_kept": lambda s, n: _ar(s) >= n[:, None],  # left padding, not a length
    "twice_the_key": lambda s, n: 2 * _ar(s) < n[:, None],
    "float_lengths": lambda s, n: _ar(s) < n[:, None].astype(jnp.float32) + 0.5,
    "varies_over_keys": lambda s, n: _ar(s) < (n[:, None] + _ar(s) % 3),
    "per_query": lambda s, n: (
        lax.broadcasted_iota(jnp.int32, (B, 1, 2, s), 3)
        < n[:, None, None, None] + lax.broadcasted_iota(jnp.int32, (B, 1, 2, s), 2)
    ),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_stay_dense_masks(name):
    fn = _attend(NEAR_MISSES[name])
    q, k, v = _qkv(2, 24)
    lengths = jnp.asarray([5, 24, 11], jnp.int32)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(q, k, v, lengths)
    assert len(report.rewrites) == 1, report
    assert "kv_lengths" not in report.rewrites[0].mask
    np.testing.assert_allclose(opt(q, k, v, lengths), fn(q, k, v, lengths), rtol=1e-5, atol=1e-6)


def test_non_excluding_fill_is_a_dense_mask():
    fn = _attend(lambda s, n: _ar(s) < n[:, None], fill=-1.0)
    q, k, v = _qkv(1, 24)
    lengths = jnp.asarray([5, 24, 0], jnp.int32)
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert opt.explain(q, k, v, lengths).rewrites[0].mask == "key mask"
    np.testing.assert_allclose(opt(q, k, v, lengths), fn(q, k, v, lengths), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the kernel


def _spec(t, s, fill, extra_ops=(), hkv=H, shift=0):
    ops = (Scale(0.25), *extra_ops, KvLengths(0, (B, 1, 1, 1), fill, shift))
    f32 = "float32"
    return AttentionSpec(
        B, H, hkv, t, s, D, D, f32, f32, f32, f32, f32, f32,
        score_ops=ops, extras=(ExtraSpec((B, 1, 1, 1), np.int32),),
    )  # fmt: skip


@functools.cache
def _runner(kernel, spec):
    """``(out, grads)`` of ``kernel`` (None: the reference) for ``spec``, jitted
    once per (kernel, spec): the lengths are an argument, not a constant."""

    def attend(q, k, v, ln):
        if kernel is None:
            return reference_attention(spec, q, k, v, (ln,))
        return kernel.apply(spec, q, k, v, (ln,))

    def run(q, k, v, ln, w):
        loss = lambda *a: jnp.nansum(attend(*a, ln) * w)  # noqa: E731
        return attend(q, k, v, ln), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(run)


def _check_against_reference(spec, lengths, kernel, seed=0):
    q, k, v = _qkv(spec.q_len, spec.kv_len, seed, spec.kv_heads)
    ln = jnp.asarray(np.asarray(lengths, np.int32).reshape(B, 1, 1, 1))
    w = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(spec.out_shape), jnp.float32)
    got = _runner(kernel, spec)(q, k, v, ln, w)
    want = _runner(None, spec)(q, k, v, ln, w)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-6)
    for g, r in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)
    return got[0]


# Shared, so that cases of one spec compile once (`_runner`).
KERNEL_16 = BlockwiseKernel(block_k=16)
KERNEL_32 = BlockwiseKernel(block_k=32)


@pytest.mark.parametrize("fill", [-1e9, -np.inf])
@pytest.mark.parametrize(
    "lengths",
    [
        (0, 7, 100),  # an empty row, a partial chunk, the full cache: single pass
        (3, 1, 30),  # few chunks: the chunk loop
        (0, 0, 0),  # every row empty (every chunk visited)
        (100, 100, 100),  # full cache
    ],
)
def test_decode_path_matches_reference(fill, lengths):
    kernel = KERNEL_16  # 100 keys: 7 chunks, the last one ragged
    spec = _spec(1, 100, fill)
    assert kernel.uses_decode(spec)
    out = _check_against_reference(spec, lengths, kernel)
    empty = np.asarray(lengths) == 0
    if empty.any():  # the original's empty rows: NaN for -inf, else finite
        assert np.isnan(np.asarray(out)[empty]).all() == (fill == -np.inf)
    assert np.isfinite(np.asarray(out)[~empty]).all()


@pytest.mark.parametrize(
    "ops,t,hkv",
    [
        ((Causal(99, -1e9),), 2, H),  # two queries at the end of the cache
        ((), 3, 2),  # grouped-query attention
        ((Softcap(20.0),), 1, H),  # a soft-cap before the lengths
    ],
)
def test_decode_path_variants(ops, t, hkv):
    kernel = KERNEL_32
    spec = _spec(t, 101, -1e9, ops, hkv=hkv, shift=1)
    assert kernel.uses_decode(spec)
    _check_against_reference(spec, (0, 5, 40), kernel)
    _check_against_reference(spec, (100, 60, 2), kernel, seed=3)


def test_decode_path_skips_chunks_past_each_length():
    """Keys in chunks no row reaches are never read: NaN there does not show
    (the original, reading every key, would be NaN; that is what skipping is)."""
    kernel = BlockwiseKernel(block_k=16)
    spec = _spec(1, 128, -1e9)
    q, k, v = _qkv(1, 128)
    k = k.at[:, :, 32:].set(jnp.nan)
    v = v.at[:, :, 32:].set(jnp.nan)
    ln = jnp.asarray(np.array([5, 32, 20], np.int32).reshape(B, 1, 1, 1))
    out = jax.jit(lambda q, k, v: kernel.apply(spec, q, k, v, (ln,)))(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    # Equal to the reference on the first 32 keys, all the rows use.
    short = dataclasses.replace(spec, kv_len=32)
    want = reference_attention(short, q, k[:, :, :32], v[:, :, :32], (ln,))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)


def test_decode_path_skips_each_rows_chunks_past_its_own_length():
    """Per row, not per batch: each row reads only the chunks below its own
    length.  Every key and value from the end of a row's last chunk on is NaN
    (a read would make the row NaN: a zero weight times NaN is NaN), and the
    output equals the reference on clean inputs."""
    kernel = BlockwiseKernel(block_k=16)
    spec = _spec(1, 128, -1e9)
    q, k, v = _qkv(1, 128)
    lengths = np.array([5, 40, 17], np.int32)  # chunks read: 1, 3 and 2 of 8
    read = -(-lengths // 16) * 16
    past = np.arange(128)[None, :] >= read[:, None]  # [B, S]
    poison = jnp.asarray(past[:, None, :, None])
    ln = jnp.asarray(lengths.reshape(B, 1, 1, 1))
    call = jax.jit(lambda q, k, v: kernel.apply(spec, q, k, v, (ln,)))
    out = call(q, jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, reference_attention(spec, q, k, v, (ln,)), rtol=2e-5, atol=2e-6)
    # The poison is where a read would show: one more key per row makes NaN.
    more = jnp.asarray((np.arange(128)[None, :] >= read[:, None] - 1)[:, None, :, None])
    spoiled = np.asarray(call(q, k, jnp.where(more, jnp.nan, v)))
    assert np.isnan(spoiled).any(axis=(1, 2, 3)).all()


def test_long_q_runs_kv_lengths_as_an_element_mask():
    kernel = BlockwiseKernel(block_q=16, block_k=16, head_loop=False)
    spec = _spec(40, 72, -1e9)
    assert not kernel.uses_decode(spec)
    _check_against_reference(spec, (0, 33, 72), kernel)


# --------------------------------------------------------------------------- the choice

CPU = CheckContext(platform="cpu")


def test_cost_model():
    long = DECODE_MIN_KV_LEN
    assert "decode step" in faster_as_written(_plain_spec(1, long), "cpu")
    # Several score rows per kv head (queries, or grouped heads): from 2k keys on.
    assert faster_as_written(_spec(4, long, -1e9), "cpu") is None
    assert faster_as_written(_spec(1, long, -1e9, hkv=H // 4), "cpu") is None
    assert "short kv cache" in faster_as_written(_spec(4, long // 2, -1e9), "cpu")
    # One row per kv head: a matrix-vector product per chunk, kept below 8k keys.
    one_row = faster_as_written(_spec(1, long, -1e9), "cpu")
    assert one_row == (
        f"short kv cache (kv_len={long} < {DECODE_MIN_KV_LEN_ONE_ROW}) for a decode step "
        "with 1 score row per kv head, float32"
    )
    assert faster_as_written(_spec(1, DECODE_MIN_KV_LEN_ONE_ROW, -1e9), "cpu") is None
    # Narrow floats: the kernel computes in float32, and pays from 1k keys on.
    narrow = dataclasses.replace(_spec(4, 1024, -1e9), q_dtype="bfloat16", k_dtype="bfloat16")
    assert DECODE_MIN_KV_LEN_NARROW == 1024 and faster_as_written(narrow, "cpu") is None
    assert "short kv cache" in faster_as_written(_spec(4, 1024, -1e9), "cpu")
    # Batch and heads move no threshold.
    for b, h in ((1, 1), (16, 32)):
        wide = dataclasses.replace(_spec(4, long, -1e9), batch=b, heads=h, kv_heads=h)
        assert faster_as_written(wide, "cpu") is None
    assert "short sequence" in faster_as_written(_plain_spec(64, 256), "cpu")
    assert faster_as_written(_plain_spec(1, 64), "gpu") is None
    reasons = BlockwiseKernel().check(_plain_spec(1, long), CPU)
    assert reasons and reasons[0].startswith("kept: faster as written: decode step")
    explicit = CheckContext(platform="cpu", explicit=True)
    assert BlockwiseKernel().check(_plain_spec(1, long), explicit) == []


def _plain_spec(t, s):
    f32 = "float32"
    return AttentionSpec(B, H, H, t, s, D, D, f32, f32, f32, f32, f32, f32, (Scale(0.25),))


def test_choice_in_the_pass():
    """Default order on CPU: a decode step without lengths is kept as written,
    one with ragged lengths against a long cache is rewritten; naming the
    kernel forces the first."""
    s = DECODE_MIN_KV_LEN
    q, k, v = _qkv(2, s)
    lengths = jnp.asarray([1, s // 4, s], jnp.int32)
    ragged = _attend(lambda n_keys, n: _ar(n_keys) < n[:, None])

    def plain(q, k, v, lengths):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.25
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)

    report = flashpass.optimize(plain).explain(q, k, v, lengths)
    assert not report.rewrites and "kept: faster as written" in report.fallbacks[0].reason
    assert flashpass.optimize(plain, kernel="blockwise").explain(q, k, v, lengths).rewrites
    opt = flashpass.optimize(ragged)
    report = opt.explain(q, k, v, lengths)
    assert report.kernels == ["blockwise"] and report.rewrites[0].mask == "kv_lengths"
    np.testing.assert_allclose(
        jax.jit(opt)(q, k, v, lengths), ragged(q, k, v, lengths), rtol=1e-5, atol=1e-6
    )
