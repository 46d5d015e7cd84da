"""Tile helpers of the blockwise kernel: static loops, layout and per-tile scores.

A query tile is processed as rows ``[B, Hkv, G*bq, .]`` (group folded into
the rows): plain 4-D dots and row reductions, which XLA's CPU backend runs
~15% faster than the same work in 5-D.  Extras stay 5-D
``[b, hkv|1, g|1, t, s]`` in memory and become rows per tile (`extra_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass import compat
from flashpass.ops import valid_lengths
from flashpass.spec import AttentionSpec, KvLengths, Mask

from ..reference import apply_score_ops
from .bounds import segments_case
from .plan import Plan

# --------------------------------------------------------------------------- loops


def bound(table: tuple[int, ...], i):
    """Loop bound ``table[i]``: a Python int when known statically."""
    if isinstance(i, int):
        return table[i]
    if len(set(table)) == 1:
        return table[0]
    return jnp.asarray(np.asarray(table, np.int32))[i]


def loop(lo, hi, body, state):
    """``lax.fori_loop`` that emits nothing for an empty static range and no
    loop for a single static iteration (less to compile, no loop overhead)."""
    if isinstance(lo, int) and isinstance(hi, int):
        if hi <= lo:
            return state
        if hi == lo + 1:
            return body(lo, state)
    return lax.fori_loop(lo, hi, body, state)


def varying(init, *inputs):
    """``init`` (a loop's initial carry, a tree) typed as varying over every
    manual mesh axis one of ``inputs`` (trees) varies over: inside a
    ``shard_map`` with ``check_vma`` a carry built from constants must have
    the type of what the loop computes from the inputs.  A no-op elsewhere."""
    axes = frozenset().union(*(compat.varying_axes(x) for x in jax.tree.leaves(inputs)))
    return jax.tree.map(lambda x: compat.vary_over(x, axes), init)


def tile_runs(plan, table, i, run, state, head=None):
    """Run one block's row of the tile table: ``table`` names the plan's
    ``(start, full_start, full_end, end)`` fields, and `loop` runs
    ``run(True)`` (edge tiles) over ``[start, full_start)`` and
    ``[full_end, end)``, ``run(False)`` over the full tiles between; with
    ``head`` (a field) edge tiles ``[0, head)`` first."""
    start, full_start, full_end, end = (bound(getattr(plan, name), i) for name in table)
    if head is not None and any(getattr(plan, head)):
        state = loop(0, bound(getattr(plan, head), i), run(True), state)
    state = loop(start, full_start, run(True), state)
    state = loop(full_start, full_end, run(False), state)
    return loop(full_end, end, run(True), state)


def segmented(plan, body, skipped, ids):
    """``run(edge)`` for `tile_runs`: ``body(edge)`` per tile, or with segment
    ids (``plan.segments``) a run-time switch per tile (`segments_case` of
    ``ids(i)``, the tile's query and key ids): ``skipped`` when they cannot
    meet, ``body(edge)``, or ``body(edge, one_segment=True)`` inside one
    segment (the segment mask left out)."""

    def run(edge):
        if plan.segments is None:
            return body(edge)
        branches = (skipped, body(edge), body(edge, one_segment=True))

        def step(i, state):
            return lax.switch(segments_case(*ids(i)), branches, i, state)

        return step

    return run


# --------------------------------------------------------------------------- layout


def extra5(spec: AttentionSpec, x, tp: int, sp: int):
    """A 4-D extra as 5-D ``[b, hkv|1, g|1, t, s]``, padded along full T/S axes."""
    eb, eh, et, es = x.shape
    if eh == 1:
        x = x.reshape(eb, 1, 1, et, es)
    else:
        x = x.reshape(eb, spec.kv_heads, spec.groups, et, es)
    pad = [(0, 0)] * 3 + [(0, tp - et if et != 1 else 0), (0, sp - es if es != 1 else 0)]
    if any(hi for _, hi in pad):
        # Masks pad with True so padded query rows stay finite; padded keys are
        # excluded separately and padded rows are sliced off, so values are moot.
        fill = 0 if jnp.issubdtype(x.dtype, jnp.inexact) else 1
        x = jnp.pad(x, pad, constant_values=np.array(fill, x.dtype))
    return x


def slice_t(x, start, size):
    return x if x.shape[-2] == 1 else lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 2)


def slice_s(x, start, size):
    return x if x.shape[-1] == 1 else lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 1)


def extra_rows(plan: Plan, x):
    """A 5-D extra tile as 4-D ``[b, hkv|1, rows|1, s]`` matching the score rows."""
    b, h, g, t, s = x.shape
    groups = plan.spec.groups
    if g == 1 and (t == 1 or groups == 1):
        return x.reshape(b, h, t, s)
    # Per-group or per-row values: spell them out for the tile's G*bq rows.
    return jnp.broadcast_to(x, (b, h, groups, plan.bq, s)).reshape(b, h, groups * plan.bq, s)


def grouped(plan: Plan, x):
    """``[B, H, T, ...]`` viewed as ``[B, Hkv, G, T, ...]``; left as it is when
    ``G == 1`` (a size-1 group axis makes XLA's CPU layout assignment copy the
    whole array before the loops)."""
    spec = plan.spec
    if spec.groups == 1:
        return x
    return x.reshape((spec.batch, spec.kv_heads, spec.groups) + x.shape[2:])


def gshape(spec: AttentionSpec, *tail: int) -> tuple[int, ...]:
    """``(B, Hkv, G, *tail)``, or ``(B, Hkv, *tail)`` when ``G == 1`` (see `grouped`)."""
    return (spec.batch, spec.kv_heads) + ((spec.groups,) if spec.groups > 1 else ()) + tail


def q_tile(plan: Plan, x, iq, axis: int = -2):
    """Rows ``[B, Hkv, G*bq, ...]`` of query tile ``iq`` of a grouped array whose
    query axis is ``axis`` (``-2`` for ``[B, Hkv, (G,) Tp, D]``, ``-1`` for the
    statistics ``[B, Hkv, (G,) Tp]`` and the transposed ``[B, Hkv, D, (G,) Tp]``)."""
    axis %= x.ndim
    t = lax.dynamic_slice_in_dim(x, iq * plan.bq, plan.bq, axis=axis)
    if plan.spec.groups == 1:
        return t
    return t.reshape(t.shape[: axis - 1] + (plan.spec.groups * plan.bq,) + t.shape[axis + 1 :])


def put_q_tile(plan: Plan, x, tile, iq, axis: int = -2):
    """Inverse of `q_tile`: write the rows of tile ``iq`` back into ``x``."""
    axis %= x.ndim
    tile = tile.reshape(x.shape[:axis] + (plan.bq,) + x.shape[axis + 1 :])
    return lax.dynamic_update_slice_in_dim(x, tile, iq * plan.bq, axis=axis)


def row_pos(plan: Plan, iq):
    """Query position of each of the G*bq rows of tile ``iq``."""
    return jnp.tile(iq * plan.bq + jnp.arange(plan.bq), plan.spec.groups)


def dot_operands(plan: Plan, a, b):
    """Operands of a score product: kept narrow (e.g. bf16) when that is exact."""
    if a.dtype == b.dtype and jnp.promote_types(a.dtype, plan.cdt) == plan.cdt:
        return a, b
    return a.astype(plan.cdt), b.astype(plan.cdt)


def tile_score_fn(
    plan: Plan, ex_tile, q_pos, k_pos, edge: bool, transposed: bool = False, one_segment=False
):
    """``f(s_raw, biases) -> s``: the spec's ops on one tile, as a function of
    the raw scores and the (5-D, compute-dtype) bias tiles so the backward can
    differentiate it.  Edge tiles also apply the causal op and key padding.

    ``transposed``: the tile is ``[..., s, t]`` (the backward's key-major
    tiles).  The same `apply_score_ops` runs on it, with the extras transposed
    (XLA reads them transposed inside the fusion; nothing is copied) and the
    positions swapped and negated: its causal test ``k <= q + offset`` on
    (row, column) positions (-k_j, -q_i) reads ``-q_i <= -k_j + offset``,
    i.e. ``k_j <= q_i + offset``, the same test for the transposed entry.

    ``one_segment``: every query and key of the tile is in one segment
    (`bounds.segments_case`), so the `Segments` op keeps everything: left out.
    """
    spec = plan.spec
    ops = plan.ops_edge if edge else plan.ops_plain
    if one_segment:
        ops = tuple(op for op in ops if op != plan.segments)
    # KvLengths runs as the element mask ``k < n`` of this tile (keys are rows
    # of a transposed tile, so the position trick below does not apply to it).
    lengths = {op.index: op for op in ops if isinstance(op, KvLengths)}
    ops = tuple(
        Mask(op.index, op.shape, op.fill) if isinstance(op, KvLengths) else op for op in ops
    )
    ops_spec = spec.with_ops(ops)
    if not ops_spec.ops and not (edge and plan.padded_k):
        return lambda s, biases: s

    def f(s, biases):
        ex = [extra_rows(plan, biases.get(i, x)) for i, x in enumerate(ex_tile)]
        for i, op in lengths.items():
            n = valid_lengths(op, ex[i], spec.kv_len)
            ex[i] = k_pos[None, :] < n  # [.., 1, bk]: transposed with the others below
        if transposed:
            ex = [jnp.swapaxes(x, -1, -2) for x in ex]
            s = apply_score_ops(ops_spec, s, ex, -k_pos, -q_pos, transposed=True)
            key_axis = k_pos[:, None]
        else:
            s = apply_score_ops(ops_spec, s, ex, q_pos, k_pos)
            key_axis = k_pos[None, :]
        if edge and plan.padded_k:
            # Padded keys get -inf, below any user fill: they never carry weight.
            s = jnp.where(key_axis < spec.kv_len, s, -jnp.inf)
        return s

    return f


def scaled_q(plan: Plan, q):
    if plan.q_scale == 1.0:
        return q
    return q * jnp.asarray(plan.q_scale, q.dtype)


def bias_indices(spec: AttentionSpec, extras) -> tuple[int, ...]:
    idx = sorted({i for op in spec.ops for i in op.grad_extras()})
    return tuple(i for i in idx if jnp.issubdtype(extras[i].dtype, jnp.inexact))


def skipped_score_of(plan: Plan, cdt):
    """The skipped keys' common score, computed by the same ops as on real tiles."""
    ops = plan.spec.ops
    at = plan.skip_at  # the last op of the skipped run (`bounds.skip_run`)
    spec = plan.spec.with_ops(ops[at + 1 :])
    fill = jnp.full((1, 1), ops[at].fill, cdt)
    return apply_score_ops(spec, fill, [])[0, 0]


# --------------------------------------------------------------------------- accumulation


def add_at(acc, tile, axes, starts):
    """``acc[..., start:start+n, ...] += tile`` along ``axes`` whose ``acc`` size is not 1."""
    index = [0] * acc.ndim
    for axis, start in zip(axes, starts, strict=True):
        if acc.shape[axis] != 1:
            index[axis] = start
    index = [jnp.asarray(i, jnp.int32) for i in index]
    cur = lax.dynamic_slice(acc, index, tile.shape)
    return lax.dynamic_update_slice(acc, cur + tile, index)


def extra_cotangents(extras, wanted, grads: dict) -> tuple:
    """The extras' cotangents: ``grads[i]`` (in ``extras[i]``'s size) where
    computed, float0 for masks, zeros for a wanted float used only as a mask,
    and None (a symbolic zero) where not differentiated."""
    out = []
    for i, x in enumerate(extras):
        if i in grads:
            out.append(grads[i].reshape(x.shape).astype(x.dtype))
        elif not jnp.issubdtype(x.dtype, jnp.inexact):
            out.append(np.zeros(x.shape, jax.dtypes.float0))
        elif wanted[i]:
            out.append(jnp.zeros(x.shape, x.dtype))
        else:
            out.append(None)
    return tuple(out)
