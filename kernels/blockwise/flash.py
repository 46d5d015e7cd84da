"""The blockwise kernel's passes: forward, backward and their ``custom_vjp``.

Forward: for each query block, an online softmax over key blocks (running max
``m``, row sum ``den``, unnormalised output ``acc``).  Backward: the
flash-attention-2 recurrence, recomputing each score tile from ``q``, ``k`` and
the row statistics saved by the forward.  Both run over one `Plan`'s tiles;
`attention` runs them on the whole batch, or per (batch, kv head) unit through
the head loop (`heads`) when the `Plans` say so.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from .. import _util
from ..dropout import apply_dropout, keep_mask
from ..reference import sink_cotangent
from . import heads
from .plan import Plan, Plans
from .tiles import (
    add_at,
    bias_indices,
    bound,
    dot_operands,
    extra5,
    extra_cotangents,
    extra_rows,
    grouped,
    gshape,
    loop,
    put_q_tile,
    q_tile,
    row_pos,
    scaled_q,
    segmented,
    skipped_score_of,
    slice_s,
    slice_t,
    tile_runs,
    tile_score_fn,
    varying,
)

# --------------------------------------------------------------------------- forward


def forward(plan: Plan, q, k, v, extras):
    """Returns ``out5 [B,Hkv,G,Tp,Dv]`` (out dtype) and the softmax statistics
    ``m`` (row max) and ``den`` (row sum of exp(s - m)), each ``[B,Hkv,G,Tp]``
    (no G axis when G == 1, see `grouped`)."""
    spec, cdt, bk = plan.spec, plan.cdt, plan.bk
    B, Hkv, G, Dv = spec.batch, spec.kv_heads, spec.groups, spec.v_head_dim
    rows = G * plan.bq
    tp, sp = plan.nq * plan.bq, plan.nk * bk
    q5 = _util.pad_axis(grouped(plan, q), -2, tp)
    kp = _util.pad_axis(k, 2, sp)
    vp = _util.pad_axis(v, 2, sp)
    key, extras = _split_key(spec, extras)
    sink, extras = _split_sink(spec, extras, cdt)
    ex5 = [extra5(spec, x, tp, sp) for x in extras]
    sink5 = None if sink is None else extra5(spec, sink, tp, 1)
    p_dtype = spec.p_dtype

    finite_segments = plan.segments is not None and np.isfinite(plan.segment_score)
    if plan.skipped_score is not None or finite_segments:
        # Skipped keys start at a key-block boundary: suffix sums of V's block
        # sums (padded keys are 0), row j is sum over blocks >= j, row nk is 0.
        vblocks = vp.astype(cdt).reshape(B, Hkv, plan.nk, bk, Dv).sum(axis=3)
        suffix = jnp.cumsum(vblocks[:, :, ::-1], axis=2)[:, :, ::-1]
        vsuffix = jnp.concatenate([suffix, jnp.zeros_like(suffix[:, :, :1])], axis=2)
        c = skipped_score_of(plan, cdt)

    def q_block(iq, carry):
        out, ms, dens = carry
        q_t = scaled_q(plan, q_tile(plan, q5, iq))
        ex_q = [slice_t(x, iq * plan.bq, plan.bq) for x in ex5]
        q_pos = row_pos(plan, iq)

        def kv_body(edge, one_segment=False):
            def body(ik, state):
                m, den, acc = state
                k_t = lax.dynamic_slice_in_dim(kp, ik * bk, bk, axis=2)
                v_t = lax.dynamic_slice_in_dim(vp, ik * bk, bk, axis=2)
                k_pos = ik * bk + jnp.arange(bk)
                ex_t = [slice_s(x, ik * bk, bk) for x in ex_q]
                a, b = dot_operands(plan, q_t, k_t)
                s = jnp.einsum("bhtd,bhsd->bhts", a, b, preferred_element_type=cdt)
                s = tile_score_fn(plan, ex_t, q_pos, k_pos, edge, one_segment=one_segment)(s, {})
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                # A row with only -inf so far keeps m = -inf; shift by 0 instead
                # so exp() gives 0, not nan.
                m_safe = jnp.where(m_new == -jnp.inf, 0, m_new)
                alpha = jnp.exp(m - m_safe)
                p = jnp.exp(s - m_safe[..., None])
                den = den * alpha + jnp.sum(p, axis=-1)
                if key is not None:  # the program's keep-mask on this tile
                    keep = _keep(plan, key, q_pos[None, None, :, None], k_pos, False)
                    p = apply_dropout(spec.dropout, p, keep)
                pv = jnp.einsum(
                    "bhts,bhsd->bhtd", p.astype(p_dtype), v_t, preferred_element_type=cdt
                )
                return m_new, den, acc * alpha[..., None] + pv

            return body

        if sink5 is None:
            m0, den0 = jnp.full((B, Hkv, rows), -jnp.inf, cdt), jnp.zeros((B, Hkv, rows), cdt)
        else:
            # The sink is one more score of weight exp(sink - m) and no value:
            # the running max and sum start from it (exactly 0 for a -inf sink).
            m0 = extra_rows(plan, slice_t(sink5, iq * plan.bq, plan.bq))[..., 0]
            m0 = jnp.broadcast_to(m0.astype(cdt), (B, Hkv, rows))
            den0 = jnp.where(m0 == -jnp.inf, 0, 1).astype(cdt)
        state = varying((m0, den0, jnp.zeros((B, Hkv, rows, Dv), cdt)), q, k, v, extras)

        def fold(state, n, vsum):
            # Keys that all score c: fold them in as n copies of c with the sum
            # of their values (a no-op when exp(c - m) == 0).
            m, den, acc = state
            m_new = jnp.where(n > 0, jnp.maximum(m, c), m)
            m_safe = jnp.where(m_new == -jnp.inf, 0, m_new)
            alpha = jnp.exp(m - m_safe)
            beta = jnp.where(n > 0, jnp.exp(c - m_safe), 0)
            den = den * alpha + n * beta
            beta_p = beta.astype(p_dtype).astype(cdt)  # as the reference rounds p
            return m_new, den, acc * alpha[..., None] + beta_p[..., None] * vsum

        def skipped(ik, state):
            if not finite_segments:
                return state
            n = jnp.asarray(jnp.minimum(bk, spec.kv_len - ik * bk)).astype(cdt)
            return fold(state, n, lax.dynamic_slice_in_dim(vblocks, ik, 1, axis=2))

        # Tiles whose query and key segment ids cannot meet are skipped at run
        # time (their keys score c: folded in when c is finite), and tiles
        # inside one segment run without the segment mask.
        op = plan.segments
        run = segmented(
            plan,
            kv_body,
            skipped,
            lambda ik: (ex_q[op.q_index], slice_s(ex_q[op.kv_index], ik * bk, bk)),
        )
        table = ("kstart", "kfs", "kfull", "kend")
        m, den, acc = tile_runs(plan, table, iq, run, state, head="khead")
        kstart, kend = bound(plan.kstart, iq), bound(plan.kend, iq)
        if plan.skipped_score is not None:
            # The keys outside the visited blocks: a suffix, and a prefix (or
            # the gap after a head, `Plan.khead`).
            first, last = bound(plan.kstart_key, iq), bound(plan.kend_key, iq)
            n = spec.kv_len - (last - first)
            vsum = lax.dynamic_slice_in_dim(vsuffix, kend, 1, axis=2)
            if any(plan.kstart):
                head = vsuffix[:, :, :1]
                if plan.khead:
                    n = n - bound(plan.khead_key, iq)
                    head = lax.dynamic_slice_in_dim(vsuffix, bound(plan.khead, iq), 1, axis=2)
                before = head - lax.dynamic_slice_in_dim(vsuffix, kstart, 1, axis=2)
                vsum = vsum + before
            n = jnp.asarray(n).astype(cdt)
            m, den, acc = fold((m, den, acc), n, vsum)
        out_t = (acc / den[..., None]).astype(spec.out_dtype)
        out = put_q_tile(plan, out, out_t, iq)
        return out, put_q_tile(plan, ms, m, iq, -1), put_q_tile(plan, dens, den, iq, -1)

    stats = jnp.zeros(gshape(spec, tp), cdt)
    init = (jnp.zeros(gshape(spec, tp, Dv), spec.out_dtype), stats, stats)
    return loop(0, plan.nq, q_block, varying(init, q, k, v, extras))


# --------------------------------------------------------------------------- backward


def backward(plan: Plan, q, k, v, extras, out, m, den, dout, wanted):
    """Flash-attention-2 backward; returns cotangents of (q, k, v, extras).

    ``wanted[i]`` says whether extras[i] needs its cotangent (None if not)."""
    spec, cdt, bq, bk = plan.spec, plan.cdt, plan.bq, plan.bk
    B, H, Hkv = spec.batch, spec.heads, spec.kv_heads
    T, S, D, Dv = spec.q_len, spec.kv_len, spec.head_dim, spec.v_head_dim
    tp, sp = plan.nq * bq, plan.nk * bk
    q5 = _util.pad_axis(grouped(plan, q), -2, tp)
    kp = _util.pad_axis(k, 2, sp)
    do5 = _util.pad_axis(grouped(plan, dout), -2, tp)
    out5 = _util.pad_axis(grouped(plan, out), -2, tp)
    v_dtype = v.dtype
    v, out5 = _centred(spec, v, out5, cdt)
    vp = _util.pad_axis(v, 2, sp)
    key, kernel_extras = _split_key(spec, extras)
    _, kernel_extras = _split_sink(spec, kernel_extras, cdt)  # its cotangent: `_sink_cotangent`
    ex5 = [extra5(spec, x, tp, sp) for x in kernel_extras]
    bias_idx = tuple(i for i in bias_indices(spec, kernel_extras) if wanted[i])
    p_dtype = spec.p_dtype

    # (An einsum, not sum(do * out, -1): XLA's CPU reduction over a 64-wide
    # minor axis is ~25x slower than the equivalent batched dot.)
    delta = jnp.einsum("...td,...td->...t", do5.astype(cdt), out5.astype(cdt))
    # p = exp(s - m) / den, recomputed as in the forward.  Not exp(s - lse): with
    # a large finite fill (a fully masked row, m = -1e9) m + log(den) rounds to m
    # in float32 and every weight of that row would come out wrong.
    # Padded query rows get m=+inf and 1/den=0, hence p=0 exactly: whatever their
    # scores, they never leak nan into dk/dv.
    real = jnp.arange(tp) < T
    m = jnp.where(real, _util.pad_axis(m, -1, tp), jnp.inf)
    inv_den = jnp.where(real, 1 / _util.pad_axis(den, -1, tp, value=1), 0)
    # With e = exp(s - m) (p = e / den):  dV = p^T dO = e^T (dO / den) and
    # dS = p * (dP - delta) = e * (V (dO / den)^T - delta / den).  Scaling the
    # [T, Dv] dO and the [T] delta once, instead of every tile, leaves one pass
    # over each tile less (no p = e / den).
    do_n = do5.astype(cdt) * inv_den[..., None]
    delta_n = delta * inv_den
    finite_c = plan.segments is not None and np.isfinite(plan.segment_score)
    if finite_c:
        c = skipped_score_of(plan, cdt)

    def k_block(ik, carry):
        dqt, dk, dv, dbias = carry
        k_t = lax.dynamic_slice_in_dim(kp, ik * bk, bk, axis=2)
        v_t = lax.dynamic_slice_in_dim(vp, ik * bk, bk, axis=2)
        k_pos = ik * bk + jnp.arange(bk)
        ex_k = [slice_s(x, ik * bk, bk) for x in ex5]
        # Tiles are key-major here (``[bk, rows]``, the transpose of the
        # forward's): then every product below contracts the minor axis of its
        # left operand, the layout XLA's fast CPU matmul path takes; a
        # transposed left operand (p^T @ dO) falls back to a ~3x slower one.
        k_dot = dot_operands(plan, k_t, q5)[0]
        k_tr = jnp.swapaxes(k_dot, 2, 3)  # [B, Hkv, D, bk], once per key block

        def q_body(edge, one_segment=False):
            def body(iq, state):
                dqt, dk_t, dv_t, dbias = state
                q_t = scaled_q(plan, q_tile(plan, q5, iq))
                do_t = q_tile(plan, do_n, iq)
                m_t, delta_t = (q_tile(plan, x, iq, -1)[:, :, None] for x in stats)
                ex_t = [slice_t(x, iq * bq, bq) for x in ex_k]
                b, a = dot_operands(plan, k_t, q_t)
                st = jnp.einsum("bhsd,bhtd->bhst", b, a, preferred_element_type=cdt)
                biases = {i: ex_t[i].astype(cdt) for i in bias_idx}
                scores = tile_score_fn(
                    plan, ex_t, row_pos(plan, iq), k_pos, edge, True, one_segment
                )
                st, score_vjp = jax.vjp(scores, st, biases)
                et = jnp.exp(st - m_t)
                # One exp per tile: without the barrier XLA recomputes it in
                # the fusion that forms ds.
                et = lax.optimization_barrier(et)
                pt = et
                if key is not None:  # P' = D * P: dV = P'^T dO, dP = D * dP'
                    rows = row_pos(plan, iq)[None, None, None, :]
                    keep = _keep(plan, key, rows, k_pos[:, None], True)
                    pt = apply_dropout(spec.dropout, et, keep)
                dv_t = dv_t + jnp.einsum(
                    "bhst,bhtd->bhsd", pt.astype(p_dtype), do_t, preferred_element_type=cdt
                )
                dpt = jnp.einsum("bhsd,bhtd->bhst", v_t, do_t, preferred_element_type=cdt)
                if key is not None:
                    dpt = apply_dropout(spec.dropout, dpt, keep)
                dst, dbias_t = score_vjp(et * (dpt - delta_t))
                # Rows are (group, position): contracting them sums the group.
                dk_t = dk_t + jnp.einsum("bhst,bhtd->bhsd", dst, a, preferred_element_type=cdt)
                dq_t = jnp.einsum("bhds,bhst->bhdt", k_tr, dst, preferred_element_type=cdt)
                dqt = put_q_tile(plan, dqt, q_tile(plan, dqt, iq, -1) + dq_t, iq, -1)
                dbias = {
                    i: add_at(dbias[i], g, (3, 4), (iq * bq, ik * bk)) for i, g in dbias_t.items()
                }
                return dqt, dk_t, dv_t, dbias

            return body

        zeros = (jnp.zeros((B, Hkv, bk, D), cdt), jnp.zeros((B, Hkv, bk, Dv), cdt))
        state = (dqt, *varying(zeros, dqt, dk, dv, dbias), dbias)

        # As in the forward: tiles whose segment ids cannot meet are skipped
        # (with a finite c their keys still get dV from the rows' weights),
        # tiles inside one segment run without its mask.
        def skipped(iq, state):
            if not finite_c:
                return state
            dqt, dk_t, dv_t, dbias = state
            w = jnp.exp(c - q_tile(plan, m, iq, -1)).astype(p_dtype).astype(cdt)
            dv_rows = jnp.einsum("bht,bhtd->bhd", w, q_tile(plan, do_n, iq))
            return dqt, dk_t, dv_t + dv_rows[:, :, None], dbias

        op = plan.segments
        run = segmented(
            plan,
            q_body,
            skipped,
            lambda iq: (slice_t(ex_k[op.q_index], iq * bq, bq), ex_k[op.kv_index]),
        )
        table = ("qstart", "qfull", "qfe", "qend")
        dqt, dk_t, dv_t, dbias = tile_runs(plan, table, ik, run, state)
        dk = lax.dynamic_update_slice_in_dim(dk, dk_t, ik * bk, axis=2)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_t, ik * bk, axis=2)
        return dqt, dk, dv, dbias

    stats = (m, delta_n)
    init = (
        jnp.zeros((B, Hkv, D) + gshape(spec, tp)[2:], cdt),  # dq^T, see `q_tile`
        jnp.zeros((B, Hkv, sp, D), cdt),
        jnp.zeros((B, Hkv, sp, Dv), cdt),
        {i: jnp.zeros(ex5[i].shape, cdt) for i in bias_idx},
    )
    inputs = (q, k, v, extras, out, m, den, dout)
    dq, dk, dv, dbias = loop(0, plan.nk, k_block, varying(init, inputs))
    dv = dv[:, :, :S]
    if plan.skipped_score is not None:
        dv = dv + _skipped_dv(plan, m, inv_den, do5)

    dq = jnp.moveaxis(dq[..., :T], 2, -1).reshape(B, H, T, D)
    if plan.q_scale != 1.0:
        dq = dq * jnp.asarray(plan.q_scale, cdt)  # the chain rule through the fold
    dq = dq.astype(q.dtype)
    grads = {i: g[:, :, :, : extras[i].shape[2], : extras[i].shape[3]] for i, g in dbias.items()}
    dextras = extra_cotangents(extras, wanted, grads)
    return dq, dk[:, :, :S].astype(k.dtype), dv.astype(v_dtype), dextras


def _centred(spec, v, out5, cdt):
    """``v`` and ``out5`` less V's mean over the keys, where that changes no dS.

    dS = p * (dP - delta), dP = dO V^T and delta = rowsum(dO * O) from two
    separately rounded products: a component V's keys share (a large mean)
    cancels there and leaves both products' rounding, which autodiff's
    delta = rowsum(p * dP) partly cancels and this one does not (2-3x its dq
    and dk error).  Where each row's weights sum to one, dS is the same for
    V - c and O - c with any c constant along the keys.  Not with dropout's
    keep-mask or a sink, whose weights do not sum to one."""
    if spec.dropout is not None or spec.sink is not None:
        return v, out5
    centre = jnp.mean(v.astype(cdt), axis=2, keepdims=True)  # [B, Hkv, 1, Dv]
    v = v.astype(cdt) - centre
    return v, out5.astype(cdt) - (centre if spec.groups == 1 else centre[:, :, None])


def _skipped_dv(plan: Plan, m, inv_den, do5):
    """dV from skipped keys: every skipped key j of query row i has weight
    exp(c - m_i) / l_i, so dv[j] sums the weighted dO of every row whose block
    skips j.  Query block iq skips the key blocks outside [0, khead[iq]) and
    [kstart[iq], kend[iq]): the sum is one per key block, a static 0/1 matrix
    times the per-query-block sums."""
    spec, cdt = plan.spec, plan.cdt
    B, Hkv, G, Dv = spec.batch, spec.kv_heads, spec.groups, spec.v_head_dim
    c = skipped_score_of(plan, cdt)
    w = (jnp.exp(c - m) * inv_den).astype(spec.p_dtype).astype(cdt)  # [B,Hkv,G,Tp]
    w = w.reshape(B, Hkv, G, plan.nq, plan.bq)
    do = do5.astype(cdt).reshape(B, Hkv, G, plan.nq, plan.bq, Dv)
    per_block = jnp.einsum("bhgqt,bhgqtd->bhqd", w, do)
    heads = plan.khead or (0,) * plan.nq
    ends = list(zip(heads, plan.kstart, plan.kend, strict=True))
    skips = [[float(not (jb < h or s <= jb < e)) for h, s, e in ends] for jb in range(plan.nk)]
    skips = np.array(skips, cdt)
    per_key_block = jnp.einsum("jq,bhqd->bhjd", skips, per_block)
    dv = jnp.broadcast_to(per_key_block[:, :, :, None], (B, Hkv, plan.nk, plan.bk, Dv))
    return dv.reshape(B, Hkv, plan.nk * plan.bk, Dv)[:, :, : spec.kv_len]


# --------------------------------------------------------------------------- dropout, sinks


def _split_out(op, extras, placeholder):
    """``(extras[op.index], extras)`` with a placeholder in its place (the score
    tiles never read it), or ``(None, extras)`` without ``op``."""
    if op is None:
        return None, tuple(extras)
    rest = tuple(placeholder if i == op.index else x for i, x in enumerate(extras))
    return extras[op.index], rest


def _split_key(spec, extras):
    """The `Dropout` op's key data, split out of the extras (`_split_out`)."""
    return _split_out(spec.dropout, extras, jnp.ones((1, 1, 1, 1), bool))


def _split_sink(spec, extras, cdt):
    """The `Sink` op's logits, split out of the extras (`_split_out`)."""
    return _split_out(spec.sink, extras, jnp.zeros((1, 1, 1, 1), cdt))


def _sink_cotangent(plans: Plans, sink, out, m, den, dout):
    """The sink logits' cotangent (`reference.sink_cotangent`) from the saved
    statistics, which include the sink."""
    spec, cdt = plans.spec, plans.fwd.cdt
    full = (spec.batch, spec.heads, spec.q_len)
    delta = jnp.einsum("bhtd,bhtd->bht", dout.astype(cdt), out.astype(cdt))
    return sink_cotangent(sink, m.reshape(full), den.reshape(full), delta)


def _keep(plan: Plan, key, t, s, transposed: bool):
    """The keep-mask of a tile ``[B, Hkv, rows, bk]`` (``[B, Hkv, bk, rows]``
    when ``transposed``); ``t``/``s`` are the rows' query positions and the keys'
    positions, shaped to broadcast along their tile axes.  Rows are (group,
    position): query head ``h = hkv * G + row // bq``."""
    spec = plan.spec
    G, bq = spec.groups, plan.bq
    b = jnp.arange(spec.batch)[:, None, None, None]
    group = jnp.arange(G * bq) // bq
    group = group[None, None, None, :] if transposed else group[None, None, :, None]
    h = jnp.arange(spec.kv_heads)[None, :, None, None] * G + group
    return keep_mask(spec.dropout, key, b, h, t, s)


# --------------------------------------------------------------------------- custom_vjp


def _attention_impl(plans: Plans, q, k, v, extras):
    spec = plans.spec
    if plans.head_loop:
        out5, m, den = heads.forward_heads(forward, plans.fwd, spec, q, k, v, extras)
    else:
        out5, m, den = forward(plans.fwd, q, k, v, extras)
    out = out5[..., : spec.q_len, :].reshape(spec.out_shape)
    # Statistics of the real rows only: the backward pads to its own tiling.
    return out, (m[..., : spec.q_len], den[..., : spec.q_len])


def step_forward(plans: Plans, q, k, v, extras):
    """One ring step (`Kernel.step_forward`): the output and the row max and
    sum, ``[B, H, T]``."""
    spec = plans.spec
    out, (m, den) = _attention_impl(plans, q, k, v, extras)
    rows = (spec.batch, spec.heads, spec.q_len)
    return out, m.reshape(rows), den.reshape(rows)


def step_backward(plans: Plans, q, k, v, extras, out, m, den, dout, wanted):
    """A ring step's gradients from the global statistics and output
    (`Kernel.step_backward`): the backward's own recurrence, which recomputes
    ``p = exp(s - m) / den`` from exactly these."""
    spec = plans.spec
    rows = gshape(spec, spec.q_len)
    args = (q, k, v, extras, out, m.reshape(rows), den.reshape(rows), dout, tuple(wanted))
    if plans.head_loop:
        return heads.backward_heads(backward, plans.bwd, spec, *args)
    return backward(plans.bwd, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(plans, q, k, v, extras):
    return _attention_impl(plans, q, k, v, extras)[0]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
    """Which extras need a cotangent (static, so it rides along the residuals)."""

    extras: tuple[bool, ...]


def _attention_fwd(plans, q, k, v, extras):
    # symbolic_zeros: each array arrives as CustomVJPPrimal(value, perturbed),
    # which tells us whether a bias gradient is wanted at all.  Without this the
    # backward would accumulate, e.g., a [1, H, T, S] bias gradient nobody uses
    # (XLA does not remove it from the loops).
    wanted = _Wanted(tuple(x.perturbed for x in extras))
    q, k, v = q.value, k.value, v.value
    extras = tuple(x.value for x in extras)
    out, (m, den) = _attention_impl(plans, q, k, v, extras)
    # Residuals: inputs, output and two [B, H, T] statistics; never a T x S array.
    return out, (q, k, v, extras, out, m, den, wanted)


def _attention_bwd(plans, res, dout):
    q, k, v, extras, out, m, den, wanted = res
    if isinstance(dout, SymbolicZero):
        return None, None, None, tuple(None for _ in extras)
    op = plans.spec.sink
    inner = wanted.extras  # the sink's cotangent is computed here, not per tile
    if op is not None:
        inner = tuple(w and i != op.index for i, w in enumerate(inner))
    args = (q, k, v, extras, out, m, den, dout, inner)
    if plans.head_loop:
        dq, dk, dv, dextras = heads.backward_heads(backward, plans.bwd, plans.spec, *args)
    else:
        dq, dk, dv, dextras = backward(plans.bwd, *args)
    if op is not None and wanted.extras[op.index]:
        dsink = _sink_cotangent(plans, extras[op.index], out, m, den, dout)
        dextras = tuple(dsink if i == op.index else g for i, g in enumerate(dextras))
    return dq, dk, dv, dextras


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
