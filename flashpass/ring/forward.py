"""The ring's forward: ``n`` steps of one query block against the visiting
K/V blocks, merged by an online softmax in float32."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from flashpass import compat

from . import merge
from .step import RingStep


def forward(r: RingStep, q, k, v, extras):
    """The ring's output and the residuals its backward reads."""
    spec, g = r.spec, r.g
    qf = r.grouped(q).astype(jnp.float32)
    b, hk, _, t, _ = qf.shape
    # Running row max and sum, and the unnormalised output: a fill as large
    # as finfo.min survives differences of equal maxima exactly (a merge in
    # logsumexp form would round them away, and a fully masked row, which
    # the original averages over every key, would come out wrong).
    acc = jnp.zeros((b, hk, g, t, spec.v_head_dim), jnp.float32)
    m = jnp.full((b, hk, g, t), -jnp.inf, jnp.float32)
    total = jnp.zeros((b, hk, g, t), jnp.float32)
    if spec.sink is not None:  # a score of weight exp(sink - m) with no value
        m = r.sink_rows(extras)
        total = jnp.where(m == -jnp.inf, 0.0, 1.0)
    # (In the user's shard_map with check_vma: typed like the blocks they meet.)
    acc, m, total = (compat.vary_like(x, qf, k, v) for x in (acc, m, total))
    kb, vb, blocks = k, v, tuple(extras[i] for i in r.moving)
    for step in range(r.n):
        q0, k0 = r.positions(step)
        here = r.with_blocks(extras, blocks, k0)

        def attend(acc, m, total, step=step, kb=kb, vb=vb, q0=q0, k0=k0, here=here):
            def run(case, acc, m, total):
                return _step(r, case, q, qf, kb, vb, q0, k0, here, (acc, m, total))

            return r.by_case(step, run, acc, m, total)

        acc, m, total = lax.cond(r.visible(q0, k0, here), attend, lambda *a: a, acc, m, total)
        if step < r.n - 1:
            kb, vb, blocks = r.permute((kb, vb, blocks))
    o = acc / jnp.where(total > 0, total, 1.0)[..., None]
    out = o.reshape(b, hk * g, t, spec.v_head_dim).astype(spec.out_dtype)
    return out, (q, k, v, extras, o, m, total)


def _step(r: RingStep, case, q, qf, kb, vb, q0, k0, here, state):
    """One case of a step: ``state`` (``acc, m, total``) merged with the
    visiting block's scores."""
    if case.skip:
        return state
    if case.kernel is not None:  # the kernel's block, merged by its statistics
        o_b, m_b, den_b = case.kernel.step_forward(
            case.spec, q, kb, vb, r.step_extras(case, here, k0), interpret=r.interpret
        )
        block = (r.grouped(o_b), r.stats5(m_b), r.stats5(den_b))
        return merge.merge_block(*state, *block)

    def chunk(r0, state):
        acc, m, total = state
        a, mc, tc = (r.take(x, r0) for x in state)
        s = r.scores(r.take(qf, r0), kb, q0 + r0, k0, r.rows_of(here, r0))
        m_new = jnp.maximum(mc, jnp.max(s, axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - base[..., None])
        old = jnp.where(jnp.isfinite(mc), jnp.exp(mc - base), 0.0)
        pd = r.dropped(p, r.keep_of(p, q0 + r0, k0, here))  # (sums keep them all)
        o_blk = jnp.einsum("bhgts,bhsd->bhgtd", pd, vb.astype(jnp.float32))
        a = a * old[..., None] + o_blk
        tc = tc * old + jnp.sum(p, axis=-1)
        return r.put(acc, a, r0), r.put(m, m_new, r0), r.put(total, tc, r0)

    return r.over_rows(chunk, state)
