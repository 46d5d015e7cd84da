"""The tile code `flash_tpu` (Pallas on TPU) and `flash_gpu` (Pallas on Triton) share.

* The plan (`_plan`): block sizes, the score ops the tiles apply, the
  `Positional` ops whose fill excludes keys (they skip tiles), and the one
  score a skipped tile's keys end with when there is one (`_fold_score`).
* One tile: its positions, its score function (the spec's score ops through
  the op protocol, `_score_fn`), and its state under the skipping ops
  (`_tile_state`).
* The ``custom_vjp`` around a backend's forward and backward kernels
  (`vjp_attention`): padded rows, GQA sums, the extras' and the sink's
  cotangents; and the extras as the kernels read them (`kernel_extras`).

The kernels themselves, and what they do with a tile, are in
`flashpass.kernels.flash_tpu` (whose docstring describes the algorithm) and
`flashpass.kernels.flash_gpu`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass.ops import KeepOp, Positional, Positions
from flashpass.spec import AttentionSpec, excludes

from . import _util
from .reference import sink_cotangent

#: Query blocks are a multiple of this (bfloat16 sublane tiling).
Q_MULTIPLE = 16
#: Key blocks are a multiple of this (the lane width).
LANES = 128


# --------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class _Plan:
    spec: AttentionSpec
    kdt: np.dtype  # q, k, v (and p before P.V) in the kernel
    bq: int
    bk: int
    nq: int
    nk: int
    ops: tuple  # the score ops the tiles apply, in order (no Sink, no Dropout)
    skips: tuple  # Positional ops whose fill excludes keys: tile skipping
    fold: float | None  # the one finite final score of a skipped tile's keys
    tile_extras: tuple  # indices of the extras the tiles read
    grad_extras: tuple  # float extras whose cotangent the tiles give
    bools: tuple  # indices of boolean extras (passed as int32)
    interpret: bool

    @property
    def tp(self) -> int:
        return self.nq * self.bq

    @property
    def sp(self) -> int:
        return self.nk * self.bk

    @property
    def padded_k(self) -> bool:
        return self.sp > self.spec.kv_len


def _plan(spec: AttentionSpec, block_q: int, block_k: int, interpret: bool) -> _Plan:
    bq = min(_util.round_up(block_q, Q_MULTIPLE), _util.round_up(spec.q_len, Q_MULTIPLE))
    bk = min(_util.round_up(block_k, LANES), _util.round_up(spec.kv_len, LANES))
    special = {id(spec.sink), id(spec.dropout)}
    ops, skips = [], []
    for at, op in enumerate(spec.ops):
        if id(op) in special:
            continue
        ops.append(op)
        fill = getattr(op, "fill", None)
        if isinstance(op, Positional) and excludes(spec.final_fill(at, fill)):
            skips.append(op)
    fold = None if spec.dropout is not None else _fold_score(spec, skips)
    read = sorted({i for op in ops for i in op.extras_read()})
    grads = sorted({i for op in ops for i in op.grad_extras()})
    grads = [i for i in grads if jnp.issubdtype(spec.extras[i].dtype, jnp.floating)]
    bools = [i for i in read if np.dtype(spec.extras[i].dtype) == np.bool_]
    return _Plan(
        spec=spec,
        kdt=_util.kernel_dtype(spec, narrow=(_util.BF16,)),
        bq=bq,
        bk=bk,
        nq=-(-spec.q_len // bq),
        nk=-(-spec.kv_len // bk),
        ops=tuple(ops),
        skips=tuple(skips),
        fold=fold,
        tile_extras=tuple(read),
        grad_extras=tuple(grads),
        bools=tuple(bools),
        interpret=interpret,
    )


def _fold_score(spec: AttentionSpec, skips) -> float | None:
    """The score every key of a skipped tile ends with, when it is one finite
    value ``c`` (else None): the skipping ops and every key-excluding op after
    the first of them end their keys at ``c``, and every other op after it
    maps all scores alike (`ScoreOp.uniform`).  Such keys still weigh
    ``exp(c - m)`` in a row that keeps no key (the original averages ``v``
    over them), so skipped tiles are folded in as ``n`` scores ``c`` with the
    sum of their values: O(bk * Dv), no product."""
    if not skips:
        return None
    ops = spec.ops
    first = min(ops.index(op) for op in skips)
    finals = set()
    for at in range(first, len(ops)):
        op = ops[at]
        if op is spec.sink:
            continue
        if isinstance(op, KeepOp):
            finals.add(spec.final_fill(at, op.fill))
        elif not op.uniform:
            return None
    (c,) = finals if len(finals) == 1 else (None,)
    return c if c is not None and np.isfinite(c) else None


# --------------------------------------------------------------------------- tiles


class _TilePositions(Positions):
    """The positions of one ``[bq, bk]`` tile as 2-D iotas (what a TPU
    kernel builds); ops read them through `Positions.grid`."""

    def __init__(self, qi, kj, kv_len):
        super().__init__((qi.shape[0], kj.shape[1]), kv_len=kv_len)
        self._qi, self._kj = qi, kj

    def grid(self):
        return self._qi, self._kj


def _tile_positions(plan: _Plan, i, j):
    qi = i * plan.bq + lax.broadcasted_iota(jnp.int32, (plan.bq, 1), 0)
    kj = j * plan.bk + lax.broadcasted_iota(jnp.int32, (1, plan.bk), 1)
    return qi, kj


def _apply(op, s, ex, at: _TilePositions):
    """One score op on a tile: a key-excluding op by its predicate, any other
    by its ``apply`` (both from the protocol, `flashpass.ops.base`)."""
    if isinstance(op, KeepOp):
        qi, kj = at.grid()
        keep = op.keep(qi, kj, ex, at.kv_len)
        return jnp.where(keep, s, jnp.asarray(op.fill, s.dtype))
    return op.apply(s, ex, at)


def _score_fn(plan: _Plan, qi, kj, edge: bool):
    """``f(s_raw, ex) -> s``: the spec's score ops on one tile (interior
    tiles, ``edge=False``, leave out the skipping ops, which keep them whole)."""
    at = _TilePositions(qi, kj, plan.spec.kv_len)
    ops = plan.ops if edge else tuple(op for op in plan.ops if op not in plan.skips)

    def f(s, ex):
        for op in ops:
            s = _apply(op, s, ex, at)
        if plan.padded_k:
            s = jnp.where(kj < plan.spec.kv_len, s, -jnp.inf)
        return s

    return f


def _tile_state(plan: _Plan, i, j):
    """``(visit, full)`` of tile ``(i, j)`` under the skipping ops (traced
    scalars; None where no op skips)."""
    if not plan.skips:
        return None, None
    spec = plan.spec
    r0 = i * plan.bq
    r1 = jnp.minimum(r0 + plan.bq, spec.q_len) - 1
    c0 = j * plan.bk
    c1 = jnp.minimum(c0 + plan.bk, spec.kv_len) - 1
    visit, full = True, True
    for op in plan.skips:
        empty, whole = op.tile_state(r0, r1, c0, c1)
        visit = visit & ~jnp.asarray(empty)
        full = full & jnp.asarray(whole)
    return visit, full


def _nt(a, b):
    """``a @ b^T`` in float32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _nn(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    """``a^T @ b`` in float32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# --------------------------------------------------------------------------- custom_vjp


def vjp_attention(forward, backward):
    """The kernel's attention as a ``custom_vjp`` over its own ``forward(plan, q,
    k, v, ex, sink, key) -> (out, m, den)`` and ``backward(plan, q, k, v, ex,
    key, dout, m, inv_l, delta) -> (dq, dk, dv, per-tile extra cotangents)``.
    The gradient's assembly around the backward kernel (padded rows, GQA sums,
    the extras' and the sink's cotangents) is the same for every backend of
    this tile code (flash_tpu here, flash_gpu on Triton)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attention(plan, q, k, v, ex, sink, key):
        return forward(plan, q, k, v, ex, sink, key)[0]

    def attention_fwd(plan, q, k, v, ex, sink, key):
        out, m, den = forward(plan, q, k, v, ex, sink, key)
        return out, (q, k, v, ex, sink, key, out, m, den)

    def attention_bwd(plan, res, dout):
        q, k, v, ex, sink, key, out, m, den = res
        spec = plan.spec
        T = spec.q_len
        real = (jnp.arange(plan.tp) < T)[None, None, :, None]
        # Padded rows: m = +inf and 1/l = 0, so their weights are exactly 0.
        m_b = jnp.where(real, m, jnp.inf)
        inv_l = jnp.where(real, 1 / jnp.where(real, den, 1.0), 0.0)
        dout = jnp.where(real, dout, 0).astype(plan.kdt)
        delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1, keepdims=True)
        dq, dk, dv, dtiles = backward(plan, q, k, v, ex, key, dout, m_b, inv_l, delta)
        G = spec.groups
        if G > 1:
            dk = dk.reshape(spec.batch, spec.kv_heads, G, *dk.shape[2:]).sum(2)
            dv = dv.reshape(spec.batch, spec.kv_heads, G, *dv.shape[2:]).sum(2)
        dex = []
        grads = dict(zip(plan.grad_extras, dtiles, strict=True))
        for i, x in zip(plan.tile_extras, ex, strict=True):
            if i in grads:
                dex.append(_extra_cotangent(plan, grads[i], x))
            elif jnp.issubdtype(x.dtype, jnp.inexact):
                dex.append(jnp.zeros_like(x))
            else:
                dex.append(np.zeros(x.shape, jax.dtypes.float0))
        dsink = None
        if sink is not None:
            rows = sink.shape[2]
            s = sink[:, :, :T] if rows > 1 else sink
            g = sink_cotangent(s, m[..., :T, 0], den[..., :T, 0], delta[..., :T, 0])
            dsink = _util.pad_axis(g, 2, rows) if rows > 1 else g
        dkey = None if key is None else np.zeros(key.shape, jax.dtypes.float0)
        grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
        return (*grads, tuple(dex), dsink, dkey)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


def _extra_cotangent(plan: _Plan, tiles, x):
    """Per-tile cotangents ``[B, H, nq, nk, tq, tk]`` summed into ``x``'s shape."""
    B, H, nq, nk, tq, tk = tiles.shape
    g = jnp.transpose(tiles, (0, 1, 2, 4, 3, 5)).reshape(B, H, nq * tq, nk * tk)
    axes = tuple(a for a in range(4) if x.shape[a] == 1 and g.shape[a] != 1)
    g = g.sum(axes, keepdims=True)
    return g[:, :, : x.shape[2], : x.shape[3]].astype(x.dtype)


# --------------------------------------------------------------------------- adapters


def _reasons(spec: AttentionSpec) -> list[str]:
    """Why neither kernel takes ``spec`` (its dtypes, its extras' ranks)."""
    reasons = _util.float_dtype_reasons(spec, "flash_tpu")
    for i in {i for op in spec.ops for i in op.extras_read()}:
        if not 0 <= i < len(spec.extras):
            reasons.append(f"an op refers to extra #{i}, which the spec lacks")
        elif len(spec.extras[i].shape) != 4:
            reasons.append(f"extra #{i} is not 4-D")
    return reasons


def kernel_extras(plan: _Plan, spec: AttentionSpec, extras) -> tuple:
    """``(tiled extras, sink, dropout key)`` as the kernels read them, from the
    call's extras (shared by flash_tpu and flash_gpu)."""
    ex = tuple(_tile_extra(plan, i, extras[i]) for i in plan.tile_extras)
    sink = None
    if spec.sink is not None:
        sink = extras[spec.sink.index]
        if sink.shape[2] > 1:
            sink = _util.pad_axis(sink, 2, plan.tp)
    key = None
    if spec.dropout is not None:
        key = extras[spec.dropout.index].reshape(2).astype(jnp.uint32)
    return ex, sink, key


def _tile_extra(plan: _Plan, index: int, x):
    """An extra as the tiles read it: padded along its full T/S axes (masks
    keep, so padded rows stay finite; padded keys score -inf anyway), booleans
    as int32."""
    if index in plan.bools:
        x = x.astype(jnp.int32)
    _, _, et, es = x.shape
    value = 1 if index in plan.bools else 0
    if et > 1:
        x = _util.pad_axis(x, 2, plan.tp, value=value)
    if es > 1:
        x = _util.pad_axis(x, 3, plan.sp, value=value)
    return x


def forward_refs(refs, n_ex: int, has_sink: bool, has_key: bool):
    """A forward kernel's refs as both native kernels order them: ``(q, k, v,
    extras, sink or None, dropout key or None, the rest)``."""
    rest = list(refs[3 + n_ex :])
    sink_ref = rest.pop(0) if has_sink else None
    key_ref = rest.pop(0) if has_key else None
    return (*refs[:3], refs[3 : 3 + n_ex], sink_ref, key_ref, rest)
