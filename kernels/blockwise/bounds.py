"""Which tiles the blockwise kernel visits: bounds from the structured score ops.

The structured ops (`ScoreOp.structured`: causal, window, chunk, prefix,
segment ids) exclude keys by position or segment.  Where they form one
run of ops with one fill, followed only by Scale/Softcap (`skip_run`), every
excluded key ends with the same score ``c``, so a tile they exclude entirely
need not be computed: its keys are folded in by a closed form (a no-op when
``c`` is ``-inf`` or any row keeps a key).

`tile_table` classifies every (query tile, key tile) pair from the static ops
exactly, by interval arithmetic on the tile's row and column ranges: empty,
partial (element masks needed) or full (the static ops keep every entry).
Per query block the visited key tiles are one range, and so are the full ones
(each op's kept keys per row are one interval whose ends grow with the row),
and likewise per key block; an op keeping a fixed first range of keys too
(sink tokens) adds a head of key tiles from 0 before a query block's range.
Segment ids are data: tiles in the visited range are skipped at run time
when their query and key id ranges are disjoint, and run without the element
mask when all their ids are one (`segments_case`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from flashpass.spec import AttentionSpec, Segments


def skip_run(spec: AttentionSpec) -> tuple[int, int] | None:
    """``(first, last)`` positions of the structured ops when the blocks they
    exclude may be skipped: one consecutive run of them, one fill, and only
    Scale/Softcap (or the non-score Dropout/Sink) after it (so every excluded
    key ends with one score)."""
    ops = spec.ops
    at = [i for i, op in enumerate(ops) if op.structured]
    if not at:
        return None
    first, last = at[0], at[-1]
    if last - first + 1 != len(at) or len({ops[i].fill for i in at}) != 1:
        return None
    if not all(op.uniform for op in ops[last + 1 :]):
        return None
    c = spec.final_fill(last, ops[last].fill)
    if not (math.isfinite(c) or c == -math.inf):
        return None
    if spec.dropout is not None and c != -math.inf:
        # Skipped keys with a finite score are folded in by a closed form that
        # cannot drop them one by one: with dropout, only weight-0 keys are skipped.
        return None
    return first, last


def tile_table(static_ops, T: int, S: int, bq: int, bk: int, nq: int, nk: int):
    """``(empty, full)`` boolean ``[nq, nk]`` tables for ``static_ops``."""
    iq = np.arange(nq)[:, None]
    ik = np.arange(nk)[None, :]
    r0, r1 = iq * bq, np.minimum((iq + 1) * bq, T) - 1
    c0, c1 = ik * bk, np.minimum((ik + 1) * bk, S) - 1
    empty = np.zeros((nq, nk), bool)
    full = np.ones((nq, nk), bool)
    for op in static_ops:
        e, f = op.tile_state(r0, r1, c0, c1)
        empty |= e
        full &= f
    return empty, full & ~empty


def ranges(visited: np.ndarray, full: np.ndarray, head: bool = False):
    """``(start, full_start, full_end, end)`` of one row of a tile table: tiles
    ``[start, end)`` are visited, ``[full_start, full_end)`` of them full.
    With ``head``, ``(head, start, ...)``: visited tiles in two runs, the
    first from tile 0 (sink keys before a band), give tiles ``[0, head)``
    (all edge tiles) and the second run; else ``head`` is 0."""
    idx = np.flatnonzero(visited)
    first = 0
    gaps = np.flatnonzero(np.diff(idx) > 1)
    if head and gaps.size == 1 and idx[0] == 0:
        first = int(idx[gaps[0]]) + 1
        idx = idx[gaps[0] + 1 :]
    found = _run(idx, full)
    return (first, *found) if head else found


def _run(idx: np.ndarray, full: np.ndarray) -> tuple[int, int, int, int]:
    if idx.size == 0:
        return 0, 0, 0, 0
    start, end = int(idx[0]), int(idx[-1]) + 1
    inner = np.flatnonzero(full[start:end]) + start
    if inner.size == 0 or inner[-1] - inner[0] + 1 != inner.size:
        return start, end, end, end  # no full run: every visited tile is an edge
    return start, int(inner[0]), int(inner[-1]) + 1, end


def segment_ops(spec: AttentionSpec, run) -> Segments | None:
    """The `Segments` op whose ids decide run-time tile skipping, if any."""
    if run is None:
        return None
    found = [op for op in spec.ops[run[0] : run[1] + 1] if isinstance(op, Segments)]
    return found[0] if found else None


#: `segments_case` values: the tile is skipped, computed with the segment
#: mask, or computed without it (every query and key in one segment).
SEGMENTS_APART, SEGMENTS_MIXED, SEGMENTS_INSIDE = 0, 1, 2


def segments_case(q_ids, kv_ids):
    """Which `lax.switch` branch a tile takes (`SEGMENTS_APART` ...).  Apart:
    no query id can equal a key id in any batch or head row, the id ranges
    ``[min, max]`` are disjoint (exact for any ids; with sorted, packed ids
    only tiles that really meet are computed).  Inside: every id of the tile,
    on both sides and in every row, is one value (the element mask keeps
    everything, so it is left out).  Else mixed."""
    axes = (-2, -1)
    q_lo, q_hi = q_ids.min(axis=axes), q_ids.max(axis=axes)
    k_lo, k_hi = kv_ids.min(axis=axes), kv_ids.max(axis=axes)
    inside = jnp.all((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo))
    meet = jnp.any((q_lo <= k_hi) & (k_lo <= q_hi))
    return jnp.where(inside, SEGMENTS_INSIDE, jnp.where(meet, SEGMENTS_MIXED, SEGMENTS_APART))
