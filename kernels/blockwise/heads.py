"""The head loop: the blockwise passes run one (batch, kv head) unit at a time.

On CPU, long sequences run unit by unit (`head_loop_pays`), so every product
is one ``[G*block_q, D] x [D, block_k]`` matmul instead of a batch of smaller
ones, which XLA's CPU dot runs faster (see `plan.HEAD_LOOP_BLOCK`).  The
passes themselves come from `flash` as arguments; a broadcast extra's
gradient is summed over the units that share it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from flashpass.spec import AttentionSpec

from .plan import HEAD_LOOP_MIN_CAUSAL_LEN, TILE_ELEMENTS, Plan
from .tiles import extra_cotangents, gshape, loop, varying


def head_loop_pays(spec: AttentionSpec) -> bool:
    """Whether the CPU default runs one (batch, kv head) unit at a time (see
    `HEAD_LOOP_BLOCK`): more than one unit, at least one full tile's work per
    unit, and with causal skipping only from `HEAD_LOOP_MIN_CAUSAL_LEN`."""
    if spec.batch * spec.kv_heads == 1:
        return False
    if spec.causal is not None:
        return min(spec.q_len, spec.kv_len) >= HEAD_LOOP_MIN_CAUSAL_LEN
    return spec.groups * spec.q_len * spec.kv_len >= TILE_ELEMENTS


def unit_spec(spec: AttentionSpec) -> AttentionSpec:
    """The spec of one (batch, kv head) unit of the head loop: its G query heads."""
    return dataclasses.replace(spec, batch=1, heads=spec.groups, kv_heads=1)


def _unit_at(spec: AttentionSpec, u):
    return u // spec.kv_heads, u % spec.kv_heads


def _take(x, b, h):
    """Unit ``(b, h)`` of ``[B, Hkv, ...]`` as ``[1, 1, ...]``."""
    return lax.dynamic_slice(x, (b, h) + (0,) * (x.ndim - 2), (1, 1) + x.shape[2:])


def _put(x, unit, b, h):
    return lax.dynamic_update_slice(x, unit.astype(x.dtype), (b, h) + (0,) * (x.ndim - 2))


def _take_q(spec: AttentionSpec, x, b, h):
    """Unit ``(b, h)`` of a ``[B, H, ...]`` query-side array as ``[1, G, ...]``."""
    g = x.reshape((spec.batch, spec.kv_heads, spec.groups) + x.shape[2:])
    return _take(g, b, h).reshape((1, spec.groups) + x.shape[2:])


def _put_q(spec: AttentionSpec, x, unit, b, h):
    g = x.reshape((spec.batch, spec.kv_heads, spec.groups) + x.shape[2:])
    return _put(g, unit.reshape((1, 1) + g.shape[2:]), b, h).reshape(x.shape)


def _extra_unit(spec: AttentionSpec, x):
    """A 4-D extra ``[b|1, H|1, t, s]`` viewed as ``[b|1, Hkv|1, G|1, t, s]``."""
    eb, eh = x.shape[:2]
    heads = (1, 1) if eh == 1 else (spec.kv_heads, spec.groups)
    return x.reshape((eb,) + heads + x.shape[2:])


def _extra_start(x5, b, h) -> tuple:
    """Where unit ``(b, h)`` starts in an extra's 5-D view (0 on broadcast axes)."""
    return (b if x5.shape[0] > 1 else 0, h if x5.shape[1] > 1 else 0, 0, 0, 0)


def _take_extra(spec: AttentionSpec, x, b, h):
    """Unit ``(b, h)`` of an extra, as the unit spec's 4-D ``[1, G|1, t, s]``."""
    x5 = _extra_unit(spec, x)
    t = lax.dynamic_slice(x5, _extra_start(x5, b, h), (1, 1) + x5.shape[2:])
    return t.reshape((1,) + x5.shape[2:])


def _add_extra(acc5, unit, b, h):
    """``acc5`` (an extra's 5-D view, float32) += the unit's cotangent: a
    broadcast axis of the extra sums over the units that share it."""
    start = _extra_start(acc5, b, h)
    cur = lax.dynamic_slice(acc5, start, (1, 1) + acc5.shape[2:])
    return lax.dynamic_update_slice(acc5, cur + unit.reshape(cur.shape).astype(acc5.dtype), start)


def forward_heads(forward, plan: Plan, spec: AttentionSpec, q, k, v, extras):
    """``forward`` (`flash._forward`) for ``spec`` run unit by unit (``plan``
    tiles `unit_spec`)."""
    tp = plan.nq * plan.bq

    def unit(u, carry):
        b, h = _unit_at(spec, u)
        ex = [_take_extra(spec, x, b, h) for x in extras]
        res = forward(plan, _take_q(spec, q, b, h), _take(k, b, h), _take(v, b, h), ex)
        return tuple(_put(acc, r, b, h) for acc, r in zip(carry, res, strict=True))

    stats = jnp.zeros(gshape(spec, tp), plan.cdt)
    init = (jnp.zeros(gshape(spec, tp, spec.v_head_dim), spec.out_dtype), stats, stats)
    return loop(0, spec.batch * spec.kv_heads, unit, varying(init, q, k, v, extras))


def backward_heads(
    backward, plan: Plan, spec: AttentionSpec, q, k, v, extras, out, m, den, dout, wanted
):
    """``backward`` (`flash._backward`) for ``spec`` run unit by unit (``plan``
    tiles `unit_spec`)."""
    summed = [i for i, x in enumerate(extras) if jnp.issubdtype(x.dtype, jnp.inexact) and wanted[i]]

    def unit(u, carry):
        dq, dk, dv, dex = carry
        b, h = _unit_at(spec, u)
        ex = [_take_extra(spec, x, b, h) for x in extras]
        g = backward(
            plan,
            _take_q(spec, q, b, h),
            _take(k, b, h),
            _take(v, b, h),
            ex,
            _take_q(spec, out, b, h),
            _take(m, b, h),
            _take(den, b, h),
            _take_q(spec, dout, b, h),
            wanted,
        )
        dex = {i: _add_extra(acc, g[3][i], b, h) for i, acc in dex.items()}
        return _put_q(spec, dq, g[0], b, h), _put(dk, g[1], b, h), _put(dv, g[2], b, h), dex

    init = (
        jnp.zeros(q.shape, q.dtype),
        jnp.zeros(k.shape, k.dtype),
        jnp.zeros(v.shape, v.dtype),
        {i: jnp.zeros(_extra_unit(spec, extras[i]).shape, plan.cdt) for i in summed},
    )
    inputs = (q, k, v, extras, out, m, den, dout)
    dq, dk, dv, dex = loop(0, spec.batch * spec.kv_heads, unit, varying(init, inputs))
    return dq, dk, dv, extra_cotangents(extras, wanted, dex)
