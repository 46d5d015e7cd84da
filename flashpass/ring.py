"""Ring attention: a sequence-sharded site as a ring of per-block steps.

When q, k and v are sharded along their sequence axes over the same mesh
axes, every device holds one block of queries and one block of keys/values.
Instead of letting XLA all-gather K and V to full length on every device
(O(T) memory per device), the site runs inside ``shard_map`` as a ring:

* step ``s`` on device ``i`` attends its query block to the K/V block that
  started on device ``(i - s) mod n``, producing the block's output and its
  row max and sum (statistics, never probabilities);
* the partial outputs are merged in float32 (an online softmax);
* K/V move one device along the ring (``ppermute``) between steps, with
  what is read at key positions only (key segment ids, key padding masks and
  key biases, sharded like the keys);
* a step whose K/V block a causal or window mask excludes entirely is
  skipped (``lax.cond``), so a causal ring does about half the work.

The backward is a ring too (`jax.custom_vjp`): each device keeps its query
block and the saved output and row statistics, recomputes each step's
probabilities from the statistics, accumulates dQ locally and sends dK/dV
around the ring with the K/V block they belong to; after ``n`` steps every
dK/dV block is back on its own device.

Supported score ops (`RING_OPS`, applied in program order on global positions,
with the program's own fills, so rows a mask empties compute what the
original does): scales, causal (any offset), window, chunk and prefix masks,
and kv lengths (padding); segment ids (packed documents: the query ids stay,
the key ids travel with their K/V block); biases and boolean masks (a
``[.., T, S]`` one sharded along its queries and sliced at the visiting
block, a key-only one travelling with it; a bias's gradient too); logit
soft-caps (the backward differentiates the elementwise score ops, biases
included, with ``jax.vjp``); attention sinks (the row statistics start from
the sink logit, as in the blockwise kernel); grouped-query attention;
dropout (the program's keep-mask regenerated from its key at global
positions: batch and head indices too, `ShardedIndex`).
`unsupported` names any other op.

Each step runs a kernel that declares `Kernel.ring_step` where the step's
masks translate into a static spec (`ring_steps`: causal, window, full
attention and the position-free ops on evenly sharded self-attention), with
the step's row max and sum for the merge; the backward gives it the global
statistics and output, so its dQ, dK, dV are the block's exact share.  Other
steps run the ring's own plain JAX over chunks of the device's query rows
against the visiting block, at most `ROW_CHUNK_SCORES` scores at a time, so a
step's memory does not grow with the blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from flashpass import compat
from flashpass.kernels.dropout import apply_dropout, keep_mask
from flashpass.kernels.reference import sink_cotangent
from flashpass.ops import valid_lengths

from . import ring_steps
from .spec import (
    AttentionSpec,
    Bias,
    Causal,
    Chunk,
    Dropout,
    KvLengths,
    Mask,
    Prefix,
    Scale,
    Segments,
    Sink,
    Softcap,
    Window,
)

#: A ring step runs over chunks of its query rows with at most this many
#: scores each (over batch and heads): a step's memory is bounded however long
#: the device blocks are (a 4M-score f32 chunk is 16 MiB).
ROW_CHUNK_SCORES = 1 << 22

#: Score ops a ring step applies (in program order, with global positions), and
#: attention sinks (the row statistics start from them).
RING_OPS = (
    *(Scale, Softcap, Bias, Mask, Causal, Window, Chunk, Prefix, KvLengths, Segments, Sink),
    Dropout,
)


def unsupported(spec: AttentionSpec) -> str | None:
    """Why the ring cannot run ``spec`` (None: it can)."""
    other = [type(op).__name__ for op in spec.score_ops if not isinstance(op, RING_OPS)]
    if other:
        return (
            "the ring supports scales, soft-caps, biases, boolean, causal, window, chunk and "
            "prefix masks, kv lengths, segment ids, attention sinks and dropout, not "
            + ", ".join(sorted(set(other)))
        )
    return None


def plan(spec: AttentionSpec, n: int, q_global: bool, kernels, ctx):
    """Per step of the ring over ``n`` devices, how each case runs it
    (`ring_steps.plan_steps`; ``kernels`` in the order to try)."""
    return ring_steps.plan_steps(spec, n, q_global, can_skip(spec, q_global), kernels, ctx)


def can_skip(spec: AttentionSpec, q_global: bool) -> bool:
    """Whether a step whose K/V block the position masks exclude entirely may
    be skipped.  With kv lengths a row may keep no key at all, and the original
    then averages over every key's fill (those rings skip by length at run
    time only, `visible`); with segment ids too, unless its own position is
    kept: one id array read at both positions (`Segments.same`) and masks
    that all keep the diagonal.  A boolean mask may empty a row too."""
    segments = spec.ops_of(Segments)
    diagonal = all(op.same for op in segments) and any(
        isinstance(op, Causal) and op.offset >= 0 for op in spec.score_ops
    )
    diagonal = diagonal and all(
        op.left >= 0 and (op.right is None or op.right >= 0) for op in spec.ops_of(Window)
    )
    skippable = not spec.ops_of(KvLengths) and (not segments or (diagonal and q_global))
    return skippable and not spec.ops_of(Mask)


def ring_attention(
    q,
    k,
    v,
    extras,
    spec: AttentionSpec,
    axis_name,
    axis_size: int,
    q_global: bool = True,
    steps=None,
    interpret: bool = False,
    sharded_index=None,
):
    """Attention of local blocks ``q [B,H,T/n,D]``, ``k``/``v [B,Hkv,S/n,D]``
    inside ``shard_map`` over ``axis_name`` (``axis_size`` devices); ``extras``
    are the spec's extra arrays, their query axes local like q; along the
    keys, with ``q_global`` those read at key positions only (key ids and
    masks) are local like k, the others whole (in the user's ``shard_map``
    all are whole: its code built them for the gathered keys).
    ``q_global``: the score ops read query rows at their global positions
    (the sequence-sharded site); else at the local ones, as code inside the
    user's ``shard_map`` wrote them (keys are global either way).
    ``steps``: `plan`'s answer (None: every step in plain JAX); ``interpret``
    runs Pallas step kernels in interpret mode.  ``sharded_index``: how the
    local batch and head indices map to the global ones where the site is
    sharded along them too (`ShardedIndex`; dropout draws its keep-mask at
    global positions)."""
    if steps is None:
        steps = plan(spec, axis_size, q_global, [], None)
    args = (ROW_CHUNK_SCORES, steps, interpret, sharded_index)
    ring = _ring(spec, axis_name, axis_size, q_global, *args)
    return ring(q, k, v, tuple(extras))


def chunk_rows(spec: AttentionSpec, budget: int) -> int:
    """Query rows per chunk of a step: the largest divisor of the block's
    rows whose scores (all batch rows and heads) fit ``budget`` (at least 1)."""
    per_row = spec.batch * spec.heads * spec.kv_len
    fits = [d for d in range(1, spec.q_len + 1) if spec.q_len % d == 0 and d * per_row <= budget]
    return max(fits, default=1)


@dataclasses.dataclass(frozen=True)
class ShardedIndex:
    """The global canonical batch and head indices of a device's local ones.

    ``batch`` and ``heads`` list the digits of each canonical axis, most
    significant first: ``(local size, mesh axes, shards)`` of each role it
    is made of (``mesh axes`` empty where the role is whole)."""

    batch: tuple
    heads: tuple

    def of(self, digits, local):
        """Global indices of the local index array ``local``."""
        out = jnp.zeros_like(local)
        stride = math.prod(size for size, _, _ in digits)
        for size, axes, shards in digits:
            stride //= size
            d = (local // stride) % size
            if axes:
                d = d + lax.axis_index(axes[0] if len(axes) == 1 else axes) * size
            out = out * (size * shards) + d
        return out


@functools.lru_cache(maxsize=64)
def _ring(
    spec: AttentionSpec,
    axis_name,
    n: int,
    q_global: bool,
    budget: int,
    steps,
    interpret,
    sharded_index,
):
    g = spec.groups
    perm = [(i, (i + 1) % n) for i in range(n)]
    rows = chunk_rows(spec, budget)
    chunks = spec.q_len // rows

    def positions(step):
        """Row and (global) column offsets of this step's query and K/V blocks."""
        me = lax.axis_index(axis_name)
        src = (me - step) % n
        return (me * spec.q_len if q_global else 0), src * spec.kv_len

    # Steps whose K/V block every position mask excludes are skipped (where
    # `can_skip`); with kv lengths a step is skipped only when, at run time,
    # every row keeps key 0 (each length >= 1; only causal masks besides,
    # which keep it too) and no row's length reaches the block; with segment
    # ids (`can_skip`) when no query id meets a key id of the visiting block.
    lengths = spec.ops_of(KvLengths)
    segments = spec.ops_of(Segments)
    skippable = can_skip(spec, q_global)
    # Extras that vary along the keys: read at key positions only and, on a
    # sequence-sharded site, sharded like k (`moving`: they travel with K/V),
    # or whole along the keys (`sliced` at the visiting block).
    keyed = {op.kv_index for op in segments}
    keyed |= {op.index for op in spec.score_ops if isinstance(op, Bias | Mask)}
    keyed = {i for i in keyed if spec.extras[i].shape[3] > 1}
    moving = tuple(sorted(i for i in keyed if q_global and spec.extras[i].shape[2] == 1))
    sliced = tuple(sorted(keyed - set(moving)))
    biases = tuple(op.index for op in spec.ops_of(Bias))  # (their cotangents)
    by_length = bool(lengths) and all(
        isinstance(op, Scale | Softcap | Causal | KvLengths | Sink) for op in spec.score_ops
    )

    def visible(q0, k0, extras):
        """Whether the K/V block at ``k0`` (``extras`` with its key ids) can
        hold a key the query block sees."""
        ok = jnp.bool_(True)
        if not (skippable or by_length):
            return ok
        for op in segments:  # some query id among the block's key ids
            ok &= jnp.any(heads5(extras[op.q_index]) == heads5(extras[op.kv_index]))
        q_last, k_last = q0 + spec.q_len - 1, k0 + spec.kv_len - 1
        for op in spec.score_ops:
            if isinstance(op, Causal):
                ok &= k0 <= q_last + op.offset
            elif isinstance(op, Window):
                ok &= k_last >= q0 - op.left
                if op.right is not None:
                    ok &= k0 <= q_last + op.right
        if by_length:
            valid = [valid_lengths(op, extras[op.index], spec.kv_len * n) for op in lengths]
            for x in valid:
                ok &= k0 < jnp.max(x)
            # A row with no key needs every key's fill: then nothing is skipped.
            ok |= jnp.any(jnp.stack([jnp.min(x) for x in valid]) < 1)
        return ok

    def scores(qf, kb, q0, k0, extras):
        """The step's scores after every score op, in program order."""
        raw = jnp.einsum("bhgtd,bhsd->bhgts", qf, kb.astype(jnp.float32))
        return score_ops(raw, q0, k0, extras)

    def score_ops(s, q0, k0, extras):
        """The spec's score ops on raw scores ``s`` (global positions ``q0``,
        ``k0``): elementwise, so the backward differentiates it (`jax.vjp`)."""
        rows = q0 + jnp.arange(s.shape[-2])[:, None]
        cols = k0 + jnp.arange(s.shape[-1])[None, :]
        for op in spec.score_ops:
            if isinstance(op, Sink | Dropout):
                continue  # the row statistics (`sink_rows`) or the weights (`dropped`)
            if isinstance(op, Scale):
                s = s * op.value
                continue
            if isinstance(op, Softcap):
                s = op.cap * jnp.tanh(s / op.cap)
                continue
            if isinstance(op, Bias):
                s = s + heads5(extras[op.index]).astype(jnp.float32)
                continue
            if isinstance(op, Mask):
                keep = heads5(extras[op.index])
            elif isinstance(op, Causal):
                keep = cols <= rows + op.offset
            elif isinstance(op, KvLengths):
                valid = valid_lengths(op, extras[op.index], spec.kv_len * n)
                keep = cols < heads5(valid)  # (T axis: the local queries' own limits, or 1)
            elif isinstance(op, Segments):
                keep = heads5(extras[op.q_index]) == heads5(extras[op.kv_index])
            else:
                keep = op.keep(rows, cols, extras)
            s = jnp.where(keep, s, op.fill)
        return s

    def heads5(x):
        """A ``[B|1, H|1, T|1, S|1]`` extra as ``[B|1, Hkv|1, G|1, T|1, S|1]``."""
        b, h, t, s = x.shape
        return x.reshape(b, *((h // g, g) if h > 1 else (1, 1)), t, s)

    def with_blocks(extras, blocks, k0):
        """``extras`` as the visiting K/V block at ``k0`` reads them."""
        out = list(extras)
        for i, block in zip(moving, blocks, strict=True):
            out[i] = block
        for i in sliced:
            out[i] = lax.dynamic_slice_in_dim(extras[i], k0, spec.kv_len, axis=3)
        return tuple(out)

    def over_rows(body, state):
        """``body(r0, state)`` for each chunk of query rows starting at ``r0``."""
        if chunks == 1:
            return body(0, state)
        return lax.fori_loop(0, chunks, lambda c, st: body(c * rows, st), state)

    def take(x, r0):
        """Rows ``[r0, r0 + rows)`` of a grouped array (query axis 3)."""
        return x if chunks == 1 else lax.dynamic_slice_in_dim(x, r0, rows, axis=3)

    def put(x, y, r0):
        return y if chunks == 1 else lax.dynamic_update_slice_in_dim(x, y, r0, axis=3)

    def rows_of(extras, r0):
        """The extras' rows of one chunk (those with a query axis)."""
        if chunks == 1:
            return extras
        return tuple(
            lax.dynamic_slice_in_dim(x, r0, rows, axis=2) if x.shape[2] == spec.q_len else x
            for x in extras
        )

    def keep_of(w, q0, k0, extras):
        """The program's keep-mask of weights ``w [B, Hkv, G, t, s]`` (rows at
        ``q0``, keys at ``k0``), regenerated at global positions (batch and
        heads too, `ShardedIndex`), or None without dropout."""
        op = spec.dropout
        if op is None:
            return None
        b = jnp.arange(spec.batch)
        h = jnp.arange(spec.kv_heads)[:, None] * g + jnp.arange(g)
        if sharded_index is not None:  # the global indices of the local ones
            b = sharded_index.of(sharded_index.batch, b)
            h = sharded_index.of(sharded_index.heads, h)
        b, h = b[:, None, None, None, None], h[None, :, :, None, None]
        t = q0 + jnp.arange(w.shape[-2])[:, None]
        s = k0 + jnp.arange(w.shape[-1])[None, :]
        return keep_mask(op, extras[op.index], b, h, t, s)

    def dropped(w, keep):
        return w if keep is None else apply_dropout(spec.dropout, w, keep)

    def replaced(extras, new: dict):
        return tuple(new.get(i, x) for i, x in enumerate(extras))

    def add_part(total, part, r0, k0):
        """``total`` (an extra's cotangent) plus ``part`` at rows ``r0`` (when
        it has a query axis) and keys ``k0``."""
        r0 = r0 if total.shape[2] > 1 else 0
        at = (0, 0, r0, k0)
        old = lax.dynamic_slice(total, at, part.shape)
        return lax.dynamic_update_slice(total, old + part.astype(total.dtype), at)

    def grouped(x):  # [B, H, T, D] -> [B, Hkv, G, T, D]
        b, _, t, d = x.shape
        return x.reshape(b, spec.kv_heads, g, t, d)

    def sink_rows(extras):
        """The local query rows' sink logits ``[B, Hkv, G, T]`` (float32)."""
        sink = extras[spec.sink.index].astype(jnp.float32)[..., 0]
        full = (spec.batch, spec.heads, spec.q_len)
        return jnp.broadcast_to(sink, full).reshape(spec.batch, spec.kv_heads, g, spec.q_len)

    def by_case(step, run, *state):
        """``run(case, *state)`` for this device's case of ``step`` (its own
        block, or a wrapped one on devices ``i < step``)."""
        cases = steps[step]
        if len(cases) == 1 or cases[0] == cases[1]:
            return run(cases[0], *state)
        own = lax.axis_index(axis_name) >= step
        return lax.cond(own, lambda *st: run(cases[0], *st), lambda *st: run(cases[1], *st), *state)

    def step_extras(case, here, k0):
        """The extras as the case's kernel reads them: kv lengths shifted to
        the visiting block (the bias, mask and id arrays are already its)."""
        out = list(here)
        for i in {op.index for op in case.spec.ops_of(KvLengths)}:
            out[i] = ring_steps.shifted_lengths(here[i], k0, length_bound)
        return tuple(out)

    length_bound = spec.kv_len * n + max((abs(op.shift) for op in lengths), default=0) + 1

    def stats5(x):  # [B, H, T] -> [B, Hkv, G, T]
        return x.reshape(spec.batch, spec.kv_heads, g, -1)

    def forward(q, k, v, extras):
        qf = grouped(q).astype(jnp.float32)
        b, hk, _, t, _ = qf.shape
        # Running row max and sum, and the unnormalised output: a fill as large
        # as finfo.min survives differences of equal maxima exactly (a merge in
        # logsumexp form would round them away, and a fully masked row, which
        # the original averages over every key, would come out wrong).
        acc = jnp.zeros((b, hk, g, t, spec.v_head_dim), jnp.float32)
        m = jnp.full((b, hk, g, t), -jnp.inf, jnp.float32)
        total = jnp.zeros((b, hk, g, t), jnp.float32)
        if spec.sink is not None:  # a score of weight exp(sink - m) with no value
            m = sink_rows(extras)
            total = jnp.where(m == -jnp.inf, 0.0, 1.0)
        # (In the user's shard_map with check_vma: typed like the blocks they meet.)
        acc, m, total = (compat.vary_like(x, qf, k, v) for x in (acc, m, total))
        kb, vb, blocks = k, v, tuple(extras[i] for i in moving)
        for step in range(n):
            q0, k0 = positions(step)
            here = with_blocks(extras, blocks, k0)

            def attend(acc, m, total, step=step):
                return by_case(step, run, acc, m, total)

            def run(case, acc, m, total, kb=kb, vb=vb, q0=q0, k0=k0, here=here):
                if case.skip:
                    return acc, m, total
                if case.kernel is not None:  # the kernel's block, merged by its statistics
                    o_b, m_b, den_b = case.kernel.step_forward(
                        case.spec, q, kb, vb, step_extras(case, here, k0), interpret=interpret
                    )
                    block = (grouped(o_b), stats5(m_b), stats5(den_b))
                    return ring_steps.merge_block(acc, m, total, *block)

                def chunk(r0, state):
                    acc, m, total = state
                    a, mc, tc = (take(x, r0) for x in state)
                    s = scores(take(qf, r0), kb, q0 + r0, k0, rows_of(here, r0))
                    m_new = jnp.maximum(mc, jnp.max(s, axis=-1))
                    base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                    p = jnp.exp(s - base[..., None])
                    old = jnp.where(jnp.isfinite(mc), jnp.exp(mc - base), 0.0)
                    pd = dropped(p, keep_of(p, q0 + r0, k0, here))  # (sums keep them all)
                    o_blk = jnp.einsum("bhgts,bhsd->bhgtd", pd, vb.astype(jnp.float32))
                    a = a * old[..., None] + o_blk
                    tc = tc * old + jnp.sum(p, axis=-1)
                    return put(acc, a, r0), put(m, m_new, r0), put(total, tc, r0)

                return over_rows(chunk, (acc, m, total))

            acc, m, total = lax.cond(visible(q0, k0, here), attend, lambda *a: a, acc, m, total)
            if step < n - 1:
                kb, vb, blocks = lax.ppermute((kb, vb, blocks), axis_name, perm)
        o = acc / jnp.where(total > 0, total, 1.0)[..., None]
        out = o.reshape(b, hk * g, t, spec.v_head_dim).astype(spec.out_dtype)
        return out, (q, k, v, extras, o, m, total)

    def backward(res, dout):
        q, k, v, extras, o, m, total = res
        base = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
        scale_back = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)[..., None]
        qf = grouped(q).astype(jnp.float32)
        do = grouped(dout).astype(jnp.float32)
        delta = jnp.sum(do * o, axis=-1)  # rowsum(dO * O)
        rows = (spec.batch, spec.heads, spec.q_len)
        o_out, m_out, den_out = ring_steps.global_stats(o, m, total, rows)  # (kernel steps)
        kb, vb, blocks = k, v, tuple(extras[i] for i in moving)
        # Bias cotangents: a moving bias's travels with its block like dK; the
        # others stay and take each step's (and chunk's) part at its place.
        zeros = {i: jnp.zeros(extras[i].shape, jnp.float32) for i in biases}
        dstay = {i: z for i, z in zeros.items() if i not in moving}
        dmove = {i: z for i, z in zeros.items() if i in moving}
        grads0 = (jnp.zeros_like(qf), jnp.zeros(k.shape, jnp.float32))
        grads0 += (jnp.zeros(v.shape, jnp.float32), dstay, dmove)
        dq, dkb, dvb, dstay, dmove = jax.tree.map(
            lambda x: compat.vary_like(x, qf, k, v, dout), grads0
        )
        for step in range(n):
            q0, k0 = positions(step)
            here = with_blocks(extras, blocks, k0)

            def grads(state, step=step):
                return by_case(step, step_grads, state)

            def step_grads(case, state, kb=kb, vb=vb, q0=q0, k0=k0, here=here):
                if case.skip:
                    return state
                if case.kernel is not None:  # the block's share, from the global statistics
                    dq, dkb, dvb, dstay, dmove = state
                    wanted = tuple(i in biases for i in range(len(extras)))
                    dq_b, dk_b, dv_b, dex = case.kernel.step_backward(
                        case.spec, q, kb, vb, step_extras(case, here, k0), o_out, m_out,
                        den_out, dout, wanted, interpret=interpret,
                    )  # fmt: skip
                    dq = dq + grouped(dq_b).astype(jnp.float32)
                    dkb, dvb = dkb + dk_b.astype(jnp.float32), dvb + dv_b.astype(jnp.float32)
                    dmove = {i: x + dex[i].astype(jnp.float32) for i, x in dmove.items()}
                    dstay = {i: add_part(x, dex[i].astype(jnp.float32), 0, k0 if i in sliced else 0)
                             for i, x in dstay.items()}  # fmt: skip
                    return dq, dkb, dvb, dstay, dmove
                kf, vf = kb.astype(jnp.float32), vb.astype(jnp.float32)

                def chunk(r0, state):
                    dq, dkb, dvb, dstay, dmove = state
                    qc, doc, ex = take(qf, r0), take(do, r0), rows_of(here, r0)
                    raw = jnp.einsum("bhgtd,bhsd->bhgts", qc, kf)
                    bias = {i: ex[i] for i in biases}

                    def ops(r, bias):
                        return score_ops(r, q0 + r0, k0, replaced(ex, bias))

                    s, score_vjp = jax.vjp(ops, raw, bias)
                    p = jnp.exp(s - take(base, r0)) * take(scale_back, r0)  # the forward's
                    keep = keep_of(p, q0 + r0, k0, here)  # (one mask for dV and dP)
                    dvb = dvb + jnp.einsum("bhgts,bhgtd->bhsd", dropped(p, keep), doc)
                    # Dropped weights P' = D * P: dP = D * dP'.
                    dp = dropped(jnp.einsum("bhgtd,bhsd->bhgts", doc, vf), keep)
                    # Through the score ops (scales, soft-cap, biases; zero where a
                    # mask replaced it).
                    ds, dbias = score_vjp(p * (dp - take(delta, r0)[..., None]))
                    dqc = take(dq, r0) + jnp.einsum("bhgts,bhsd->bhgtd", ds, kf)
                    dkb = dkb + jnp.einsum("bhgts,bhgtd->bhsd", ds, qc)
                    dmove = {i: x + dbias[i] for i, x in dmove.items()}
                    dstay = {i: add_part(x, dbias[i], r0, k0 if i in sliced else 0)
                             for i, x in dstay.items()}  # fmt: skip
                    return put(dq, dqc, r0), dkb, dvb, dstay, dmove

                return over_rows(chunk, state)

            state = (dq, dkb, dvb, dstay, dmove)
            dq, dkb, dvb, dstay, dmove = lax.cond(
                visible(q0, k0, here), grads, lambda state: state, state
            )
            # dK/dV travel with their K/V block; after n moves they are home.
            if step < n - 1:
                kb, vb, blocks = lax.ppermute((kb, vb, blocks), axis_name, perm)
            dkb, dvb, dmove = lax.ppermute((dkb, dvb, dmove), axis_name, perm)
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

    @jax.custom_vjp
    def ring(q, k, v, extras):
        return forward(q, k, v, extras)[0]

    ring.defvjp(forward, backward)
    return ring
