"""Ring attention: a sequence-sharded site as a ring of per-block steps.

When q, k and v are sharded along their sequence axes over the same mesh
axes, every device holds one block of queries and one block of keys/values.
Instead of letting XLA all-gather K and V to full length on every device
(O(T) memory per device), the site runs inside ``shard_map`` as a ring:

* step ``s`` on device ``i`` attends its query block to the K/V block that
  started on device ``(i - s) mod n``, producing the block's output and its
  row logsumexp (statistics, never probabilities);
* the partial outputs are merged in float32 by logsumexp;
* K/V move one device along the ring (``ppermute``) between steps;
* with a causal mask, a step whose K/V block lies entirely after the query
  block is skipped (``lax.cond``), so a causal ring does about half the work.

The backward is a ring too (`jax.custom_vjp`): each device keeps its query
block and the saved output and logsumexp, recomputes each step's
probabilities from the statistics, accumulates dQ locally and sends dK/dV
around the ring with the K/V block they belong to; after ``n`` steps every
dK/dV block is back on its own device.

Supported score ops: scales and one causal mask (any offset); grouped-query
attention.  Sites with biases, dense masks or soft-caps keep the all-gather
program (`unsupported` says why).  The per-step work is plain JAX on blocks of
``(T/n) x (S/n)`` scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .spec import AttentionSpec, Causal, Scale


def unsupported(spec: AttentionSpec) -> str | None:
    """Why the ring cannot run ``spec`` (None: it can)."""
    other = [type(op).__name__ for op in spec.score_ops if not isinstance(op, Scale | Causal)]
    if other:
        return f"the ring supports scales and a causal mask, not {', '.join(sorted(set(other)))}"
    if len(spec.ops_of(Causal)) > 1:
        return "the ring supports one causal mask"
    return None


def ring_attention(q, k, v, spec: AttentionSpec, axis_name, axis_size: int):
    """Attention of local blocks ``q [B,H,T/n,D]``, ``k``/``v [B,Hkv,S/n,D]``
    inside ``shard_map`` over ``axis_name`` (``axis_size`` devices)."""
    return _ring(spec, axis_name, axis_size)(q, k, v)


@functools.lru_cache(maxsize=64)
def _ring(spec: AttentionSpec, axis_name, n: int):
    causal = spec.causal
    scale = spec.scale
    g = spec.groups
    perm = [(i, (i + 1) % n) for i in range(n)]

    def positions(step):
        """Global row and column offsets of this step's query and K/V blocks."""
        me = lax.axis_index(axis_name)
        src = (me - step) % n
        return me * spec.q_len, src * spec.kv_len

    def visible(q0, k0):
        """Whether any key of the K/V block is visible to the query block."""
        if causal is None:
            return jnp.bool_(True)
        return k0 <= q0 + spec.q_len - 1 + causal.offset

    def scores(qf, kb, q0, k0):
        s = jnp.einsum("bhgtd,bhsd->bhgts", qf, kb.astype(jnp.float32)) * scale
        if causal is not None:
            rows = q0 + jnp.arange(spec.q_len)[:, None]
            cols = k0 + jnp.arange(spec.kv_len)[None, :]
            s = jnp.where(cols <= rows + causal.offset, s, -jnp.inf)
        return s

    def grouped(x):  # [B, H, T, D] -> [B, Hkv, G, T, D]
        b, _, t, d = x.shape
        return x.reshape(b, spec.kv_heads, g, t, d)

    def forward(q, k, v):
        qf = grouped(q).astype(jnp.float32)
        b, hk, _, t, _ = qf.shape
        o = jnp.zeros((b, hk, g, t, spec.v_head_dim), jnp.float32)
        lse = jnp.full((b, hk, g, t), -jnp.inf, jnp.float32)
        kb, vb = k, v
        for step in range(n):
            q0, k0 = positions(step)

            def attend(o, lse, kb=kb, vb=vb, q0=q0, k0=k0):
                s = scores(qf, kb, q0, k0)
                m = jnp.max(s, axis=-1)
                m = jnp.where(jnp.isfinite(m), m, 0.0)
                p = jnp.exp(s - m[..., None])
                l_blk = jnp.sum(p, axis=-1)
                o_blk = jnp.einsum("bhgts,bhsd->bhgtd", p, vb.astype(jnp.float32))
                lse_blk = jnp.where(l_blk > 0, m + jnp.log(l_blk), -jnp.inf)
                o_blk = o_blk / jnp.where(l_blk > 0, l_blk, 1.0)[..., None]
                new = jnp.logaddexp(lse, lse_blk)
                safe = jnp.where(jnp.isfinite(new), new, 0.0)
                w_old = jnp.where(jnp.isfinite(lse), jnp.exp(lse - safe), 0.0)
                w_blk = jnp.where(jnp.isfinite(lse_blk), jnp.exp(lse_blk - safe), 0.0)
                return o * w_old[..., None] + o_blk * w_blk[..., None], new

            o, lse = lax.cond(visible(q0, k0), attend, lambda o, lse: (o, lse), o, lse)
            if step < n - 1:
                kb, vb = lax.ppermute((kb, vb), axis_name, perm)
        out = o.reshape(b, hk * g, t, spec.v_head_dim).astype(spec.out_dtype)
        return out, (q, k, v, o, lse)

    def backward(res, dout):
        q, k, v, o, lse = res
        qf = grouped(q).astype(jnp.float32)
        do = grouped(dout).astype(jnp.float32)
        delta = jnp.sum(do * o, axis=-1)  # rowsum(dO * O)
        dq = jnp.zeros_like(qf)
        kb, vb = k, v
        dkb = jnp.zeros(k.shape, jnp.float32)
        dvb = jnp.zeros(v.shape, jnp.float32)
        for step in range(n):
            q0, k0 = positions(step)

            def grads(dq, dkb, dvb, kb=kb, vb=vb, q0=q0, k0=k0):
                s = scores(qf, kb, q0, k0)
                p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - lse[..., None]), 0.0)
                dvb = dvb + jnp.einsum("bhgts,bhgtd->bhsd", p, do)
                dp = jnp.einsum("bhgtd,bhsd->bhgts", do, vb.astype(jnp.float32))
                ds = p * (dp - delta[..., None]) * scale
                dq = dq + jnp.einsum("bhgts,bhsd->bhgtd", ds, kb.astype(jnp.float32))
                dkb = dkb + jnp.einsum("bhgts,bhgtd->bhsd", ds, qf)
                return dq, dkb, dvb

            dq, dkb, dvb = lax.cond(visible(q0, k0), grads, lambda *a: a, dq, dkb, dvb)
            # dK/dV travel with their K/V block; after n moves they are home.
            kb, vb, dkb, dvb = lax.ppermute((kb, vb, dkb, dvb), axis_name, perm)
        b, hk, _, t, d = qf.shape
        return (
            dq.reshape(b, hk * g, t, d).astype(q.dtype),
            dkb.astype(k.dtype),
            dvb.astype(v.dtype),
        )

    @jax.custom_vjp
    def ring(q, k, v):
        return forward(q, k, v)[0]

    ring.defvjp(forward, backward)
    return ring
