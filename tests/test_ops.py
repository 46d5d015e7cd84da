"""The score-op protocol (`flashpass.ops`): each kind's forms agree.

For every positional kind, the element form (`keep`), the normal form
(`key_ranges`) and the tile form (`tile_state`) are checked against each
other by brute force over small grids, so a kind whose forms disagree fails
here before any kernel runs it.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from flashpass.ops import (
    DESCRIPTORS,
    EXCLUDED,
    KINDS,
    STRUCTURED,
    Positional,
    Positions,
    SinkWindow,
)
from flashpass.spec import (
    Alibi,
    Causal,
    Chunk,
    Mask,
    PositionMask,
    Prefix,
    PrefixLengths,
    Scale,
    Softcap,
    Window,
    fill_after,
)

T, S = 13, 17

POSITIONAL = [
    Causal(0, -1e9),
    Causal(3, -1e9),
    Window(2, 0, -1e9),
    Window(3, 2, -1e9),
    Window(1, None, -1e9),
    Chunk(4, -1e9),
    Chunk(5, -1e9),
    Prefix(3, -1e9),
    SinkWindow(3, 4, -1e9),
    SinkWindow(1, 1, -1e9),
]


def _dense(op):
    qi, kj = np.arange(T)[:, None], np.arange(S)[None, :]
    return np.broadcast_to(np.asarray(op.keep(qi, kj, [])), (T, S))


def _from_ranges(op):
    keep = np.zeros((T, S), bool)
    for i in range(T):
        for lo, hi in op.key_ranges(i):
            lo = 0 if lo is None else max(lo, 0)
            hi = S if hi is None else min(hi, S)
            keep[i, lo:hi] = True
    return keep


@pytest.mark.parametrize("op", POSITIONAL, ids=repr)
def test_keep_equals_key_ranges(op):
    assert np.array_equal(_dense(op), _from_ranges(op))
    # The generic element form from the ranges agrees with the kind's own.
    qi, kj = np.arange(T)[:, None], np.arange(S)[None, :]
    generic = np.broadcast_to(Positional.keep(op, qi, kj, []), (T, S))
    assert np.array_equal(generic, _dense(op))


@pytest.mark.parametrize("op", POSITIONAL, ids=repr)
def test_tile_state_matches_brute_force(op):
    keep = _dense(op)
    for r0, c0 in itertools.product(range(0, T, 3), range(0, S, 4)):
        for r1, c1 in ((min(r0 + 2, T - 1), min(c0 + 3, S - 1)), (r0, c0)):
            tile = keep[r0 : r1 + 1, c0 : c1 + 1]
            empty, full = op.tile_state(*(np.asarray(x) for x in (r0, r1, c0, c1)))
            assert bool(empty) == (not tile.any()), (r0, r1, c0, c1)
            if len(op.key_ranges(0)) == 1:
                assert bool(full) == bool(tile.all()), (r0, r1, c0, c1)
            elif full:  # several ranges: "full" may only be claimed when true
                assert tile.all()


@pytest.mark.parametrize("op", POSITIONAL, ids=repr)
def test_meets_traced_agrees_with_numpy(op):
    # The ring asks with traced block offsets; bounds with numpy tables.
    r0, r1, c0, c1 = 8, 11, 2, 5
    traced = op.meets(*(jnp.int32(x) for x in (r0, r1, c0, c1)))
    assert bool(traced) == bool(op.meets(*(np.int64(x) for x in (r0, r1, c0, c1))))
    assert bool(traced) == bool(_dense(op)[r0 : r1 + 1, c0 : c1 + 1].any())


def test_positions_transposed_reads_the_same_entries():
    q, k = jnp.arange(5), jnp.arange(7)
    qi, kj = Positions((5, 7), q, k).grid()
    qt, kt = Positions((7, 5), -k, -q, transposed=True).grid()
    op = Window(1, 2, -1e9)
    assert np.array_equal(np.asarray(op.keep(qi, kj, [])).T, np.asarray(op.keep(qt, kt, [])))


def test_at_offset_forms():
    assert Causal(0, -1e9).at_offset(-20, 8, 8) == EXCLUDED
    assert Causal(0, -1e9).at_offset(16, 8, 8) is None  # every key kept
    assert Causal(0, -1e9).at_offset(0, 8, 8) == Causal(0, -1e9)
    assert isinstance(Chunk(4, -1e9).at_offset(8, 8, 8), str)  # depends on the device
    mask = Mask(0, (1, 1, 32, 32), -1e9)
    assert mask.at_offset(8, 8, 8).shape == (1, 1, 8, 8)


def test_fill_after_loops_over_ops():
    assert fill_after(-1e9, (Scale(0.5),)) == -5e8
    assert fill_after(-1e9, (Softcap(30.0),)) == pytest.approx(-30.0)


def test_tables_come_from_the_kinds():
    assert list(DESCRIPTORS)[:6] == ["causal", "mask", "key_mask", "bias", "softcap", "gqa"]
    for kind in KINDS:
        assert set(kind.descriptors_doc) <= set(DESCRIPTORS)
    assert set(STRUCTURED) == {kind for kind in KINDS if kind.structured}
    words = [kind.word for kind in KINDS if kind.word]
    assert len(words) == len(set(words))


# --------------------------------------------------------------------------- data-dependent kinds


def _data_extras():
    """Extras of the data-dependent kinds on a [2, 1, T, S] block: ALiBi
    slopes per head, prefix lengths per example, positions per example."""
    rng = np.random.default_rng(0)
    slopes = jnp.asarray(rng.standard_normal((1, 2, 1, 1)), jnp.float32)
    lengths = jnp.asarray([[[[0]]], [[[5]]]], jnp.int32)
    pos = np.stack([np.arange(S), np.r_[np.arange(6), np.arange(S - 6)]]).astype(np.int32)
    return [slopes, lengths, jnp.asarray(pos[:, None, :T, None]), jnp.asarray(pos[:, None, None])]


def _brute(op, extras):
    """The op's definition entry by entry ([2, 2, T, S] of scores 0)."""
    slopes, lengths, q_pos, kv_pos = (np.asarray(x) for x in extras)
    out = np.zeros((2, 2, T, S))
    for b, h, i, j in itertools.product(range(2), range(2), range(T), range(S)):
        if type(op).__name__ == "Alibi":
            out[b, h, i, j] = slopes[0, h, 0, 0] * (j - op.query_coef * i + op.offset)
        elif type(op).__name__ == "PrefixLengths":
            keep = j <= i or j < lengths[b, 0, 0, 0] + op.shift
            out[b, h, i, j] = 0 if keep else op.fill
        else:
            k, q = kv_pos[b, 0, 0, j] + op.kv_add, q_pos[b, 0, i, 0] + op.q_add
            keep = {"lt": k < q, "le": k <= q, "gt": k > q, "ge": k >= q}[op.cmp]
            out[b, h, i, j] = 0 if keep else op.fill
    return out


DATA_OPS = [
    Alibi(0, (1, 2, 1, 1), 1, 0),
    Alibi(0, (1, 2, 1, 1), 0, 3),
    PrefixLengths(1, (2, 1, 1, 1), -1e9, 0),
    PrefixLengths(1, (2, 1, 1, 1), -1e9, 1),
    PositionMask(2, 3, "gt", -1e9, 0, -3),
    PositionMask(2, 3, "le", -1e9),
]


@pytest.mark.parametrize("op", DATA_OPS, ids=repr)
def test_data_kinds_apply_their_definition_also_transposed(op):
    extras = _data_extras()
    s = jnp.zeros((2, 2, T, S), jnp.float32)
    q, k = jnp.arange(T), jnp.arange(S)
    got = op.apply(s, extras, Positions(s.shape, q, k, kv_len=S))
    np.testing.assert_allclose(np.asarray(got), _brute(op, extras), rtol=1e-6)
    # The blockwise backward's key-major tile: extras and positions transposed.
    ext = [jnp.swapaxes(x, -1, -2) for x in extras]
    st = jnp.zeros((2, 2, S, T), jnp.float32)
    tr = op.apply(st, ext, Positions(st.shape, -k, -q, transposed=True, kv_len=S))
    np.testing.assert_allclose(np.asarray(tr).swapaxes(-1, -2), np.asarray(got), rtol=1e-6)


def test_data_kinds_at_offset():
    assert Alibi(0, (1, 2, 1, 1), 1, 2).at_offset(8, 8, 8) == Alibi(0, (1, 2, 1, 1), 1, -6)
    assert isinstance(Alibi(0, (1, 2, 1, 1), 0).at_offset(8, 8, 8), str)
    assert isinstance(PrefixLengths(0, (2, 1, 1, 1), -1e9).at_offset(0, 8, 8), str)
    op = PositionMask(0, 1, "lt", -1e9)
    assert op.at_offset(8, 8, 8) == op
    assert Alibi(0, (1, 2, 1, 1), 1).grad_extras() == (0,)
    assert op.grad_extras() == ()
