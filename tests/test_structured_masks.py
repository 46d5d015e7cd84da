"""Structured masks as O(T) descriptors: windows, chunks, prefix-LM, segment ids.

* every spelling of `spellings.STRUCTURED` becomes exactly its descriptors
  (no dense mask), computes the original forward and gradient, and hands the
  kernel no ``T x S`` array (checked on the rewritten jaxpr);
* near-misses (off-by-one windows, row-dependent widths, traced positions,
  non-equality id comparisons, non-excluding fills...) keep a dense mask or
  the right, different descriptor, and still compute the original;
* the blockwise kernel skips the tiles a descriptor excludes, and matches the
  float64 reference with skipped tiles, fully masked rows and run-time segment
  skipping, forward and backward.

The context matrix (tests/test_contexts.py) runs every structured spelling's
first call in 8 contexts, since they are in `spellings.POSITIVE`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from t_by_s import kernel_operand_shapes

import flashpass
from flashpass import graph
from flashpass.kernels.blockwise import BlockwiseKernel
from flashpass.kernels.reference import reference_attention
from flashpass.ops import KINDS, BlockCausal, SinkWindow
from flashpass.spec import (
    AttentionSpec,
    Bias,
    Causal,
    Chunk,
    ExtraSpec,
    Prefix,
    Scale,
    Segments,
    Softcap,
    Window,
)

import spellings
from spellings import bnth

_IDS = {"index", "q_index", "kv_index", "fill", "shape", "same"}


_NAMES = {kind.__name__.lower(): kind.__name__ for kind in KINDS}


def _described(spec: dict) -> list[str]:
    """``Window(3, None)``-style names of a reported spec's non-scale ops."""
    out = []
    for op in spec["score_ops"]:
        if op["op"] == "scale":
            continue
        args = [str(v) for k, v in op.items() if k != "op" and k not in _IDS]
        name = _NAMES[op["op"]]
        out.append(f"{name}({', '.join(args)})" if args else name)
    return out


def _grads(fn, args):
    def loss(*a):
        return jnp.sum(jnp.sin(fn(*a)))

    return jax.grad(loss, argnums=(0, 1, 2))(*args)


def _assert_close(a, b, tol=2e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(spellings.STRUCTURED))
def test_spelling_becomes_descriptors(name, rng):
    fn, make, want = spellings.STRUCTURED[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    got = _described(report.rewrites[0].spec)
    assert sorted(got) == sorted(want), got
    # The report's mask column names the descriptors, in a fixed order.
    named = {w.split("(")[0] for w in want}
    words = [kind.word for kind in KINDS if kind.__name__ in named]
    assert report.rewrites[0].mask == "+".join(words)
    # No T x S kernel input: nothing but q/k/v has two sequence-long axes.
    t = spellings.T
    for shape in kernel_operand_shapes(opt.rewritten_jaxpr(*args), constants=False):
        assert sum(d >= t for d in shape) <= 1, (shape, got)
    _assert_close(opt(*args), fn(*args))
    _assert_close(_grads(opt, args[:3] + args[3:]), _grads(fn, args))


# --------------------------------------------------------------------------- near misses


def _window_off_by_one(q, k, v):
    pos = jnp.arange(q.shape[2])
    keep = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= 4)
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -jnp.inf), -1) @ v


def _window_row_dependent(q, k, v):
    pos = jnp.arange(q.shape[2])
    keep = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 2 + pos[:, None] // 8)
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _window_traced_positions(q, k, v, pos):
    # positions from the caller: nothing proves they are 0..T-1 (`PositionMask`)
    keep = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 4)
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _window_soft_fill(q, k, v):
    # a fill of -10 does not exclude keys: the exact dense mask must stay
    pos = jnp.arange(q.shape[2])
    keep = jnp.abs(pos[:, None] - pos[None, :]) <= 2
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -10.0), -1) @ v


def _window_gapped(q, k, v):
    # two bands with a gap: not one window
    pos = jnp.arange(q.shape[2])
    d = pos[:, None] - pos[None, :]
    keep = (d == 0) | (d == 3)
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _segments_ordered(q, k, v, ids):
    # ``<=`` of segment ids: not packed documents (an O(T) comparison of data)
    keep = ids[:, None, :, None] <= ids[:, None, None, :]
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _segments_float(q, k, v, ids):
    same = ids.astype(jnp.float32)[:, None, :, None] == ids.astype(jnp.float32)[:, None, None, :]
    return jax.nn.softmax(jnp.where(same, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _chunk_mismatched(q, k, v):
    # query chunks of 4, key chunks of 5: not a chunk mask (ids of its own)
    pos = jnp.arange(q.shape[2])
    keep = (pos[:, None] // 4) == (pos[None, :] // 5)
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _prefix_shifted(q, k, v):
    # causal part with an offset: not a prefix-LM mask as defined
    pos = jnp.arange(q.shape[2])
    keep = (pos[None, :] <= pos[:, None] + 1) | (pos[None, :] < 5)
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _sink_window_flipped(q, k, v):
    # ``j > n``: the keys after the sinks, not the sinks
    pos = jnp.arange(q.shape[2])
    i, j = pos[:, None], pos[None, :]
    keep = (j > 2) | ((j <= i) & (j > i - 4))
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _sink_window_anticausal(q, k, v):
    # the window looks ahead (``j >= i``): not StreamingLLM's causal window
    pos = jnp.arange(q.shape[2])
    i, j = pos[:, None], pos[None, :]
    keep = (j < 2) | ((j >= i) & (j < i + 4))
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _sink_window_on_queries(q, k, v):
    # the first queries see everything: a bound on i, not on the keys
    pos = jnp.arange(q.shape[2])
    i, j = pos[:, None], pos[None, :]
    keep = (i < 2) | ((j <= i) & (j > i - 4))
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _sink_window_shifted(q, k, v):
    # a causal edge one past the diagonal: not the op as defined
    pos = jnp.arange(q.shape[2])
    i, j = pos[:, None], pos[None, :]
    keep = (j < 2) | ((j <= i + 1) & (j > i - 4))
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _block_causal_shifted(q, k, v):
    # query blocks one position ahead of the key blocks: not the op as defined
    pos = jnp.arange(q.shape[2])
    keep = ((pos[:, None] + 1) // 4) >= (pos[None, :] // 4)
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _block_causal_uneven(q, k, v):
    # query blocks of 4 against key blocks of 3
    pos = jnp.arange(q.shape[2])
    keep = (pos[:, None] // 4) >= (pos[None, :] // 3)
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


def _block_anticausal(q, k, v):
    # the blocks after the row's own: keys ahead, not behind
    pos = jnp.arange(q.shape[2])
    keep = (pos[:, None] // 4) <= (pos[None, :] // 4)
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


MAXTEXT_FILL = -0.7 * float(np.finfo(np.float32).max)


def _additive_ids(q, k, v, ids):
    """MaxText's packed-segment mask: made additive, then read back with ``>=``."""
    t = q.shape[2]
    keep = (ids[:, :, None] == ids[:, None, :])[:, None] & jnp.tril(jnp.ones((t, t), bool))
    additive = jnp.where(keep, 0.0, MAXTEXT_FILL)
    s = jnp.where(additive >= MAXTEXT_FILL * 0.5, q @ k.swapaxes(-1, -2) * 0.3, MAXTEXT_FILL)
    return jax.nn.softmax(s, -1) @ v


def _additive_ids_inverted(q, k, v, ids):
    # ``<`` picks the fill: the comparison is ``not keep``, read as a dense mask
    keep = ids[:, None, :, None] == ids[:, None, None, :]
    additive = jnp.where(keep, 0.0, MAXTEXT_FILL)
    s = jnp.where(additive < MAXTEXT_FILL * 0.5, MAXTEXT_FILL, q @ k.swapaxes(-1, -2))
    return jax.nn.softmax(s, -1) @ v


def _additive_ids_traced_threshold(q, k, v, ids, threshold):
    keep = ids[:, None, :, None] == ids[:, None, None, :]
    additive = jnp.where(keep, 0.0, MAXTEXT_FILL)
    s = jnp.where(additive >= threshold, q @ k.swapaxes(-1, -2), MAXTEXT_FILL)
    return jax.nn.softmax(s, -1) @ v


def _with_ids(rng):
    ids = np.sort(rng.integers(0, 4, (spellings.B, spellings.T)), axis=1).astype(np.int32)
    return (*bnth(rng), jnp.asarray(ids))


def _outer_not_separable(q, k, v, mask):
    # one side of the product varies over queries and keys: no O(T) reading
    t = q.shape[2]
    m = mask[:, None, None, :] * (mask[:, None, :, None] + jnp.tril(jnp.ones((t, t), jnp.int32)))
    s = jnp.where(m != 0, q @ k.swapaxes(-1, -2) * 0.3, -1e9)
    return jax.nn.softmax(s, -1) @ v


def _outer_soft_fill(q, k, v, mask):
    # a fill of -5 does not exclude keys: the product stays the dense mask it is
    m = mask[:, None, None, :] * mask[:, None, :, None]
    return jax.nn.softmax(jnp.where(m != 0, q @ k.swapaxes(-1, -2), -5.0), -1) @ v


def _outer_two_valued(q, k, v, mask):
    # a product of two 0/1 vectors is their conjunction: a query mask and a key
    # mask, each its own op (which more kernels take than an `OuterMask`)
    m = mask.astype(bool).astype(jnp.int32)
    keep = (m[:, None, :, None] * m[:, None, None, :]) > 0
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


NEAR_MISSES = {
    "window_off_by_one": (_window_off_by_one, bnth, ["Causal(0)", "Window(4, None)"]),
    "window_row_dependent": (_window_row_dependent, bnth, ["Causal(0)", "Mask"]),
    "window_traced_positions": (
        _window_traced_positions,
        lambda r: (*bnth(r), jnp.arange(spellings.T)),
        # `j <= i` is compared as data; `pos[i] - pos[j] < 4` is no window (nothing
        # proves the positions are 0..T-1): the difference of the two vectors,
        # recomputed exactly per tile (not a dense mask any more)
        ["OuterMask(sub, lt, 4, True, True)", "PositionMask(le, 0, 0)"],
    ),
    "window_soft_fill": (_window_soft_fill, bnth, ["Mask"]),
    "outer_not_separable": (_outer_not_separable, spellings._padding_args, ["Mask"]),
    "outer_soft_fill": (_outer_soft_fill, spellings._padding_args, ["Mask"]),
    "outer_two_valued": (_outer_two_valued, spellings._padding_args, ["Mask", "Mask"]),
    "window_gapped": (_window_gapped, bnth, ["Mask"]),
    "segments_ordered": (_segments_ordered, _with_ids, ["PositionMask(ge, 0, 0)"]),
    "segments_float": (_segments_float, _with_ids, ["Mask"]),
    "chunk_mismatched": (_chunk_mismatched, bnth, ["Segments"]),
    "prefix_shifted": (_prefix_shifted, bnth, ["Mask"]),
    "sink_window_flipped": (_sink_window_flipped, bnth, ["Mask"]),
    "sink_window_anticausal": (_sink_window_anticausal, bnth, ["Mask"]),
    "sink_window_on_queries": (_sink_window_on_queries, bnth, ["Mask"]),
    "sink_window_shifted": (_sink_window_shifted, bnth, ["Mask"]),
    "block_causal_shifted": (_block_causal_shifted, bnth, ["Mask"]),
    "block_causal_uneven": (_block_causal_uneven, bnth, ["Mask"]),
    "block_anticausal": (_block_anticausal, bnth, ["Mask"]),
    "additive_ids_inverted": (_additive_ids_inverted, _with_ids, ["Mask"]),
    "additive_ids_traced_threshold": (
        _additive_ids_traced_threshold,
        lambda r: (*_with_ids(r), jnp.float32(MAXTEXT_FILL * 0.5)),
        ["Mask"],
    ),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_miss_keeps_an_exact_reading(name, rng):
    fn, make, want = NEAR_MISSES[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, str(report)
    assert sorted(_described(report.rewrites[0].spec)) == sorted(want)
    _assert_close(opt(*args), fn(*args))


def test_outer_mask_wraps_as_the_program_does(rng):
    """The combination is recomputed in the arrays' own dtype: an int32 product
    of two nonzero entries that wraps to 0 excludes its key, as the program's."""
    q, k, v, mask = spellings._padding_args(rng)
    mask = mask.at[0, 3].set(65536).at[0, 9].set(65536)  # 65536 * 65536 == 0 in int32
    args = (q, k, v, mask)
    opt = flashpass.optimize(spellings.deberta_padding, kernel="blockwise")
    (r,) = opt.explain(*args).rewrites
    assert _described(r.spec) == ["OuterMask(mul, ne, 0, False, True)"], r.spec
    _assert_close(opt(*args), spellings.deberta_padding(*args))
    _assert_close(_grads(opt, args), _grads(spellings.deberta_padding, args))


def test_additive_mask_read_back_by_comparison(rng):
    # MaxText's apply_mask_to_logits: where(mask >= fill / 2, s, fill) of an additive
    # where(keep, 0, fill) is where(keep, s, fill), so keep's factors become descriptors.
    args = _with_ids(rng)
    opt = flashpass.optimize(_additive_ids, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert sorted(_described(report.rewrites[0].spec)) == ["Causal(0)", "Segments"]
    for shape in kernel_operand_shapes(opt.rewritten_jaxpr(*args), constants=False):
        assert sum(d >= spellings.T for d in shape) <= 1, shape
    _assert_close(opt(*args), _additive_ids(*args))
    _assert_close(_grads(opt, args), _grads(_additive_ids, args))


def test_other_kernels_decline_descriptors_with_a_reason(rng):
    q, k, v = bnth(rng, t=1024, s=1024)
    order = ["splash", "blockwise"]
    fn = spellings.prefix_lm
    report = flashpass.optimize(fn, kernel=order, interpret=True).explain(q, k, v)
    assert report.kernels == ["blockwise"]
    reasons = " ".join(report.rewrites[0].rejected["splash"])
    assert "prefix" in reasons
    # Splash takes a causal window as its LocalMask.
    window = flashpass.optimize(spellings.window_iota, kernel=order, interpret=True)
    report = window.explain(q, k, v)
    assert report.kernels == ["splash"] and report.rewrites[0].mask == "causal+window"


# --------------------------------------------------------------------------- the kernel

B, H, D = 2, 2, 8


def _spec(t, s, ops, extras=()):
    f32 = np.float32
    return AttentionSpec(B, H, H, t, s, D, D, f32, f32, f32, f32, f32, f32, tuple(ops), extras)


_SEG_EXTRAS = lambda t, s: (ExtraSpec((B, 1, t, 1), np.int32), ExtraSpec((B, 1, 1, s), np.int32))  # noqa: E731

KERNEL_CASES = {
    "causal_window": lambda t, s: [Scale(0.3), Causal(0, -math.inf), Window(7, None, -math.inf)],
    "window_both_ways": lambda t, s: [Window(5, 3, -1e9)],
    "chunk_causal": lambda t, s: [Chunk(8, -1e30), Causal(0, -1e30)],
    "prefix": lambda t, s: [Prefix(13, -1e9)],
    "segments_causal": lambda t, s: [Segments(0, 1, -1e9), Causal(0, -1e9)],
    "segments_inf": lambda t, s: [Segments(0, 1, -math.inf)],
    "segments_softcap": lambda t, s: [Segments(0, 1, -1e9), Softcap(5.0)],
    "window_then_softcap": lambda t, s: [Window(3, None, -1e9), Causal(0, -1e9), Softcap(3.0)],
    # (40 rows in tiles of 8: the later query blocks visit the sink tile, skip a gap.)
    "sink_window": lambda t, s: [Scale(0.3), SinkWindow(3, 6, -1e9)],
    "sink_window_inf": lambda t, s: [SinkWindow(3, 6, -math.inf)],
    "sink_window_softcap": lambda t, s: [SinkWindow(10, 5, -1e9), Softcap(3.0)],
    # (blocks of 12 against tiles of 8: a query tile's keys end inside a tile.)
    "block_causal": lambda t, s: [Scale(0.3), BlockCausal(12, -1e9)],
    "block_causal_inf": lambda t, s: [BlockCausal(12, -math.inf)],
}


@pytest.mark.parametrize("blocks", [(8, 8), pytest.param((13, 7), marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_blockwise_matches_reference(case, blocks, rng):
    t = s = 40
    ops = KERNEL_CASES[case](t, s)
    segmented = any(isinstance(op, Segments) for op in ops)
    spec = _spec(t, s, ops, _SEG_EXTRAS(t, s) if segmented else ())
    q, k, v = (jnp.asarray(rng.standard_normal((B, H, t, D)), jnp.float32) for _ in range(3))
    extras = ()
    if segmented:
        ids = np.sort(rng.integers(0, 4, (B, t)), axis=1).astype(np.int32)
        kv = ids.copy()
        kv[1][kv[1] == kv[1, -1]] = 99  # the last document's queries find no key
        extras = (jnp.asarray(ids[:, None, :, None]), jnp.asarray(kv[:, None, None, :]))
    kernel = BlockwiseKernel(*blocks, head_loop=False)

    def ours(q, k, v):
        return kernel.apply(spec, q, k, v, extras)

    def ref(q, k, v):
        return reference_attention(spec, q, k, v, extras)

    out, want = ours(q, k, v), ref(q, k, v)
    finite = np.isfinite(np.asarray(want))
    assert np.array_equal(np.isfinite(np.asarray(out)), finite)
    np.testing.assert_allclose(np.asarray(out)[finite], np.asarray(want)[finite], atol=2e-5)
    if np.all(finite):
        _assert_close(_grads(ours, (q, k, v)), _grads(ref, (q, k, v)), 5e-5)


def test_blockwise_skips_what_descriptors_exclude():
    t = s = 2048
    kernel = BlockwiseKernel(128, 128, head_loop=False)
    causal = kernel.plan(_spec(t, s, [Causal(0, -math.inf)]))
    window = kernel.plan(_spec(t, s, [Causal(0, -math.inf), Window(127, None, -math.inf)]))
    chunk = kernel.plan(_spec(t, s, [Chunk(256, -math.inf), Causal(0, -math.inf)]))
    assert causal.tiles_computed() == 16 * 17 // 2
    assert window.tiles_computed() == 16 + 15  # the diagonal tile and the one before
    assert chunk.tiles_computed() == 8 * 3  # per chunk: 2 diagonal tiles, 1 full
    # Sink tokens and a window: the sink tile, then the window's two tiles;
    # the tiles between are skipped (from query block 3 on).
    sinks = kernel.plan(_spec(t, s, [SinkWindow(4, 128, -math.inf)]))
    assert sinks.tiles_computed() == 1 + 2 + 3 + 13 * 3
    assert sinks.khead == (0, 0, 0) + (1,) * 13
    assert sinks.kstart[3:] == tuple(range(2, 15)) and sinks.kend[3:] == tuple(range(4, 17))
    assert sinks.qstart[0] == 0 and sinks.qend[0] == 16  # every query sees the sinks
    # Blocks of 256, two query tiles each: both visit every key tile up to
    # their block's end.
    blocks = kernel.plan(_spec(t, s, [BlockCausal(256, -math.inf)]))
    assert blocks.tiles_computed() == sum(2 * (b // 2 + 1) for b in range(16))
    # Window tiles entirely inside the band run without a mask.
    plan = kernel.plan(_spec(t, s, [Window(300, 300, -math.inf)]))
    assert any(e > f for f, e in zip(plan.kfs, plan.kfull, strict=True))
    assert plan.ops_plain == ()


def test_segments_skip_tiles_at_run_time(rng):
    """Four documents of 64 in a row of 256: tiles across documents are skipped
    (lax.cond), with the same result as computing them."""
    t = 256
    spec = _spec(t, t, [Segments(0, 1, -1e9), Causal(0, -1e9)], _SEG_EXTRAS(t, t))
    ids = np.repeat(np.arange(4, dtype=np.int32), 64)[None].repeat(B, 0)
    extras = (jnp.asarray(ids[:, None, :, None]), jnp.asarray(ids[:, None, None, :]))
    q, k, v = (jnp.asarray(rng.standard_normal((B, H, t, D)), jnp.float32) for _ in range(3))
    kernel = BlockwiseKernel(32, 32, head_loop=False)
    out = kernel.apply(spec, q, k, v, extras)
    want = reference_attention(spec, q, k, v, extras)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)
    text = str(jax.make_jaxpr(lambda *a: kernel.apply(spec, *a, extras))(q, k, v))
    assert "cond" in text
    dense = dataclasses.replace(spec, score_ops=(Causal(0, -1e9),), extras=())
    assert kernel.plan(spec).tiles_computed() == kernel.plan(dense).tiles_computed()


def test_default_tiles_follow_the_band():
    """Default tiles are at most a quarter of a window's or chunk's width (at
    least 64), so the tiles a query block visits hug the band; unbounded
    bands keep the usual sizes."""
    from flashpass.kernels.blockwise import default_blocks
    from flashpass.kernels.blockwise.plan import band_width

    n, inf = 8192, -math.inf
    window = _spec(n, n, [Causal(0, inf), Window(511, None, inf)])
    assert band_width(window) == 512
    assert default_blocks(window) == default_blocks(window, backward=True) == (128, 128)
    assert BlockwiseKernel().plan(window).bq == 128  # under the head loop too
    assert default_blocks(_spec(n, n, [Window(512, 511, inf)])) == (256, 256)
    assert default_blocks(_spec(n, n, [Chunk(1024, inf), Causal(0, inf)])) == (256, 256)
    assert default_blocks(_spec(n, n, [Window(8, 0, inf)])) == (64, 64)
    open_right = _spec(n, n, [Window(511, None, inf)])
    assert band_width(open_right) is None
    assert default_blocks(open_right) == default_blocks(_spec(n, n, []))
    # A window that cannot skip (a bias after it) keeps the usual tiles.
    assert band_width(_spec(n, n, [Window(511, 0, inf), Bias(0, (1, 1, n, n), "float32")])) is None


def test_segment_tiles_inside_one_document_drop_the_mask(rng):
    """A tile whose query and key ids are all one document runs without the
    segment mask (`segments_case`); forward and gradient are unchanged."""
    from flashpass.kernels.blockwise.bounds import (
        SEGMENTS_APART,
        SEGMENTS_INSIDE,
        SEGMENTS_MIXED,
        segments_case,
    )

    def case(q, k):
        return int(segments_case(jnp.asarray(q)[:, None], jnp.asarray(k)[None, :]))

    assert case([2, 2], [2, 2]) == SEGMENTS_INSIDE
    assert case([2, 2], [2, 3]) == SEGMENTS_MIXED
    assert case([1, 2], [2, 2]) == SEGMENTS_MIXED
    assert case([1, 1], [2, 2]) == SEGMENTS_APART

    t = 128
    spec = _spec(t, t, [Segments(0, 1, -1e9), Causal(0, -1e9)], _SEG_EXTRAS(t, t))
    ids = np.repeat(np.arange(4, dtype=np.int32), 32)[None].repeat(B, 0)
    ids[1] = np.repeat(np.arange(2, dtype=np.int32), 64)  # other documents per row
    extras = (jnp.asarray(ids[:, None, :, None]), jnp.asarray(ids[:, None, None, :]))
    q, k, v = (jnp.asarray(rng.standard_normal((B, H, t, D)), jnp.float32) for _ in range(3))
    kernel = BlockwiseKernel(16, 16, head_loop=False)

    def ours(q, k, v):
        return kernel.apply(spec, q, k, v, extras)

    def ref(q, k, v):
        return reference_attention(spec, q, k, v, extras)

    _assert_close(ours(q, k, v), ref(q, k, v))
    _assert_close(_grads(ours, (q, k, v)), _grads(ref, (q, k, v)), 5e-5)


def test_large_window_is_recognised_symbolically(monkeypatch):
    """A window over 8192 positions is proven without folding a T x S mask: with
    constant folding refused above a row's worth of elements (far below the
    mask's 8192 x 8192), the window is still found."""
    monkeypatch.setattr(graph, "FOLD_LIMIT", 8192)
    q = jax.ShapeDtypeStruct((2, 2, 8192, 64), jnp.float32)

    def fn(q, k, v):
        t = q.shape[2]
        band = jnp.tril(jnp.ones((t, t), bool)) ^ jnp.tril(jnp.ones((t, t), bool), -512)
        s = jnp.where(band[None, None], q @ k.swapaxes(-1, -2), -jnp.inf)
        return jax.nn.softmax(s, -1) @ v

    report = flashpass.optimize(fn, kernel="blockwise").explain(q, q, q)
    assert _described(report.rewrites[0].spec) == ["Window(511, 0)"]


def test_window_mask_built_with_lax_select(rng):
    """``lax.select`` of 0/1 constants on an iota difference (an int mask)."""

    def fn(q, k, v):
        i = lax.broadcasted_iota(jnp.int32, (q.shape[2], k.shape[2]), 0)
        j = lax.broadcasted_iota(jnp.int32, (q.shape[2], k.shape[2]), 1)
        band = lax.select(i - j < 3, jnp.ones_like(i), jnp.zeros_like(i)) * (j <= i)
        return jax.nn.softmax(jnp.where(band > 0, q @ k.swapaxes(-1, -2), -1e9), -1) @ v

    args = bnth(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert _described(opt.explain(*args).rewrites[0].spec) == ["Window(2, 0)"]
    _assert_close(opt(*args), fn(*args))


def test_mask_with_scalar_operands_is_read_without_error(rng):
    # jnp.remainder combines [1, S] positions with rank-0 constants: the
    # diagonal reader broadcasts those (it once indexed their missing axes).
    def fn(q, k, v):
        t, s_len = q.shape[2], k.shape[2]
        i, j = jnp.arange(t)[:, None], jnp.arange(s_len)[None, :]
        keep = (j <= i) & ((i - j) % 3 != 1)  # strided: no descriptor, a dense mask
        s = jnp.where(keep, jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3, -1e9)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)

    q, k, v = spellings.bnth(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    (rewrite,) = opt.explain(q, k, v).rewrites
    assert "dense" in rewrite.mask, rewrite.spec
    _assert_close(opt(q, k, v), fn(q, k, v))


# --------------------------------------------------------------------------- recogniser order


def _sink_window_spanning_every_query(q, k, v):
    # a window as long as the sequence: ``(j < 2) | (j <= i)``, a prefix-LM mask
    pos = jnp.arange(q.shape[2])
    i, j = pos[:, None], pos[None, :]
    keep = (j < 2) | ((j <= i) & (j > i - q.shape[2]))
    return jax.nn.softmax(jnp.where(keep, q @ k.swapaxes(-1, -2), -1e9), -1) @ v


#: The order the declared ranks give the structured-mask recognisers.
MASK_ORDER = [
    "lengths.kv_lengths",
    "positions.prefix_lengths",
    "positions.position_mask",
    "structured.recognise_diagonal",
    "structured.recognise_prefix",
    "structured.recognise_chunk_or_segments",
    "sink_window.recognise_sink_window",
    "block_causal.recognise_block_causal",
    "outer_mask.recognise_outer_mask",
]


def test_recognisers_are_tried_in_the_declared_order():
    """The registries hold every recogniser in the order their declared ranks
    give, whatever order their modules were imported in; a rank another holds
    is refused."""
    from flashpass.patterns import chain, masks

    chain.ensure_loaded()
    names = [masks.recogniser_name(f) for f in masks.MASK_RECOGNISERS]
    assert names == MASK_ORDER
    names = [masks.recogniser_name(f) for f in masks.BIAS_RECOGNISERS]
    assert names == ["alibi.alibi"]
    before = list(masks.MASK_RECOGNISERS)

    def undeclared(build, factor, keep_when, fill):
        return False

    with pytest.raises(ValueError, match="not an int of its own"):
        masks.mask_recogniser(before[2].rank)(undeclared)
    assert masks.MASK_RECOGNISERS == before


def test_overlapping_readings_follow_the_declared_order(rng, monkeypatch):
    """A sink window whose window spans every query is also a prefix-LM mask:
    in the declared order it is a `Prefix`; tried the other way round, the same
    factor would be a `SinkWindow` (the order decides the op)."""
    from flashpass.patterns import masks

    args = bnth(rng)
    fn = _sink_window_spanning_every_query
    report = flashpass.optimize(fn, kernel="blockwise").explain(*args)
    assert [d.split("(")[0] for d in _described(report.rewrites[0].spec)] == ["Prefix"]
    monkeypatch.setattr(masks, "MASK_RECOGNISERS", masks.MASK_RECOGNISERS[::-1])
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert [d.split("(")[0] for d in _described(report.rewrites[0].spec)] == ["SinkWindow"]
    _assert_close(opt(*args), fn(*args))
