"""The ring's backward: each device keeps its query block and the saved
output and row statistics, recomputes each step's probabilities from the
statistics, accumulates dQ locally and sends dK/dV (and the cotangents of
biases that travel with the keys) around the ring with their K/V block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashpass import compat
from flashpass.kernels.reference import sink_cotangent

from . import merge
from .step import RingStep


def backward(r: RingStep, res, dout):
    """The cotangents of q, k, v and the extras from the forward's residuals."""
    spec, g = r.spec, r.g
    q, k, v, extras, o, m, total = res
    base = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
    scale_back = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)[..., None]
    qf = r.grouped(q).astype(jnp.float32)
    do = r.grouped(dout).astype(jnp.float32)
    delta = jnp.sum(do * o, axis=-1)  # rowsum(dO * O)
    rows = (spec.batch, spec.heads, spec.q_len)
    saved = (base, scale_back, delta, merge.global_stats(o, m, total, rows))  # (kernel steps)
    kb, vb, blocks = k, v, tuple(extras[i] for i in r.moving)
    # Bias cotangents: a moving bias's travels with its block like dK; the
    # others stay and take each step's (and chunk's) part at its place.
    zeros = {i: jnp.zeros(extras[i].shape, jnp.float32) for i in r.biases}
    dstay = {i: z for i, z in zeros.items() if i not in r.moving}
    dmove = {i: z for i, z in zeros.items() if i in r.moving}
    grads0 = (jnp.zeros_like(qf), jnp.zeros(k.shape, jnp.float32))
    grads0 += (jnp.zeros(v.shape, jnp.float32), dstay, dmove)
    dq, dkb, dvb, dstay, dmove = jax.tree.map(lambda x: compat.vary_like(x, qf, k, v, dout), grads0)
    for step in range(r.n):
        q0, k0 = r.positions(step)
        here = r.with_blocks(extras, blocks, k0)
        block = (q, qf, do, dout, kb, vb, q0, k0, here, extras)

        def grads(state, step=step, block=block):
            return r.by_case(step, lambda case, st: _step(r, case, block, saved, st), state)

        state = (dq, dkb, dvb, dstay, dmove)
        dq, dkb, dvb, dstay, dmove = lax.cond(
            r.visible(q0, k0, here), grads, lambda state: state, state
        )
        # dK/dV travel with their K/V block; after n moves they are home.
        if step < r.n - 1:
            kb, vb, blocks = r.permute((kb, vb, blocks))
        dkb, dvb, dmove = r.permute((dkb, dvb, dmove))
    b, hk, _, t, d = qf.shape
    dextras = [None for _ in extras]  # integer lengths, ids and masks: no cotangent
    for i, x in {**dstay, **dmove}.items():
        dextras[i] = x.astype(extras[i].dtype)
    if spec.sink is not None:  # from the saved statistics, which include the sink
        rows = (b, hk * g, t)
        i = spec.sink.index
        stats = (x.reshape(rows) for x in (m, total, delta))
        dextras[i] = sink_cotangent(extras[i], *stats)
    return (
        dq.reshape(b, hk * g, t, d).astype(q.dtype),
        dkb.astype(k.dtype),
        dvb.astype(v.dtype),
        tuple(dextras),
    )


def _step(r: RingStep, case, block, saved, state):
    """One case of a step: the visiting block's share of the cotangents."""
    if case.skip:
        return state
    q, qf, do, dout, kb, vb, q0, k0, here, extras = block
    base, scale_back, delta, (o_out, m_out, den_out) = saved
    if case.kernel is not None:  # the block's share, from the global statistics
        dq, dkb, dvb, dstay, dmove = state
        wanted = tuple(i in r.biases for i in range(len(extras)))
        dq_b, dk_b, dv_b, dex = case.kernel.step_backward(
            case.spec, q, kb, vb, r.step_extras(case, here, k0), o_out, m_out,
            den_out, dout, wanted, interpret=r.interpret,
        )  # fmt: skip
        dq = dq + r.grouped(dq_b).astype(jnp.float32)
        dkb, dvb = dkb + dk_b.astype(jnp.float32), dvb + dv_b.astype(jnp.float32)
        dmove = {i: x + dex[i].astype(jnp.float32) for i, x in dmove.items()}
        dstay = {i: r.add_part(x, dex[i].astype(jnp.float32), 0, k0 if i in r.sliced else 0)
                 for i, x in dstay.items()}  # fmt: skip
        return dq, dkb, dvb, dstay, dmove
    kf, vf = kb.astype(jnp.float32), vb.astype(jnp.float32)

    def chunk(r0, state):
        dq, dkb, dvb, dstay, dmove = state
        qc, doc, ex = r.take(qf, r0), r.take(do, r0), r.rows_of(here, r0)
        raw = jnp.einsum("bhgtd,bhsd->bhgts", qc, kf)
        bias = {i: ex[i] for i in r.biases}

        def ops(s, bias):
            return r.score_ops(s, q0 + r0, k0, r.replaced(ex, bias))

        s, score_vjp = jax.vjp(ops, raw, bias)
        p = jnp.exp(s - r.take(base, r0)) * r.take(scale_back, r0)  # the forward's
        keep = r.keep_of(p, q0 + r0, k0, here)  # (one mask for dV and dP)
        dvb = dvb + jnp.einsum("bhgts,bhgtd->bhsd", r.dropped(p, keep), doc)
        # Dropped weights P' = D * P: dP = D * dP'.
        dp = r.dropped(jnp.einsum("bhgtd,bhsd->bhgts", doc, vf), keep)
        # Through the score ops (scales, soft-cap, biases; zero where a
        # mask replaced it).
        ds, dbias = score_vjp(p * (dp - r.take(delta, r0)[..., None]))
        dqc = r.take(dq, r0) + jnp.einsum("bhgts,bhsd->bhgtd", ds, kf)
        dkb = dkb + jnp.einsum("bhgts,bhgtd->bhsd", ds, qc)
        dmove = {i: x + dbias[i] for i, x in dmove.items()}
        dstay = {i: r.add_part(x, dbias[i], r0, k0 if i in r.sliced else 0)
                 for i, x in dstay.items()}  # fmt: skip
        return r.put(dq, dqc, r0), dkb, dvb, dstay, dmove

    return r.over_rows(chunk, state)
