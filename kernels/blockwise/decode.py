"""The blockwise kernel's decode path: a few queries against a ragged KV cache.

Serving attends one (or a few) new queries to a KV cache whose rows are
filled to different lengths, given as a `KvLengths` op.  The kv axis is split
into chunks of `cost.DECODE_BLOCK_K` keys; for each batch row only the chunks
below that row's valid length are visited (a loop with a per-row, dynamic
trip count), each chunk's partial softmax statistics (max, sum, unnormalised
output) merged into the row's with the logsumexp merge, in float32.  Work and
memory traffic are proportional to the filled part of the cache, not its
size.  Nothing is padded or copied: the last chunk, when the cache length is
not a multiple, starts earlier and drops the keys its predecessor covered.

Skipping is exact: a key past a row's length has the op's fill as its final
score (<= `EXCLUDING_FILL` or -inf, `decode_reasons` checks it), so weight
exactly 0 next to the row's kept keys.  A row with no valid key is computed
over every chunk, as the original computes it (uniform weights for a finite
fill, NaN for -inf).  The backward is the blockwise backward
(`flash.backward`) on the statistics saved here: skipped keys recompute to
weight 0 there, so gradients are exact too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from flashpass.ops import valid_lengths
from flashpass.spec import AttentionSpec, Bias, Causal, KvLengths, Scale, Softcap, excludes

from . import flash
from .cost import DECODE_DENSE_FRACTION, DECODE_MAX_Q
from .plan import Plan, Plans, make_plan
from .tiles import (
    dot_operands,
    extra5,
    grouped,
    gshape,
    q_tile,
    row_pos,
    scaled_q,
    slice_s,
    tile_score_fn,
    varying,
)


def decode_reasons(spec: AttentionSpec) -> list[str]:
    """Why ``spec`` cannot take the decode path (empty: it can)."""
    reasons = []
    if spec.dropout is not None:
        reasons.append("dropout on the weights")
    if spec.q_len > DECODE_MAX_Q:
        reasons.append(f"q_len={spec.q_len} > {DECODE_MAX_Q}")
    found = [(i, op) for i, op in enumerate(spec.ops) if isinstance(op, KvLengths)]
    if len(found) != 1:
        return [*reasons, "not exactly one KvLengths op"]
    position, op = found[0]
    shape = tuple(spec.extras[op.index].shape)
    if shape[1:] != (1, 1, 1):
        reasons.append(f"kv lengths of shape {shape} vary over heads")
    if not all(isinstance(o, Scale | Softcap) for o in spec.ops[position + 1 :]):
        reasons.append("a bias or mask follows the kv lengths")
    if not excludes(spec.final_fill(position, op.fill)):
        reasons.append("the kv lengths' fill does not exclude keys after the later ops")
    # Another exclusion (a Mask) could empty a row whose length is not 0, whose
    # original then weighs every key; Causal keeps key 0 (offset >= 0), as does n > 0.
    others = [o for o in spec.ops if not isinstance(o, _DECODE_OPS)]
    if others:
        reasons.append(f"a {type(others[0]).__name__} op could leave a row without keys")
    return reasons


_DECODE_OPS = (Scale, Softcap, Bias, Causal, KvLengths)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The decode path's static plan (hashable: a ``custom_vjp`` static arg)."""

    fwd: Plan  # one query tile (all T rows), key chunks of bk
    plans: Plans  # the backward's tiling (flash.backward)
    lengths: KvLengths
    #: How k and v are laid out: ``"bhsd"`` (canonical ``[B, Hkv, S, D]``) or
    #: ``"bshd"`` (``[B, S, Hkv, D]``, as Hugging Face, keras-hub and MaxText
    #: keep their caches).  Chunks are sliced from the arrays as given: the
    #: cache is never transposed.
    kv_layout: str = "bhsd"


def make_decode_plan(
    spec: AttentionSpec, block_k: int, bwd_blocks: tuple[int, int], kv_layout: str = "bhsd"
) -> DecodePlan:
    """The decode plan of ``spec`` (which `decode_reasons` accepts): key chunks
    of ``block_k``, the backward tiled by ``bwd_blocks``, k and v read in
    ``kv_layout``."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    fwd = make_plan(spec, spec.q_len, min(block_k, spec.kv_len))
    bwd = make_plan(spec, *bwd_blocks)
    (op,) = spec.ops_of(KvLengths)
    return DecodePlan(fwd, Plans(bwd, bwd, spec), op, kv_layout)


#: The K/V layouts the decode path reads as they are.
KV_LAYOUTS = ("bhsd", "bshd")


def to_canonical(x, kv_layout: str):
    """``x`` (k, v or their cotangents) as ``[B, Hkv, S, D]``."""
    return x if kv_layout == "bhsd" else jnp.swapaxes(x, 1, 2)


def to_canonical_shape(x, kv_layout: str):
    """A shape-only stand-in for ``to_canonical(x)`` (for shape checks)."""
    if kv_layout == "bhsd":
        return x
    b, s, h, d = x.shape
    return jax.ShapeDtypeStruct((b, h, s, d), x.dtype)


def from_canonical(x, kv_layout: str):
    """A ``[B, Hkv, S, D]`` array in ``kv_layout`` (None stays None)."""
    return x if x is None or kv_layout == "bhsd" else jnp.swapaxes(x, 1, 2)


def forward(dp: DecodePlan, q, k, v, extras):
    """``(out [B,H,T,Dv], m, den)``, the statistics as `flash.forward` saves them
    (k and v in ``dp.kv_layout``)."""
    plan = dp.fwd
    spec, cdt = plan.spec, plan.cdt
    B, Hkv, Dv, S = spec.batch, spec.kv_heads, spec.v_head_dim, spec.kv_len
    bk, nk = plan.bk, plan.nk
    rows = spec.groups * spec.q_len
    q_rows = scaled_q(plan, q_tile(plan, grouped(plan, q), 0))  # [B, Hkv, G*T, D]
    ex5 = [extra5(spec, x, spec.q_len, S) for x in extras]
    n = valid_lengths(dp.lengths, extras[dp.lengths.index].reshape(-1), S)
    n = jnp.broadcast_to(n, (B,))
    # Chunks each row visits; a row with no valid key visits all (see module doc).
    chunks = jnp.where(n > 0, (n + bk - 1) // bk, nk)
    q_pos = row_pos(plan, 0)
    ragged_tail = S % bk != 0
    p_dtype = spec.p_dtype
    bshd = dp.kv_layout == "bshd"
    # Score and output products in k/v's own layout (XLA reads the heads
    # axis where it is; no copy of the cache).
    qk = "bhtd,bshd->bhts" if bshd else "bhtd,bhsd->bhts"
    pv_eq = "bhts,bshd->bhtd" if bshd else "bhts,bhsd->bhtd"

    def kv_chunk(x, b, start, d):
        if bshd:
            return lax.dynamic_slice(x, (b, start, 0, 0), (1, bk, Hkv, d))
        return lax.dynamic_slice(x, (b, 0, start, 0), (1, Hkv, bk, d))

    def row(b, carry):
        out, ms, dens = carry
        q_b = lax.dynamic_slice_in_dim(q_rows, b, 1, axis=0)
        ex_b = [x if x.shape[0] == 1 else lax.dynamic_slice_in_dim(x, b, 1, axis=0) for x in ex5]

        def chunk(j, state):
            m, den, acc = state
            start = jnp.minimum(j * bk, S - bk)  # the last chunk ends at S: no padding
            k_t = kv_chunk(k, b, start, spec.head_dim)
            v_t = kv_chunk(v, b, start, Dv)
            k_pos = start + jnp.arange(bk)
            ex_t = [slice_s(x, start, bk) for x in ex_b]
            a, c = dot_operands(plan, q_b, k_t)
            s = jnp.einsum(qk, a, c, preferred_element_type=cdt)
            s = tile_score_fn(plan, ex_t, q_pos, k_pos, True)(s, {})
            if ragged_tail:  # keys the previous chunk already counted
                s = jnp.where(k_pos >= j * bk, s, -jnp.inf)
            # The chunk's partials merged into the row's (logsumexp merge).
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0, m_new)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            den = den * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum(pv_eq, p.astype(p_dtype), v_t, preferred_element_type=cdt)
            return m_new, den, acc * alpha[..., None] + pv

        init = (
            jnp.full((1, Hkv, rows), -jnp.inf, cdt),
            jnp.zeros((1, Hkv, rows), cdt),
            jnp.zeros((1, Hkv, rows, Dv), cdt),
        )
        m, den, acc = lax.fori_loop(0, chunks[b], chunk, varying(init, carry))
        out_b = (acc / den[..., None]).astype(spec.out_dtype)
        out = lax.dynamic_update_slice_in_dim(out, out_b, b, axis=0)
        ms = lax.dynamic_update_slice_in_dim(ms, m, b, axis=0)
        dens = lax.dynamic_update_slice_in_dim(dens, den, b, axis=0)
        return out, ms, dens

    def chunked(_):
        stats = jnp.zeros((B, Hkv, rows), cdt)
        init = (jnp.zeros((B, Hkv, rows, Dv), spec.out_dtype), stats, stats)
        return lax.fori_loop(0, B, row, varying(init, q, k, v, extras))

    def dense(_):
        # The whole cache in one pass, as the original computes it: faster
        # than the chunk loop when most chunks are visited anyway.
        a, c = dot_operands(plan, q_rows, k)
        s = jnp.einsum(qk, a, c, preferred_element_type=cdt)
        s = tile_score_fn(plan, ex5, q_pos, jnp.arange(S), True)(s, {})
        m = jnp.max(s, axis=-1)
        # exp(s - m), as the original's softmax writes it (XLA fuses the max,
        # the shift and the exp into one pass); a row with only -inf scores
        # gets NaN weights, as in the original (and the chunk loop: 0 / 0).
        p = jnp.exp(s - m[..., None])
        den = jnp.sum(p, axis=-1)
        acc = jnp.einsum(pv_eq, p.astype(p_dtype), v, preferred_element_type=cdt)
        # Typed as the chunk loop's results (`lax.cond` needs equal branch types).
        return varying(((acc / den[..., None]).astype(spec.out_dtype), m, den), q, k, v, extras)

    visited = jnp.sum(chunks) * bk
    out, m, den = lax.cond(visited <= DECODE_DENSE_FRACTION * B * S, chunked, dense, None)
    # Rows are (group, query): the canonical [B, H, T, Dv] and flash's statistics.
    out = out.reshape(spec.out_shape)
    return out, m.reshape(gshape(spec, spec.q_len)), den.reshape(gshape(spec, spec.q_len))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(dp: DecodePlan, q, k, v, extras):
    """Decode attention ``[B, H, T, Dv]`` with per-row chunk skipping."""
    return forward(dp, q, k, v, extras)[0]


def _attention_fwd(dp, q, k, v, extras):
    wanted = flash._Wanted(tuple(x.perturbed for x in extras))  # see flash._attention_fwd
    q, k, v = q.value, k.value, v.value
    extras = tuple(x.value for x in extras)
    out, m, den = forward(dp, q, k, v, extras)
    return out, (q, k, v, extras, out, m, den, wanted)


def _attention_bwd(dp, res, dout):
    # The backward is flash's, on canonical k and v: a training step's cost,
    # not a decode step's; the cotangents go back in the caller's layout.
    q, k, v, *rest = res
    res = (q, to_canonical(k, dp.kv_layout), to_canonical(v, dp.kv_layout), *rest)
    dq, dk, dv, dextras = flash._attention_bwd(dp.plans, res, dout)
    return dq, from_canonical(dk, dp.kv_layout), from_canonical(dv, dp.kv_layout), dextras


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
