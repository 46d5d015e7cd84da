"""Load-balanced (zig-zag) causal rings.

In a causal ring over the user's contiguous layout, device ``i`` holds
sequence block ``i`` and does ``i + 1`` of the ``n`` steps' work: the others
skip theirs and wait, so the last device sets every step's time.  Zig-zag
order splits the sequence into ``2n`` chunks of ``C`` and gives device ``j``
chunks ``j`` and ``2n - 1 - j``: then, with ``src = (j - s) mod n`` the
source of the visiting K/V pair at step ``s``,

* on devices ``j >= s`` (``s > 0``) both query chunks see the K/V pair's low
  chunk whole and its high chunk not at all: one unmasked ``2C x C`` block;
* on devices ``j < s`` the high query chunk sees both K/V chunks whole and the
  low one neither: one unmasked ``C x 2C`` block;
* at step 0, the low chunks' causal diagonal (``C x C``) and the high query
  chunk against both K/V chunks, causal at offset ``C`` (``C x 2C``),

so every device does the same work at every step.  The user's layout stays
as it is: the site moves each half-block of q, k and v to its zig-zag device
with two ``ppermute``s (a fixed permutation of chunks, ``O(T/n)`` per device,
like one ring step's K/V) and the output back the same way; JAX transposes
those permutes for the backward.  Each block runs a kernel declaring
`Kernel.ring_step` with a static spec, as `cases` does for the plain
ring.

Applied to sequence-sharded self-attention whose only mask is ``Causal(0)``
(with scales and soft-caps), blocks of one even length, when a step kernel
takes all four block specs; every other ring keeps the contiguous order
(`reason` says why).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass.kernels.base import CheckContext, Kernel

from ..ops import Positional
from ..select import choose
from ..spec import AttentionSpec
from . import merge


@dataclasses.dataclass(frozen=True)
class Zigzag:
    """A zig-zag ring's step kernel and its block specs (``C`` = half a
    device block): the diagonal ``C x C`` (causal), the high chunk against
    both K/V chunks at step 0 (``C x 2C``, causal at offset ``C``), and the
    unmasked ``2C x C`` (devices ``j >= s``) and ``C x 2C`` (``j < s``) blocks."""

    kernel: Kernel
    diag: AttentionSpec
    diag_hi: AttentionSpec
    own: AttentionSpec
    wrapped: AttentionSpec


def reason(spec: AttentionSpec, n: int, q_global: bool) -> str | None:
    """Why a ring over ``n`` devices keeps the contiguous order (None: it can
    be balanced)."""
    if not q_global:
        return "the queries are local (inside the user's shard_map)"
    if n < 2:
        return "one device"
    if spec.q_len != spec.kv_len or spec.q_len % 2:
        return "query and key blocks differ in length or are odd"
    if spec.extras:
        return "the site reads bias, mask or id arrays"
    masks = [op for op in spec.ops if not op.uniform]
    if len(masks) != 1 or not _causal(masks[0], spec.q_len * n):
        return "only a causal mask (offset 0) with scales and soft-caps is balanced"
    return None


def _causal(op, length: int) -> bool:
    """Whether ``op`` keeps, in each of ``length`` rows, the keys up to the
    row's own (its key ranges, `Positional.key_ranges`: ``j <= i``)."""
    if not isinstance(op, Positional):
        return False
    rows = np.arange(length)
    ranges = op.key_ranges(rows)
    return len(ranges) == 1 and ranges[0][0] is None and np.array_equal(ranges[0][1], rows + 1)


def plan(spec: AttentionSpec, n: int, q_global: bool, kernels, ctx: CheckContext | None):
    """The `Zigzag` of a ring, or None where it keeps the contiguous order:
    `reason`, or no kernel (of ``kernels``, in order) declaring ring steps
    takes every block spec (each checked and probed, `select.choose`)."""
    if reason(spec, n, q_global) is not None or ctx is None:
        return None
    c = spec.q_len // 2

    def block(t, s, offset):
        # The causal mask in the block's local positions (its own
        # `at_offset`, None where it keeps every key), the scales as they are.
        ops = []
        for op in spec.ops:
            local = op if op.uniform else None if offset is None else op.at_offset(offset, t, s)
            if local is not None:
                ops.append(local)
        return spec.with_ops(ops, q_len=t, kv_len=s, out_dtype="float32")

    specs = (block(c, c, 0), block(c, 2 * c, c), block(2 * c, c, None), block(c, 2 * c, None))
    for kernel in kernels:
        if kernel.ring_step and kernel.grad:
            if all(choose(s, [kernel], ctx, step=True)[0] is kernel for s in specs):
                return Zigzag(kernel, *specs)
    return None


def zigzag_attention(q, k, v, spec: AttentionSpec, axis_name, n: int, zz: Zigzag, interpret):
    """Causal attention of contiguous local blocks ``q [B,H,T/n,D]``,
    ``k``/``v [B,Hkv,S/n,D]`` inside ``shard_map`` over ``axis_name``, run
    as a zig-zag ring: the output in the contiguous layout."""
    move = _Moves(axis_name, n)
    qz, kz, vz = (move.to_zigzag(x) for x in (q, k, v))
    return move.from_zigzag(_ring(spec, axis_name, n, zz, interpret)(qz, kz, vz))


class _Moves:
    """The chunk permutation between the contiguous and the zig-zag layout
    (along axis 2 of ``[B, H, L, D]`` blocks)."""

    def __init__(self, axis_name, n: int):
        self.axis_name, self.n = axis_name, n
        home = [c if c < n else 2 * n - 1 - c for c in range(2 * n)]  # chunk -> zig-zag device
        self.even = [(i, home[2 * i]) for i in range(n)]  # chunk 2i (a device's first half)
        self.odd = [(i, home[2 * i + 1]) for i in range(n)]  # chunk 2i + 1 (its second)

    def _even_device(self):
        return lax.axis_index(self.axis_name) % 2 == 0

    def to_zigzag(self, x):
        first, second = jnp.split(x, 2, axis=2)
        a = lax.ppermute(first, self.axis_name, self.even)
        b = lax.ppermute(second, self.axis_name, self.odd)
        # Device j gets chunk j and chunk 2n-1-j: the even one of the two came
        # with the first halves.
        even = self._even_device()
        return jnp.concatenate([jnp.where(even, a, b), jnp.where(even, b, a)], axis=2)

    def from_zigzag(self, x):
        low, high = jnp.split(x, 2, axis=2)
        even = self._even_device()
        back = [(j, i) for i, j in self.even], [(j, i) for i, j in self.odd]
        first = lax.ppermute(jnp.where(even, low, high), self.axis_name, back[0])
        second = lax.ppermute(jnp.where(even, high, low), self.axis_name, back[1])
        return jnp.concatenate([first, second], axis=2)


def _ring(spec: AttentionSpec, axis_name, n: int, zz: Zigzag, interpret):
    g, c = spec.groups, spec.q_len // 2
    perm = [(i, (i + 1) % n) for i in range(n)]
    low, high, both = slice(0, c), slice(c, 2 * c), slice(0, 2 * c)
    kernel = zz.kernel

    def rows_of(x, rows):  # [B, H, 2C, ...] -> the rows
        return x[:, :, rows]

    def blocks(step):
        """``[(rows, keys, spec)]`` of this device's blocks at ``step``, for
        devices ``j >= step`` and ``j < step`` (the same at step 0)."""
        if step == 0:
            first = [(low, low, zz.diag), (high, both, zz.diag_hi)]
            return first, first
        return [(both, low, zz.own)], [(high, both, zz.wrapped)]

    def by_case(step, run, state):
        own, wrapped = blocks(step)
        if own == wrapped:
            return run(own, state)
        mine = lax.axis_index(axis_name) >= step
        return lax.cond(mine, lambda st: run(own, st), lambda st: run(wrapped, st), state)

    def grouped(x):  # [B, H, ...] -> [B, Hkv, G, ...]
        return x.reshape(spec.batch, spec.kv_heads, g, *x.shape[2:])

    def forward(q, k, v):
        shape = (spec.batch, spec.kv_heads, g, 2 * c)
        acc = jnp.zeros((*shape, spec.v_head_dim), jnp.float32)
        m = jnp.full(shape, -jnp.inf, jnp.float32)
        total = jnp.zeros(shape, jnp.float32)
        kb, vb = k, v
        for step in range(n):

            def run(parts, state, kb=kb, vb=vb):
                acc, m, total = state
                for rows, keys, sub in parts:
                    o_b, m_b, den_b = kernel.step_forward(
                        sub, rows_of(q, rows), kb[:, :, keys], vb[:, :, keys], interpret=interpret
                    )
                    a_r, m_r, t_r = merge.merge_block(
                        acc[..., rows, :], m[..., rows], total[..., rows],
                        *(grouped(x) for x in (o_b, m_b, den_b)),
                    )  # fmt: skip
                    acc = acc.at[..., rows, :].set(a_r)
                    m, total = m.at[..., rows].set(m_r), total.at[..., rows].set(t_r)
                return acc, m, total

            acc, m, total = by_case(step, run, (acc, m, total))
            if step < n - 1:
                kb, vb = lax.ppermute((kb, vb), axis_name, perm)
        o = acc / jnp.where(total > 0, total, 1.0)[..., None]
        out = o.reshape(spec.batch, spec.heads, 2 * c, spec.v_head_dim).astype(spec.out_dtype)
        return out, (q, k, v, o, m, total)

    def backward(res, dout):
        q, k, v, o, m, total = res
        rows4 = (spec.batch, spec.heads, 2 * c)
        o_out, m_out, den_out = merge.global_stats(o, m, total, rows4)
        dq = jnp.zeros(q.shape, jnp.float32)
        dkb, dvb = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
        kb, vb = k, v
        for step in range(n):

            def run(parts, state, kb=kb, vb=vb):
                dq, dkb, dvb = state
                for rows, keys, sub in parts:
                    picked = (rows_of(x, rows) for x in (q, o_out, m_out, den_out, dout))
                    q_r, o_r, m_r, den_r, do_r = picked
                    dq_b, dk_b, dv_b, _ = kernel.step_backward(
                        sub, q_r, kb[:, :, keys], vb[:, :, keys], (), o_r, m_r, den_r, do_r, (),
                        interpret=interpret,
                    )  # fmt: skip
                    dq = dq.at[:, :, rows].add(dq_b.astype(jnp.float32))
                    dkb = dkb.at[:, :, keys].add(dk_b.astype(jnp.float32))
                    dvb = dvb.at[:, :, keys].add(dv_b.astype(jnp.float32))
                return dq, dkb, dvb

            dq, dkb, dvb = by_case(step, run, (dq, dkb, dvb))
            # dK/dV travel with their K/V pair; after n moves they are home.
            if step < n - 1:
                kb, vb = lax.ppermute((kb, vb), axis_name, perm)
            dkb, dvb = lax.ppermute((dkb, dvb), axis_name, perm)
        return dq.astype(q.dtype), dkb.astype(k.dtype), dvb.astype(v.dtype)

    @jax.custom_vjp
    def ring(q, k, v):
        return forward(q, k, v)[0]

    ring.defvjp(forward, backward)
    return ring


def critical_path(n: int, zigzag: bool) -> float:
    """Score blocks of ``(T/n)^2`` on the slowest device over a causal ring's
    ``n`` steps (a diagonal block counts half): what bounds the ring's time
    when each step waits for its permute.  Contiguous: the last device's
    ``n - 1`` whole blocks and its diagonal; zig-zag: every device's ``n``
    half blocks, its step 0 counting ``1/8 + 3/8``."""
    if zigzag:
        return 0.5 + 0.5 * (n - 1)
    return (n - 1) + 0.5
