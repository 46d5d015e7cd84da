"""Flash attention in plain JAX (``lax`` loops, no Pallas): runs on every platform.

Forward: for each query block, an online softmax over key blocks (running max
``m``, row sum ``den``, unnormalised output ``acc``).  Backward: the
flash-attention-2 recurrence, recomputing each score tile from ``q``, ``k`` and
the row statistics saved by the forward.  No ``T x S`` array is ever formed,
only ``block_q x block_k`` tiles.  Under a causal mask, tiles entirely above
the diagonal are never visited (per-tile trip counts from a static table).

Score ops are applied per tile with `reference.apply_score_ops`, so this kernel
and the reference implement the spec with literally the same code; the backward
differentiates that same function per tile (``jax.vjp``), which gives the chain
rule through Scale/Bias/Mask/Causal/Softcap for free and cannot drift from it.

Layout: ``q`` is viewed as ``[B, Hkv, G, T, D]`` so grouped-query attention reads
each key/value head once (never repeated); extras become 5-D
``[b, hkv, g, t, s]`` with every axis either 1 (broadcast, never expanded) or
full, and are sliced per tile only along their full axes.

CPU notes (what XLA's CPU backend makes of this; see docs/benchmarks.md):
tiles default to about 4 MiB of scores (`default_blocks`), so the passes over a
tile (max, exp, sum) stay in L2; the backward works on key-major tiles so all
five products per tile take XLA's fast matmul path (it has none for a
transposed left operand); the scale is applied per query tile, not as a pass
over ``q``; and what the skipped causal blocks contribute is summed per key
block, without a cumulative sum over the keys.  Long sequences run one
(batch, kv head) unit at a time (`head_loop_pays`): XLA's CPU dot runs one
``[1024, 64] x [64, 1024]`` matmul faster than a batch of eight smaller ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from flashpass.spec import AttentionSpec, Bias, Causal, Mask, Scale, Softcap

from .base import CheckContext, Kernel
from .reference import apply_score_ops

#: Below this ``kv_len`` the original (naive) computation is faster on CPU, so
#: the kernel declines unless named explicitly.  Measured with
#:   python benchmarks/crossover.py
#: (2-core Xeon shared with other jobs; B=1, H=8, D=64, f32, T=S, default tiles;
#: median time naive / blockwise, > 1 means the kernel is faster):
#:
#:      S   fwd   fwd causal   fwd+bwd   fwd+bwd causal
#:    128  0.22         0.71      1.35             1.19
#:    256  0.66         0.93      1.39             1.14
#:    512  1.11         0.61      1.17             0.91
#:   1024  1.25         1.92      1.33             1.36
#:   2048  1.63         2.82      1.72             2.53
#:   4096  2.21         2.81      2.37             2.74
#:
#: Rows up to 512 swing by +-30% between runs (three runs: forward 0.2-1.1,
#: forward+backward 0.9-1.7); from 1024 up every mode won in every run (once
#: 0.95, 1024 fwd).  Below 1024 the forward (inference) loses: that is the cut.
#: With the tiles of `default_blocks` (2026-11-30, one run): 256: 1.02 / 0.83 /
#: 1.43 / 1.40; 512: 1.17 / 1.20 / 1.53 / 1.51; 1024: 1.65 / 2.11 / 1.87 /
#: 2.32.  512 won that once, not in every run before, so the cut stays.
CPU_MIN_KV_LEN = 1024

#: Score elements per tile, over all batch rows and heads (a tile is
#: ``[B, H, block_q, block_k]``): 1M f32 scores, 4 MiB, about the two cores'
#: L2.  XLA runs a tile as ~8 separate kernels (two products, max, exp, sum,
#: small updates), each split over the cores and joined again, so the passes
#: over a tile are cheap while it stays in cache and each kernel's fixed cost
#: is paid rarely enough.  Measured at B=1, H=8, D=64, S=4096-8192, causal,
#: on the shared 2-core machine (``python benchmarks/crossover.py --tiles``,
#: docs/benchmarks.md): 4M-score tiles (1024 x 512) were 7% slower than 1M
#: ones in the forward at load 1.5 and 10-30% under heavy load, 2M ones 0-20%;
#: in the backward 2M tiles were 4% slower, 4M ones 16%.
TILE_ELEMENTS = 1 << 20
#: The loop over whole blocks (query blocks in the forward, key blocks in the
#: backward) takes blocks of `OUTER_BLOCK`; the inner loop's tiles are as long
#: as the budget allows (forward 512 x 256, backward 256 x 512 at 8 heads).
#: Short sequences get one tile per axis (`_split`).
OUTER_BLOCK, MIN_BLOCK, MAX_INNER_BLOCK = 512, 128, 1024
#: The head loop (`head_loop_pays`): on CPU, long sequences run one (batch, kv
#: head) unit at a time, so every product is one ``[G*block_q, D] x [D, block_k]``
#: matmul instead of a batch of eight smaller ones, which XLA's CPU dot runs
#: faster (one 1024 x 1024 x 64 score product: 177-181 GFLOP/s; the same work
#: as eight 1024 x 128 ones: 141-151).  Units take tiles of `HEAD_LOOP_BLOCK` in
#: both axes.  Time with the head loop / without, B=1, H=8, D=64, f32, medians
#: of 5 (``python benchmarks/crossover.py --head-loop --sizes 1024 2048 4096
#: 8192 --reps 5``, 2026-11-30):
#:
#:      S   fwd   fwd+bwd   fwd causal   fwd+bwd causal
#:   1024  0.86      0.79         1.06             1.10
#:   2048  0.88      0.86         1.13             1.07
#:   4096  0.86      0.90         0.99             0.91
#:   8192  0.73      0.89         0.87             1.01 (min 0.85)
#:
#: With causal skipping the larger tiles waste more of the diagonal, so the
#: head loop starts at `HEAD_LOOP_MIN_CAUSAL_LEN` there (separate runs of the
#: backward alone at 8192: 0.87).
HEAD_LOOP_BLOCK = 1024
HEAD_LOOP_MIN_CAUSAL_LEN = 8192

_KNOWN_OPS = (Scale, Bias, Mask, Causal, Softcap)


# --------------------------------------------------------------------------- static plan


def _split(n: int, block: int) -> tuple[int, int]:
    """(tile, count) covering ``n`` with tiles of at most ``block`` rows.

    Tiles are balanced (``n=600, block=512`` gives 2 x 304, not 512 + 88 of
    which most is padding) and kept a multiple of 8 when ``block`` is.
    """
    if n <= block:
        return n, 1
    count = -(-n // block)
    tile = -(-n // count)
    if block % 8 == 0:
        tile = -(-tile // 8) * 8
    return tile, -(-n // tile)


def _final_fill(fill: float, post_ops) -> float:
    """The score a causally excluded key ends with after the ops that follow Causal."""
    with np.errstate(all="ignore"):
        c = np.float64(fill)
        for op in post_ops:
            c = c * op.value if isinstance(op, Scale) else op.cap * np.tanh(c / op.cap)
    return float(c)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one kernel invocation (hashable: a custom_vjp static arg)."""

    spec: AttentionSpec
    # Leading Scale ops folded into q ((c*q) @ k^T instead of c * (q @ k^T)): one
    # pass less over every score tile.  1.0 when nothing is folded.
    q_scale: float
    ops_edge: tuple  # score ops on tiles that straddle the diagonal or the padding
    ops_plain: tuple  # score ops on the other tiles: no causal `where`
    bq: int
    bk: int
    nq: int
    nk: int
    cdt: np.dtype  # compute dtype, at least float32
    # Causal block skipping.  Per query block: key tiles [0, kfull) are entirely
    # kept and unpadded, [kfull, kend) straddle the diagonal or the padding,
    # [kend, nk) are skipped.  Per key block: query tiles [qstart, qfull) are
    # edge tiles, [qfull, nq) plain ones.
    kfull: tuple[int, ...]
    kend: tuple[int, ...]
    qstart: tuple[int, ...]
    qfull: tuple[int, ...]
    # Final score of a skipped key when it is finite (e.g. a fill of -1e9, or
    # any fill followed by Softcap): skipped keys then still count, exactly,
    # through a closed form (all of them share that one score).  None when
    # skipped keys have score -inf (weight exactly 0) or nothing is skipped.
    skipped_score: float | None

    @property
    def padded_k(self) -> bool:
        return self.nk * self.bk > self.spec.kv_len

    @property
    def kend_key(self) -> tuple[int, ...]:
        """First skipped key position per query block (``S`` when none is skipped)."""
        return tuple(min(e * self.bk, self.spec.kv_len) for e in self.kend)

    def tiles_computed(self) -> int:
        """Number of (query tile, key tile) pairs the forward computes."""
        return sum(self.kend)


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def default_blocks(
    spec: AttentionSpec, backward: bool = False, outer: int = OUTER_BLOCK
) -> tuple[int, int]:
    """The (maximum) tile sizes ``(block_q, block_k)`` used when none are given.

    A tile holds ``B * H * block_q * block_k`` scores; aim at `TILE_ELEMENTS`.
    The outer loop's block (``block_q`` in the forward, ``block_k`` in the
    backward, whose loops are key-major) is ``outer``: it is sliced once
    per outer iteration and its accumulators stay put; the inner block fills
    the budget (at most `MAX_INNER_BLOCK`).  Many heads shrink the inner block,
    then the outer one, to `MIN_BLOCK`.
    """
    heads = spec.batch * spec.heads
    inner = min(_pow2_floor(TILE_ELEMENTS // (heads * outer)), MAX_INNER_BLOCK)
    if inner < MIN_BLOCK:
        inner = MIN_BLOCK
        outer = max(_pow2_floor(TILE_ELEMENTS // (heads * inner)), MIN_BLOCK)
    return (inner, outer) if backward else (outer, inner)


def make_plan(spec: AttentionSpec, block_q: int, block_k: int) -> _Plan:
    """Tile sizes and the per-tile work lists for ``spec``."""
    for op in spec.score_ops:
        if not isinstance(op, _KNOWN_OPS):
            raise TypeError(f"unknown score op {op!r}: the blockwise kernel does not implement it")
    T, S = spec.q_len, spec.kv_len
    bq, nq = _split(T, block_q)
    bk, nk = _split(S, block_k)
    padded = nk * bk > S
    cdt = np.dtype(jnp.promote_types(spec.compute_dtype, jnp.float32))

    # Skipping is exact only when every skipped key has the same final score,
    # i.e. nothing after the (single) Causal op depends on the key position.
    ops = spec.score_ops
    causal_at = [i for i, op in enumerate(ops) if isinstance(op, Causal)]
    causal = None
    skipped_score = None
    if len(causal_at) == 1:
        post = ops[causal_at[0] + 1 :]
        if all(isinstance(op, Scale | Softcap) for op in post):
            c = _final_fill(ops[causal_at[0]].fill, post)
            if math.isfinite(c) or c == -math.inf:
                causal = ops[causal_at[0]]
                skipped_score = c if math.isfinite(c) else None

    last_plain = nk - 1 if padded else nk  # the padded tile always needs the `where`
    kfull, kend = [], []
    for iq in range(nq):
        if causal is None:
            kend.append(nk)
            kfull.append(last_plain)
            continue
        first_row = iq * bq
        last_row = min((iq + 1) * bq, T) - 1
        keys = min(max(last_row + causal.offset + 1, 0), S)  # keys any real row keeps
        end = -(-keys // bk)
        full = min(max((first_row + causal.offset + 1) // bk, 0), end, last_plain)
        kend.append(end)
        kfull.append(full)
    qstart = [next((iq for iq in range(nq) if kend[iq] > ik), nq) for ik in range(nk)]
    qfull = [next((iq for iq in range(nq) if kfull[iq] > ik), nq) for ik in range(nk)]
    if skipped_score is not None and all(e == nk for e in kend):
        skipped_score = None

    # Fold the leading Scales into q when that is exact (a power of two, and q
    # has float32's exponent range so nothing turns subnormal) or merely moves
    # one rounding (q already in the compute dtype).
    lead = next((i for i, op in enumerate(ops) if not isinstance(op, Scale)), len(ops))
    q_scale = float(np.prod([np.float32(op.value) for op in ops[:lead]], dtype=np.float32))
    exact = (
        math.frexp(abs(q_scale))[0] == 0.5
        and jnp.finfo(spec.q_dtype).minexp <= jnp.finfo(np.float32).minexp
    )
    usable = lead and math.isfinite(q_scale) and q_scale != 0
    if usable and (exact or np.dtype(spec.q_dtype) == cdt):
        ops = ops[lead:]
    else:
        q_scale = 1.0
    ops_plain = tuple(op for op in ops if op is not causal) if causal is not None else ops
    return _Plan(
        spec=spec,
        q_scale=q_scale,
        ops_edge=ops,
        ops_plain=ops_plain,
        bq=bq,
        bk=bk,
        nq=nq,
        nk=nk,
        cdt=cdt,
        kfull=tuple(kfull),
        kend=tuple(kend),
        qstart=tuple(qstart),
        qfull=tuple(qfull),
        skipped_score=skipped_score,
    )


def _bound(table: tuple[int, ...], i):
    """Loop bound ``table[i]``: a Python int when known statically."""
    if isinstance(i, int):
        return table[i]
    if len(set(table)) == 1:
        return table[0]
    return jnp.asarray(np.asarray(table, np.int32))[i]


def _loop(lo, hi, body, state):
    """``lax.fori_loop`` that emits nothing for an empty static range and no
    loop for a single static iteration (less to compile, no loop overhead)."""
    if isinstance(lo, int) and isinstance(hi, int):
        if hi <= lo:
            return state
        if hi == lo + 1:
            return body(lo, state)
    return lax.fori_loop(lo, hi, body, state)


# --------------------------------------------------------------------------- layout helpers
#
# A query tile is processed as rows ``[B, Hkv, G*bq, .]`` (group folded into
# the rows): plain 4-D dots and row reductions, which XLA's CPU backend runs
# ~15% faster than the same work in 5-D.  Extras stay 5-D
# ``[b, hkv|1, g|1, t, s]`` in memory and become rows per tile (`_rows`).


def _extra5(spec: AttentionSpec, x, tp: int, sp: int):
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


def _slice_t(x, start, size):
    return x if x.shape[-2] == 1 else lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 2)


def _slice_s(x, start, size):
    return x if x.shape[-1] == 1 else lax.dynamic_slice_in_dim(x, start, size, axis=x.ndim - 1)


def _rows(plan: _Plan, x):
    """A 5-D extra tile as 4-D ``[b, hkv|1, rows|1, s]`` matching the score rows."""
    b, h, g, t, s = x.shape
    groups = plan.spec.groups
    if g == 1 and (t == 1 or groups == 1):
        return x.reshape(b, h, t, s)
    # Per-group or per-row values: spell them out for the tile's G*bq rows.
    return jnp.broadcast_to(x, (b, h, groups, plan.bq, s)).reshape(b, h, groups * plan.bq, s)


def _grouped(plan: _Plan, x):
    """``[B, H, T, ...]`` viewed as ``[B, Hkv, G, T, ...]``; left as it is when
    ``G == 1`` (a size-1 group axis makes XLA's CPU layout assignment copy the
    whole array before the loops)."""
    spec = plan.spec
    if spec.groups == 1:
        return x
    return x.reshape((spec.batch, spec.kv_heads, spec.groups) + x.shape[2:])


def _gshape(spec: AttentionSpec, *tail: int) -> tuple[int, ...]:
    """``(B, Hkv, G, *tail)``, or ``(B, Hkv, *tail)`` when ``G == 1`` (see `_grouped`)."""
    return (spec.batch, spec.kv_heads) + ((spec.groups,) if spec.groups > 1 else ()) + tail


def _q_tile(plan: _Plan, x, iq, axis: int = -2):
    """Rows ``[B, Hkv, G*bq, ...]`` of query tile ``iq`` of a grouped array whose
    query axis is ``axis`` (``-2`` for ``[B, Hkv, (G,) Tp, D]``, ``-1`` for the
    statistics ``[B, Hkv, (G,) Tp]`` and the transposed ``[B, Hkv, D, (G,) Tp]``)."""
    axis %= x.ndim
    t = lax.dynamic_slice_in_dim(x, iq * plan.bq, plan.bq, axis=axis)
    if plan.spec.groups == 1:
        return t
    return t.reshape(t.shape[: axis - 1] + (plan.spec.groups * plan.bq,) + t.shape[axis + 1 :])


def _put_q_tile(plan: _Plan, x, tile, iq, axis: int = -2):
    """Inverse of `_q_tile`: write the rows of tile ``iq`` back into ``x``."""
    axis %= x.ndim
    tile = tile.reshape(x.shape[:axis] + (plan.bq,) + x.shape[axis + 1 :])
    return lax.dynamic_update_slice_in_dim(x, tile, iq * plan.bq, axis=axis)


def _row_pos(plan: _Plan, iq):
    """Query position of each of the G*bq rows of tile ``iq``."""
    return jnp.tile(iq * plan.bq + jnp.arange(plan.bq), plan.spec.groups)


def _dot_operands(plan: _Plan, a, b):
    """Operands of a score product: kept narrow (e.g. bf16) when that is exact."""
    if a.dtype == b.dtype and jnp.promote_types(a.dtype, plan.cdt) == plan.cdt:
        return a, b
    return a.astype(plan.cdt), b.astype(plan.cdt)


def _score_fn(plan: _Plan, ex_tile, q_pos, k_pos, edge: bool, transposed: bool = False):
    """``f(s_raw, biases) -> s``: the spec's ops on one tile, as a function of
    the raw scores and the (5-D, compute-dtype) bias tiles so the backward can
    differentiate it.  Edge tiles also apply the causal op and key padding.

    ``transposed``: the tile is ``[..., s, t]`` (the backward's key-major
    tiles).  The same `apply_score_ops` runs on it, with the extras transposed
    (XLA reads them transposed inside the fusion; nothing is copied) and the
    positions swapped and negated: its causal test ``k <= q + offset`` on
    (row, column) positions (-k_j, -q_i) reads ``-q_i <= -k_j + offset``,
    i.e. ``k_j <= q_i + offset``, the same test for the transposed entry.
    """
    spec = plan.spec
    ops_spec = dataclasses.replace(spec, score_ops=plan.ops_edge if edge else plan.ops_plain)
    if not ops_spec.score_ops and not (edge and plan.padded_k):
        return lambda s, biases: s

    def f(s, biases):
        ex = [_rows(plan, biases.get(i, x)) for i, x in enumerate(ex_tile)]
        if transposed:
            ex = [jnp.swapaxes(x, -1, -2) for x in ex]
            s = apply_score_ops(ops_spec, s, ex, -k_pos, -q_pos)
            key_axis = k_pos[:, None]
        else:
            s = apply_score_ops(ops_spec, s, ex, q_pos, k_pos)
            key_axis = k_pos[None, :]
        if edge and plan.padded_k:
            # Padded keys get -inf, below any user fill: they never carry weight.
            s = jnp.where(key_axis < spec.kv_len, s, -jnp.inf)
        return s

    return f


def _scaled_q(plan: _Plan, q):
    if plan.q_scale == 1.0:
        return q
    return q * jnp.asarray(plan.q_scale, q.dtype)


def _bias_indices(spec: AttentionSpec, extras) -> tuple[int, ...]:
    idx = sorted({op.index for op in spec.score_ops if isinstance(op, Bias)})
    return tuple(i for i in idx if jnp.issubdtype(extras[i].dtype, jnp.inexact))


def _pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=np.array(value, x.dtype))


def _skipped_score(plan: _Plan, cdt):
    """The skipped keys' common score, computed by the same ops as on real tiles."""
    ops = plan.spec.score_ops
    at = next(i for i, op in enumerate(ops) if isinstance(op, Causal))
    spec = dataclasses.replace(plan.spec, score_ops=ops[at + 1 :])
    fill = jnp.full((1, 1), ops[at].fill, cdt)
    return apply_score_ops(spec, fill, [])[0, 0]


# --------------------------------------------------------------------------- forward


def _forward(plan: _Plan, q, k, v, extras):
    """Returns ``out5 [B,Hkv,G,Tp,Dv]`` (out dtype) and the softmax statistics
    ``m`` (row max) and ``den`` (row sum of exp(s - m)), each ``[B,Hkv,G,Tp]``
    (no G axis when G == 1, see `_grouped`)."""
    spec, cdt, bk = plan.spec, plan.cdt, plan.bk
    B, Hkv, G, Dv = spec.batch, spec.kv_heads, spec.groups, spec.v_head_dim
    rows = G * plan.bq
    tp, sp = plan.nq * plan.bq, plan.nk * bk
    q5 = _pad_axis(_grouped(plan, q), -2, tp)
    kp = _pad_axis(k, 2, sp)
    vp = _pad_axis(v, 2, sp)
    ex5 = [_extra5(spec, x, tp, sp) for x in extras]
    p_dtype = spec.p_dtype

    if plan.skipped_score is not None:
        # Skipped keys start at a key-block boundary: suffix sums of V's block
        # sums (padded keys are 0), row j is sum over blocks >= j, row nk is 0.
        vblocks = vp.astype(cdt).reshape(B, Hkv, plan.nk, bk, Dv).sum(axis=3)
        suffix = jnp.cumsum(vblocks[:, :, ::-1], axis=2)[:, :, ::-1]
        vsuffix = jnp.concatenate([suffix, jnp.zeros_like(suffix[:, :, :1])], axis=2)
        c = _skipped_score(plan, cdt)

    def q_block(iq, carry):
        out, ms, dens = carry
        q_t = _scaled_q(plan, _q_tile(plan, q5, iq))
        ex_q = [_slice_t(x, iq * plan.bq, plan.bq) for x in ex5]
        q_pos = _row_pos(plan, iq)

        def kv_body(edge):
            def body(ik, state):
                m, den, acc = state
                k_t = lax.dynamic_slice_in_dim(kp, ik * bk, bk, axis=2)
                v_t = lax.dynamic_slice_in_dim(vp, ik * bk, bk, axis=2)
                k_pos = ik * bk + jnp.arange(bk)
                ex_t = [_slice_s(x, ik * bk, bk) for x in ex_q]
                a, b = _dot_operands(plan, q_t, k_t)
                s = jnp.einsum("bhtd,bhsd->bhts", a, b, preferred_element_type=cdt)
                s = _score_fn(plan, ex_t, q_pos, k_pos, edge)(s, {})
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                # A row with only -inf so far keeps m = -inf; shift by 0 instead
                # so exp() gives 0, not nan.
                m_safe = jnp.where(m_new == -jnp.inf, 0, m_new)
                alpha = jnp.exp(m - m_safe)
                p = jnp.exp(s - m_safe[..., None])
                den = den * alpha + jnp.sum(p, axis=-1)
                pv = jnp.einsum(
                    "bhts,bhsd->bhtd", p.astype(p_dtype), v_t, preferred_element_type=cdt
                )
                return m_new, den, acc * alpha[..., None] + pv

            return body

        state = (
            jnp.full((B, Hkv, rows), -jnp.inf, cdt),
            jnp.zeros((B, Hkv, rows), cdt),
            jnp.zeros((B, Hkv, rows, Dv), cdt),
        )
        kfull, kend = _bound(plan.kfull, iq), _bound(plan.kend, iq)
        state = _loop(0, kfull, kv_body(False), state)
        m, den, acc = _loop(kfull, kend, kv_body(True), state)
        if plan.skipped_score is not None:
            # The skipped keys all score c: fold them in as n copies of c with
            # the suffix sum of their values (a no-op when exp(c - m) == 0).
            first = _bound(plan.kend_key, iq)
            n = jnp.asarray(spec.kv_len - first).astype(cdt)
            m_new = jnp.where(n > 0, jnp.maximum(m, c), m)
            m_safe = jnp.where(m_new == -jnp.inf, 0, m_new)
            alpha = jnp.exp(m - m_safe)
            beta = jnp.where(n > 0, jnp.exp(c - m_safe), 0)
            vsum = lax.dynamic_slice_in_dim(vsuffix, _bound(plan.kend, iq), 1, axis=2)
            den = den * alpha + n * beta
            beta_p = beta.astype(p_dtype).astype(cdt)  # as the reference rounds p
            acc = acc * alpha[..., None] + beta_p[..., None] * vsum
            m = m_new
        out_t = (acc / den[..., None]).astype(spec.out_dtype)
        out = _put_q_tile(plan, out, out_t, iq)
        return out, _put_q_tile(plan, ms, m, iq, -1), _put_q_tile(plan, dens, den, iq, -1)

    stats = jnp.zeros(_gshape(spec, tp), cdt)
    init = (jnp.zeros(_gshape(spec, tp, Dv), spec.out_dtype), stats, stats)
    return _loop(0, plan.nq, q_block, init)


# --------------------------------------------------------------------------- backward


def _backward(plan: _Plan, q, k, v, extras, out, m, den, dout, wanted):
    """Flash-attention-2 backward; returns cotangents of (q, k, v, extras).

    ``wanted[i]`` says whether extras[i] needs its cotangent (None if not)."""
    spec, cdt, bq, bk = plan.spec, plan.cdt, plan.bq, plan.bk
    B, H, Hkv = spec.batch, spec.heads, spec.kv_heads
    T, S, D, Dv = spec.q_len, spec.kv_len, spec.head_dim, spec.v_head_dim
    tp, sp = plan.nq * bq, plan.nk * bk
    q5 = _pad_axis(_grouped(plan, q), -2, tp)
    kp = _pad_axis(k, 2, sp)
    vp = _pad_axis(v, 2, sp)
    do5 = _pad_axis(_grouped(plan, dout), -2, tp)
    out5 = _pad_axis(_grouped(plan, out), -2, tp)
    ex5 = [_extra5(spec, x, tp, sp) for x in extras]
    bias_idx = tuple(i for i in _bias_indices(spec, extras) if wanted[i])
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
    m = jnp.where(real, _pad_axis(m, -1, tp), jnp.inf)
    inv_den = jnp.where(real, 1 / _pad_axis(den, -1, tp, 1), 0)
    # With e = exp(s - m) (p = e / den):  dV = p^T dO = e^T (dO / den) and
    # dS = p * (dP - delta) = e * (V (dO / den)^T - delta / den).  Scaling the
    # [T, Dv] dO and the [T] delta once, instead of every tile, leaves one pass
    # over each tile less (no p = e / den).
    do_n = do5.astype(cdt) * inv_den[..., None]
    delta_n = delta * inv_den

    def k_block(ik, carry):
        dqt, dk, dv, dbias = carry
        k_t = lax.dynamic_slice_in_dim(kp, ik * bk, bk, axis=2)
        v_t = lax.dynamic_slice_in_dim(vp, ik * bk, bk, axis=2)
        k_pos = ik * bk + jnp.arange(bk)
        ex_k = [_slice_s(x, ik * bk, bk) for x in ex5]
        # Tiles are key-major here (``[bk, rows]``, the transpose of the
        # forward's): then every product below contracts the minor axis of its
        # left operand, the layout XLA's fast CPU matmul path takes; a
        # transposed left operand (p^T @ dO) falls back to a ~3x slower one.
        k_dot = _dot_operands(plan, k_t, q5)[0]
        k_tr = jnp.swapaxes(k_dot, 2, 3)  # [B, Hkv, D, bk], once per key block

        def q_body(edge):
            def body(iq, state):
                dqt, dk_t, dv_t, dbias = state
                q_t = _scaled_q(plan, _q_tile(plan, q5, iq))
                do_t = _q_tile(plan, do_n, iq)
                m_t, delta_t = (_q_tile(plan, x, iq, -1)[:, :, None] for x in stats)
                ex_t = [_slice_t(x, iq * bq, bq) for x in ex_k]
                b, a = _dot_operands(plan, k_t, q_t)
                st = jnp.einsum("bhsd,bhtd->bhst", b, a, preferred_element_type=cdt)
                biases = {i: ex_t[i].astype(cdt) for i in bias_idx}
                score_fn = _score_fn(plan, ex_t, _row_pos(plan, iq), k_pos, edge, transposed=True)
                st, score_vjp = jax.vjp(score_fn, st, biases)
                et = jnp.exp(st - m_t)
                # One exp per tile: without the barrier XLA recomputes it in
                # the fusion that forms ds.
                et = lax.optimization_barrier(et)
                dv_t = dv_t + jnp.einsum(
                    "bhst,bhtd->bhsd", et.astype(p_dtype), do_t, preferred_element_type=cdt
                )
                dpt = jnp.einsum("bhsd,bhtd->bhst", v_t, do_t, preferred_element_type=cdt)
                dst, dbias_t = score_vjp(et * (dpt - delta_t))
                # Rows are (group, position): contracting them sums the group.
                dk_t = dk_t + jnp.einsum("bhst,bhtd->bhsd", dst, a, preferred_element_type=cdt)
                dq_t = jnp.einsum("bhds,bhst->bhdt", k_tr, dst, preferred_element_type=cdt)
                dqt = _put_q_tile(plan, dqt, _q_tile(plan, dqt, iq, -1) + dq_t, iq, -1)
                dbias = {
                    i: _add_at(dbias[i], g, (3, 4), (iq * bq, ik * bk)) for i, g in dbias_t.items()
                }
                return dqt, dk_t, dv_t, dbias

            return body

        state = (
            dqt,
            jnp.zeros((B, Hkv, bk, D), cdt),
            jnp.zeros((B, Hkv, bk, Dv), cdt),
            dbias,
        )
        qstart, qfull = _bound(plan.qstart, ik), _bound(plan.qfull, ik)
        state = _loop(qstart, qfull, q_body(True), state)
        dqt, dk_t, dv_t, dbias = _loop(qfull, plan.nq, q_body(False), state)
        dk = lax.dynamic_update_slice_in_dim(dk, dk_t, ik * bk, axis=2)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_t, ik * bk, axis=2)
        return dqt, dk, dv, dbias

    stats = (m, delta_n)
    init = (
        jnp.zeros((B, Hkv, D) + _gshape(spec, tp)[2:], cdt),  # dq^T, see `_q_tile`
        jnp.zeros((B, Hkv, sp, D), cdt),
        jnp.zeros((B, Hkv, sp, Dv), cdt),
        {i: jnp.zeros(ex5[i].shape, cdt) for i in bias_idx},
    )
    dq, dk, dv, dbias = _loop(0, plan.nk, k_block, init)
    dv = dv[:, :, :S]
    if plan.skipped_score is not None:
        dv = dv + _skipped_dv(plan, m, inv_den, do5)

    dq = jnp.moveaxis(dq[..., :T], 2, -1).reshape(B, H, T, D)
    if plan.q_scale != 1.0:
        dq = dq * jnp.asarray(plan.q_scale, cdt)  # the chain rule through the fold
    dq = dq.astype(q.dtype)
    grads = {i: g[:, :, :, : extras[i].shape[2], : extras[i].shape[3]] for i, g in dbias.items()}
    dextras = _extra_cotangents(extras, wanted, grads)
    return dq, dk[:, :, :S].astype(k.dtype), dv.astype(v.dtype), dextras


def _extra_cotangents(extras, wanted, grads: dict) -> tuple:
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


def _skipped_dv(plan: _Plan, m, inv_den, do5):
    """dV from skipped keys: every skipped key j of query row i has weight
    exp(c - m_i) / l_i, so dv[j] sums the weighted dO of every row whose block
    skips j.  Query block iq skips the key blocks [kend[iq], nk): the sum is one
    per key block, a static 0/1 matrix times the per-query-block sums."""
    spec, cdt = plan.spec, plan.cdt
    B, Hkv, G, Dv = spec.batch, spec.kv_heads, spec.groups, spec.v_head_dim
    c = _skipped_score(plan, cdt)
    w = (jnp.exp(c - m) * inv_den).astype(spec.p_dtype).astype(cdt)  # [B,Hkv,G,Tp]
    w = w.reshape(B, Hkv, G, plan.nq, plan.bq)
    do = do5.astype(cdt).reshape(B, Hkv, G, plan.nq, plan.bq, Dv)
    per_block = jnp.einsum("bhgqt,bhgqtd->bhqd", w, do)
    skips = np.array([[float(e <= jb) for e in plan.kend] for jb in range(plan.nk)], cdt)
    per_key_block = jnp.einsum("jq,bhqd->bhjd", skips, per_block)
    dv = jnp.broadcast_to(per_key_block[:, :, :, None], (B, Hkv, plan.nk, plan.bk, Dv))
    return dv.reshape(B, Hkv, plan.nk * plan.bk, Dv)[:, :, : spec.kv_len]


def _add_at(acc, tile, axes, starts):
    """``acc[..., start:start+n, ...] += tile`` along ``axes`` whose ``acc`` size is not 1."""
    index = [0] * acc.ndim
    for axis, start in zip(axes, starts, strict=True):
        if acc.shape[axis] != 1:
            index[axis] = start
    index = [jnp.asarray(i, jnp.int32) for i in index]
    cur = lax.dynamic_slice(acc, index, tile.shape)
    return lax.dynamic_update_slice(acc, cur + tile, index)


# --------------------------------------------------------------------------- head loop


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


def _forward_heads(plan: _Plan, spec: AttentionSpec, q, k, v, extras):
    """`_forward` for ``spec`` run unit by unit (``plan`` tiles `unit_spec`)."""
    tp = plan.nq * plan.bq

    def unit(u, carry):
        b, h = _unit_at(spec, u)
        ex = [_take_extra(spec, x, b, h) for x in extras]
        res = _forward(plan, _take_q(spec, q, b, h), _take(k, b, h), _take(v, b, h), ex)
        return tuple(_put(acc, r, b, h) for acc, r in zip(carry, res, strict=True))

    stats = jnp.zeros(_gshape(spec, tp), plan.cdt)
    init = (jnp.zeros(_gshape(spec, tp, spec.v_head_dim), spec.out_dtype), stats, stats)
    return _loop(0, spec.batch * spec.kv_heads, unit, init)


def _backward_heads(plan: _Plan, spec: AttentionSpec, q, k, v, extras, out, m, den, dout, wanted):
    """`_backward` for ``spec`` run unit by unit (``plan`` tiles `unit_spec`)."""
    summed = [i for i, x in enumerate(extras) if jnp.issubdtype(x.dtype, jnp.inexact) and wanted[i]]

    def unit(u, carry):
        dq, dk, dv, dex = carry
        b, h = _unit_at(spec, u)
        ex = [_take_extra(spec, x, b, h) for x in extras]
        g = _backward(
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
    dq, dk, dv, dex = _loop(0, spec.batch * spec.kv_heads, unit, init)
    return dq, dk, dv, _extra_cotangents(extras, wanted, dex)


# --------------------------------------------------------------------------- custom_vjp


@dataclasses.dataclass(frozen=True)
class _Plans:
    """The forward's and the backward's tilings (they may differ, see
    `default_blocks`).  With ``head_loop`` both tile ``unit_spec(spec)`` and
    run once per (batch, kv head) unit."""

    fwd: _Plan
    bwd: _Plan
    spec: AttentionSpec

    @property
    def head_loop(self) -> bool:
        return self.fwd.spec != self.spec


def _attention_impl(plans: _Plans, q, k, v, extras):
    spec = plans.spec
    if plans.head_loop:
        out5, m, den = _forward_heads(plans.fwd, spec, q, k, v, extras)
    else:
        out5, m, den = _forward(plans.fwd, q, k, v, extras)
    out = out5[..., : spec.q_len, :].reshape(spec.out_shape)
    # Statistics of the real rows only: the backward pads to its own tiling.
    return out, (m[..., : spec.q_len], den[..., : spec.q_len])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plans, q, k, v, extras):
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
    args = (q, k, v, extras, out, m, den, dout, wanted.extras)
    if plans.head_loop:
        return _backward_heads(plans.bwd, plans.spec, *args)
    return _backward(plans.bwd, *args)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------- kernel


class BlockwiseKernel(Kernel):
    """Flash attention written with ``lax`` loops: every platform, any spec.

    ``block_q``/``block_k`` are maximum tile sizes, by default (None) chosen
    per shape by `default_blocks`; lengths that are not a multiple are padded
    internally (padded keys get weight exactly 0, padded query rows are
    dropped).  ``head_loop`` runs one (batch, kv head) unit at a time (see
    `HEAD_LOOP_BLOCK`); None (the default) does so on a single CPU device
    where `head_loop_pays`.  Neither changes results beyond rounding.
    """

    name = "blockwise"
    platforms = ("cpu", "gpu", "tpu")

    def __init__(
        self,
        block_q: int | None = None,
        block_k: int | None = None,
        head_loop: bool | None = None,
    ):
        for label, value in (("block_q", block_q), ("block_k", block_k)):
            if value is not None and (not isinstance(value, int | np.integer) or value < 1):
                raise ValueError(f"{label} must be a positive int or None, got {value!r}")
        if head_loop not in (None, True, False):
            raise ValueError(f"head_loop must be True, False or None, got {head_loop!r}")
        self.block_q = None if block_q is None else int(block_q)
        self.block_k = None if block_k is None else int(block_k)
        self.head_loop = head_loop

    def uses_head_loop(self, spec: AttentionSpec) -> bool:
        """Whether ``spec`` runs unit by unit: as given, else on a single CPU
        device where it pays.  (With several devices the heads may be sharded,
        and XLA would all-gather them to slice one head per loop step.)"""
        if self.head_loop is not None:
            return self.head_loop
        single_cpu = jax.default_backend() == "cpu" and jax.device_count() == 1
        return single_cpu and head_loop_pays(spec)

    def blocks(self, spec: AttentionSpec, backward: bool = False) -> tuple[int, int]:
        """The maximum tile sizes for ``spec``: the given ones, else `default_blocks`
        (of one unit, with `HEAD_LOOP_BLOCK` outer blocks, under the head loop)."""
        if self.uses_head_loop(spec):
            bq, bk = default_blocks(unit_spec(spec), backward, outer=HEAD_LOOP_BLOCK)
        else:
            bq, bk = default_blocks(spec, backward)
        return (bq if self.block_q is None else self.block_q), (
            bk if self.block_k is None else self.block_k
        )

    def plan(self, spec: AttentionSpec) -> _Plan:
        """The static tiling of ``spec``'s forward (of one unit under the head
        loop; exposed for tests and diagnostics)."""
        tiled = unit_spec(spec) if self.uses_head_loop(spec) else spec
        return make_plan(tiled, *self.blocks(spec))

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        """Reasons not to run ``spec``: platform, and on CPU a too-short sequence."""
        reasons = self.platform_reasons(ctx)
        if not ctx.explicit and ctx.platform == "cpu" and spec.kv_len < CPU_MIN_KV_LEN:
            reasons.append(
                f"short sequence (kv_len={spec.kv_len} < {CPU_MIN_KV_LEN}): the original "
                "computation is faster here; name kernel='blockwise' to force the rewrite"
            )
        return reasons

    def apply(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        """Attention ``[B, H, T, Dv]`` in ``spec.out_dtype`` (``interpret`` is ignored)."""
        extras = tuple(extras)
        _validate(spec, q, k, v, extras)
        fwd = self.plan(spec)
        bwd = make_plan(fwd.spec, *self.blocks(spec, backward=True))
        return _attention(_Plans(fwd, bwd if bwd != fwd else fwd, spec), q, k, v, extras)

    def __repr__(self) -> str:
        bq, bk = (b if b is not None else "auto" for b in (self.block_q, self.block_k))
        loop = "auto" if self.head_loop is None else self.head_loop
        return f"<flashpass kernel 'blockwise' block_q={bq} block_k={bk} head_loop={loop}>"


def _validate(spec: AttentionSpec, q, k, v, extras) -> None:
    for label, x, want in (
        ("q", q, spec.q_shape),
        ("k", k, spec.k_shape),
        ("v", v, spec.v_shape),
    ):
        if tuple(x.shape) != want:
            raise ValueError(f"blockwise: {label} has shape {tuple(x.shape)}, spec says {want}")
    used = [op.index for op in spec.score_ops if isinstance(op, Bias | Mask)]
    if used and max(used) >= len(extras):
        raise ValueError(
            f"blockwise: score ops use extras[{max(used)}] but only {len(extras)} were given"
        )
    full = (spec.batch, spec.heads, spec.q_len, spec.kv_len)
    for i, x in enumerate(extras):
        shape = tuple(x.shape)
        if len(shape) != 4 or any(d not in (1, f) for d, f in zip(shape, full, strict=True)):
            raise ValueError(
                f"blockwise: extras[{i}] has shape {shape}; each axis must be 1 or match "
                f"[B, H, T, S] = {list(full)}"
            )
