"""``flash_tpu``: our own flash attention in Pallas for TPU, built from the op protocol.

Forward: grid ``(B, H, T / bq, S / bk)``, key tiles innermost; each tile
computes ``s = q @ k^T`` in float32 and then *asks the spec's score ops*
(`flashpass.ops`) what they make of it, in order, from their O(T) data:

* a `KeepOp` by its element predicate ``keep(qi, kj, extras)`` on the tile's
  query and key positions (causal, window, chunk, prefix, sink tokens, segment
  ids, kv lengths, prefix lengths, positions from inputs, boolean masks);
* any other op by ``apply(s, extras, positions)`` (scale, soft-cap, bias,
  ALiBi, whose bias is computed in the tile from the O(H) slopes).

Extras are read tile by tile, each along the axes it varies over only (a key
mask ``[B, 1, 1, S]`` as a ``[1, bk]`` tile, slopes as ``[1, 1]``), so no
``T x S`` array is built.  `Positional` ops whose fill excludes keys also give
each tile its `Positional.tile_state`: tiles every row of which they exclude
are skipped whole (no product, no exp), tiles they keep whole run without
their element predicates, edge tiles run with them.  A new op kind joins
through the same protocol (a `KeepOp` or an ``apply``), with no change here.

The online softmax keeps the row max ``m`` and sum ``l`` (a `Sink` logit
starts them, as one more score with no value), and the forward saves both
(not ``m + log l``: with a finite fill of -1e9 that rounds to ``m``).
Dropout (`Dropout`) regenerates the program's keep-mask per tile with
`flashpass.kernels.dropout.keep_mask_words`, the function the blockwise
kernel evaluates, from the key's two words in scalar memory: bit-equal masks.

Backward (``custom_vjp``): two kernels recompute each tile's scores and
weights ``p = exp(s - m) / l`` from q, k and the saved statistics: dQ over
key tiles (grid ``(B, H, T / bq, S / bk)``), and dK/dV over query tiles
(grid ``(B, H, S / bk, T / bq)``, per query head, summed over a GQA group
outside).  The chain rule through the score ops is ``jax.vjp`` of the same
per-tile score function; the float extras the scores depend on
(`ScoreOp.grad_extras`: a bias, ALiBi slopes) get their cotangent per tile,
summed outside over the axes they broadcast along.  The sink's cotangent comes
from the saved statistics (`reference.sink_cotangent`).

Block sizes: splash attention's defaults (``BlockSizes.get_default()``: 128
for queries and keys on every TPU generation in the JAX versions we run),
settable as ``FlashTpuKernel(block_q=..., block_k=...)``.  Key blocks are a
multiple of 128 (the lane width), query blocks of 16; lengths are padded to
the blocks (padded keys score ``-inf``, padded query rows are dropped).

Differences from `reference_attention`, by design:

* Rows every key of which is excluded: skipped tiles' keys are not averaged
  in (the reference averages ``v`` over every key for equal finite fills); an
  `EmptyRows` op (`flashpass.kernels.empty_rows`) runs such rows exactly.
* Precision: float32 scores and statistics; q/k/v/p in one kernel dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from flashpass import compat
from flashpass.spec import AttentionSpec

from . import _util
from .base import CheckContext, Kernel
from .dropout import apply_dropout, keep_mask_words
from .flash_tiles import (
    _nn,
    _nt,
    _Plan,
    _plan,
    _reasons,
    _score_fn,
    _tile_positions,
    _tile_state,
    _tn,
    forward_refs,
    kernel_extras,
    vjp_attention,
)


def default_blocks() -> tuple[int, int]:
    """Splash attention's default ``(block_q, block_kv)`` (its ``BlockSizes.get_default``)."""
    sizes = compat.splash_attention_module().BlockSizes.get_default()
    return int(sizes.block_q), int(sizes.block_kv)


# --------------------------------------------------------------------------- tiles


def _by_state(plan: _Plan, i, j, body, skipped=None):
    """Run ``body(edge)`` on tile ``(i, j)``: not at all when the skipping ops
    exclude it (``skipped()`` instead, with `_Plan.fold`), without their
    predicates when they keep it whole."""
    pl, _ = compat.pallas_tpu_modules()
    visit, full = _tile_state(plan, i, j)
    if visit is None:
        body(True)
        return
    if skipped is not None and plan.fold is not None:
        pl.when(~visit)(skipped)

    @pl.when(visit & full)
    def _():
        body(False)

    @pl.when(visit & ~full)
    def _():
        body(True)


def _read_extras(plan: _Plan, refs):
    """The tiles' extras as a list indexed like the spec's (None where unread)."""
    ex = [None] * len(plan.spec.extras)
    for i, ref in zip(plan.tile_extras, refs, strict=True):
        x = ref[...]
        ex[i] = x != 0 if i in plan.bools else x
    return ex


def _keep(plan: _Plan, key_ref, b, h, qi, kj):
    """The program's dropout keep-mask on the tile (`keep_mask_words`)."""
    return keep_mask_words(plan.spec.dropout, key_ref[0], key_ref[1], b, h, qi, kj)


# --------------------------------------------------------------------------- block specs


def _extra_block(plan: _Plan, index: int, order: str):
    """The `BlockSpec` of extra ``index`` for a grid ordered ``order``
    (``"bhij"``: query tiles then key tiles, ``"bhji"``: the reverse)."""
    pl, _ = compat.pallas_tpu_modules()
    eb, eh, et, es = plan.spec.extras[index].shape
    shape = (None, None, plan.bq if et > 1 else 1, plan.bk if es > 1 else 1)

    def index_map(*g):
        b, h, i, j = g if order == "bhij" else (g[0], g[1], g[3], g[2])
        return (b if eb > 1 else 0, h if eh > 1 else 0, i if et > 1 else 0, j if es > 1 else 0)

    return pl.BlockSpec(shape, index_map)


def _rows_block(plan: _Plan, order: str, width: int):
    """``[B, H, Tp, width]`` arrays (q, dO, statistics) by query tile."""
    pl, _ = compat.pallas_tpu_modules()
    if order == "bhij":
        return pl.BlockSpec((None, None, plan.bq, width), lambda b, h, i, j: (b, h, i, 0))
    return pl.BlockSpec((None, None, plan.bq, width), lambda b, h, j, i: (b, h, i, 0))


def _keys_block(plan: _Plan, order: str, width: int, per_head: bool = False):
    """``[B, Hkv, Sp, width]`` arrays (k, v) by key tile (query head h reads
    kv head ``h // G``); ``per_head``: ``[B, H, Sp, width]``."""
    pl, _ = compat.pallas_tpu_modules()
    g = 1 if per_head else plan.spec.groups
    if order == "bhij":
        return pl.BlockSpec(
            (None, None, plan.bk, width), lambda b, h, i, j: (b, lax.div(h, g), j, 0)
        )
    return pl.BlockSpec((None, None, plan.bk, width), lambda b, h, j, i: (b, lax.div(h, g), j, 0))


def _sink_block(plan: _Plan, order: str):
    pl, _ = compat.pallas_tpu_modules()
    eb, eh, et, _ = plan.spec.extras[plan.spec.sink.index].shape

    def index_map(*g):
        b, h, i = (g[0], g[1], g[2] if order == "bhij" else g[3])
        return (b if eb > 1 else 0, h if eh > 1 else 0, i if et > 1 else 0, 0)

    return pl.BlockSpec((None, None, plan.bq if et > 1 else 1, 1), index_map)


def _smem(plan: _Plan):
    pl, pltpu = compat.pallas_tpu_modules()
    return pl.BlockSpec(memory_space=pltpu.SMEM)


def _params(order: str):
    _, pltpu = compat.pallas_tpu_modules()
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    )


# --------------------------------------------------------------------------- forward


def _forward(plan: _Plan, q, k, v, ex, sink, key):
    """``(out [B,H,Tp,Dv], m, l)``, the statistics ``[B,H,Tp,1]`` float32."""
    pl, pltpu = compat.pallas_tpu_modules()
    spec = plan.spec
    B, H, Dv, D = spec.batch, spec.heads, spec.v_head_dim, spec.head_dim
    n_ex = len(plan.tile_extras)
    has_sink, has_key = sink is not None, key is not None

    def kernel(*refs):
        q_ref, k_ref, v_ref, ex_refs, sink_ref, key_ref, rest = forward_refs(
            refs, n_ex, has_sink, has_key
        )
        o_ref, m_ref, l_ref, m_sc, l_sc, acc_sc = rest
        b, h, i, j = (pl.program_id(a) for a in range(4))

        @pl.when(j == 0)
        def _():
            if has_sink:
                m0 = jnp.broadcast_to(sink_ref[...].astype(jnp.float32), (plan.bq, 1))
                m_sc[...] = m0
                l_sc[...] = jnp.where(m0 == -jnp.inf, 0.0, 1.0).astype(jnp.float32)
            else:
                m_sc[...] = jnp.full((plan.bq, 1), -jnp.inf, jnp.float32)
                l_sc[...] = jnp.zeros((plan.bq, 1), jnp.float32)
            acc_sc[...] = jnp.zeros((plan.bq, Dv), jnp.float32)

        qi, kj = _tile_positions(plan, i, j)

        def body(edge):
            s = _nt(q_ref[...], k_ref[...])
            s = _score_fn(plan, qi, kj, edge)(s, _read_extras(plan, ex_refs))
            m_prev, l_prev = m_sc[...], l_sc[...]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe)
            l_sc[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_sc[...] = m_new
            if has_key:
                p = apply_dropout(spec.dropout, p, _keep(plan, key_ref, b, h, qi, kj))
            pv = _nn(p.astype(spec.p_dtype).astype(plan.kdt), v_ref[...])
            acc_sc[...] = alpha * acc_sc[...] + pv

        def skipped():
            # n keys scoring c, their values summed (`_fold_score`).
            c = jnp.float32(plan.fold)
            n = jnp.clip(spec.kv_len - j * plan.bk, 0, plan.bk).astype(jnp.float32)
            vsum = jnp.sum(v_ref[...].astype(jnp.float32), axis=0, keepdims=True)
            m_prev, l_prev = m_sc[...], l_sc[...]
            m_new = jnp.maximum(m_prev, c)
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m_prev - m_safe)
            beta = jnp.exp(c - m_safe)
            l_sc[...] = alpha * l_prev + n * beta
            m_sc[...] = m_new
            beta_p = beta.astype(spec.p_dtype).astype(jnp.float32)
            acc_sc[...] = alpha * acc_sc[...] + beta_p * vsum

        _by_state(plan, i, j, body, skipped)

        @pl.when(j == plan.nk - 1)
        def _():
            o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
            m_ref[...] = m_sc[...]
            l_ref[...] = l_sc[...]

    in_specs = [_rows_block(plan, "bhij", D), _keys_block(plan, "bhij", D)]
    in_specs += [_keys_block(plan, "bhij", Dv)]
    in_specs += [_extra_block(plan, i, "bhij") for i in plan.tile_extras]
    args = [q, k, v, *ex]
    if has_sink:
        in_specs.append(_sink_block(plan, "bhij"))
        args.append(sink)
    if has_key:
        in_specs.append(_smem(plan))
        args.append(key)
    stat = jax.ShapeDtypeStruct((B, H, plan.tp, 1), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(B, H, plan.nq, plan.nk),
        in_specs=in_specs,
        out_specs=[_rows_block(plan, "bhij", Dv)] + [_rows_block(plan, "bhij", 1)] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, H, plan.tp, Dv), spec.out_dtype), stat, stat],
        scratch_shapes=[
            pltpu.VMEM((plan.bq, 1), jnp.float32),
            pltpu.VMEM((plan.bq, 1), jnp.float32),
            pltpu.VMEM((plan.bq, Dv), jnp.float32),
        ],
        compiler_params=_params("bhij"),
        interpret=plan.interpret,
        name="flashpass_flash_tpu_fwd",
    )(*args)


# --------------------------------------------------------------------------- backward


def _tile_grads(plan, refs, b, h, qi, kj, edge, with_extras: bool):
    """One tile of the backward: ``(ds_raw, p_dropped, dextras)`` from the
    recomputed scores (``refs``: the tile's q, k, v, dO, m, 1/l, delta, extras
    and key refs, as a dict)."""
    spec = plan.spec
    ex = _read_extras(plan, refs["ex"])
    grads = {i: ex[i].astype(jnp.float32) for i in plan.grad_extras} if with_extras else {}
    score = _score_fn(plan, qi, kj, edge)

    def f(s, g):
        full = list(ex)
        for i, x in g.items():
            full[i] = x
        return score(s, full)

    s_raw = _nt(refs["q"][...], refs["k"][...])
    s, vjp = jax.vjp(f, s_raw, grads)
    p = jnp.exp(s - refs["m"][...]) * refs["inv_l"][...]
    dp = _nt(refs["do"][...], refs["v"][...])
    pd = p
    if spec.dropout is not None:
        keep = _keep(plan, refs["key"], b, h, qi, kj)
        pd = apply_dropout(spec.dropout, p, keep)
        dp = apply_dropout(spec.dropout, dp, keep)
    ds = p * (dp - refs["delta"][...])
    ds_raw, dg = vjp(ds)
    return ds_raw, pd, dg


def _backward_inputs(plan: _Plan, order: str, ex, sink, key):
    spec = plan.spec
    D, Dv = spec.head_dim, spec.v_head_dim
    specs = [
        _rows_block(plan, order, D),
        _keys_block(plan, order, D),
        _keys_block(plan, order, Dv),
        _rows_block(plan, order, Dv),  # dO
        _rows_block(plan, order, 1),  # m
        _rows_block(plan, order, 1),  # 1 / l
        _rows_block(plan, order, 1),  # delta
    ]
    specs += [_extra_block(plan, i, order) for i in plan.tile_extras]
    if key is not None:
        specs.append(_smem(plan))
    return specs


def _unpack(plan: _Plan, refs, has_key: bool):
    n_ex = len(plan.tile_extras)
    names = ("q", "k", "v", "do", "m", "inv_l", "delta")
    out = dict(zip(names, refs[:7], strict=True))
    out["ex"] = refs[7 : 7 + n_ex]
    rest = list(refs[7 + n_ex :])
    out["key"] = rest.pop(0) if has_key else None
    return out, rest


def _backward(plan: _Plan, q, k, v, ex, key, do, m, inv_l, delta):
    """``(dq [B,H,Tp,D], dk, dv [B,H,Sp,.] per query head, dextra tiles)``."""
    pl, pltpu = compat.pallas_tpu_modules()
    spec = plan.spec
    B, H, D, Dv = spec.batch, spec.heads, spec.head_dim, spec.v_head_dim
    has_key = key is not None
    args = [q, k, v, do, m, inv_l, delta, *ex] + ([key] if has_key else [])
    kdt = plan.kdt

    # dextra tiles: [B, H, nq, nk, tq, tk], a whole tile per grid step.
    tiles = []
    for i in plan.grad_extras:
        _, _, et, es = spec.extras[i].shape
        tiles.append((plan.bq if et > 1 else 1, plan.bk if es > 1 else 1))

    def dq_kernel(*refs):
        r, rest = _unpack(plan, refs, has_key)
        dq_ref, *dex_refs = rest[: 1 + len(tiles)]
        (dq_sc,) = rest[1 + len(tiles) :]
        b, h, i, j = (pl.program_id(a) for a in range(4))

        @pl.when(j == 0)
        def _():
            dq_sc[...] = jnp.zeros((plan.bq, D), jnp.float32)

        for ref, shape in zip(dex_refs, tiles, strict=True):
            ref[...] = jnp.zeros(shape, jnp.float32)
        qi, kj = _tile_positions(plan, i, j)

        def body(edge):
            ds, _, dg = _tile_grads(plan, r, b, h, qi, kj, edge, True)
            dq_sc[...] += _nn(ds.astype(kdt), r["k"][...])
            for ref, index in zip(dex_refs, plan.grad_extras, strict=True):
                ref[...] = dg[index].astype(jnp.float32)

        _by_state(plan, i, j, body)

        @pl.when(j == plan.nk - 1)
        def _():
            dq_ref[...] = dq_sc[...]

    def dex_block(shape):
        return pl.BlockSpec((None, None, None, None, *shape), lambda b, h, i, j: (b, h, i, j, 0, 0))

    dq, *dtiles = pl.pallas_call(
        dq_kernel,
        grid=(B, H, plan.nq, plan.nk),
        in_specs=_backward_inputs(plan, "bhij", ex, None, key),
        out_specs=[_rows_block(plan, "bhij", D)] + [dex_block(t) for t in tiles],
        out_shape=[jax.ShapeDtypeStruct((B, H, plan.tp, D), jnp.float32)]
        + [jax.ShapeDtypeStruct((B, H, plan.nq, plan.nk, *t), jnp.float32) for t in tiles],
        scratch_shapes=[pltpu.VMEM((plan.bq, D), jnp.float32)],
        compiler_params=_params("bhij"),
        interpret=plan.interpret,
        name="flashpass_flash_tpu_dq",
    )(*args)

    def dkv_kernel(*refs):
        r, rest = _unpack(plan, refs, has_key)
        dk_ref, dv_ref, dk_sc, dv_sc = rest
        b, h, j, i = (pl.program_id(a) for a in range(4))

        @pl.when(i == 0)
        def _():
            dk_sc[...] = jnp.zeros((plan.bk, D), jnp.float32)
            dv_sc[...] = jnp.zeros((plan.bk, Dv), jnp.float32)

        qi, kj = _tile_positions(plan, i, j)

        def body(edge):
            ds, pd, _ = _tile_grads(plan, r, b, h, qi, kj, edge, False)
            dv_sc[...] += _tn(pd.astype(spec.p_dtype).astype(kdt), r["do"][...])
            dk_sc[...] += _tn(ds.astype(kdt), r["q"][...])

        def skipped():
            # Keys scoring c (`_fold_score`): dV only, the weights' sum of dO.
            w = jnp.exp(jnp.float32(plan.fold) - r["m"][...]) * r["inv_l"][...]
            w = w.astype(spec.p_dtype).astype(jnp.float32)
            wdo = jnp.sum(w * r["do"][...].astype(jnp.float32), axis=0, keepdims=True)
            keys = j * plan.bk + lax.broadcasted_iota(jnp.int32, (plan.bk, 1), 0)
            dv_sc[...] += jnp.where(keys < spec.kv_len, wdo, 0.0)

        _by_state(plan, i, j, body, skipped)

        @pl.when(i == plan.nq - 1)
        def _():
            dk_ref[...] = dk_sc[...]
            dv_ref[...] = dv_sc[...]

    dk, dv = pl.pallas_call(
        dkv_kernel,
        grid=(B, H, plan.nk, plan.nq),
        in_specs=_backward_inputs(plan, "bhji", ex, None, key),
        out_specs=[
            _keys_block(plan, "bhji", D, per_head=True),
            _keys_block(plan, "bhji", Dv, per_head=True),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, plan.sp, D), jnp.float32),
            jax.ShapeDtypeStruct((B, H, plan.sp, Dv), jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((plan.bk, D), jnp.float32),
            pltpu.VMEM((plan.bk, Dv), jnp.float32),
        ],
        compiler_params=_params("bhji"),
        interpret=plan.interpret,
        name="flashpass_flash_tpu_dkv",
    )(*args)
    return dq, dk, dv, dtiles


_attention = vjp_attention(_forward, _backward)


# --------------------------------------------------------------------------- adapter


class FlashTpuKernel(Kernel):
    """Our own flash attention in Pallas for TPU (module docstring): every
    score op through the op protocol, sinks and exact dropout, forward and
    backward, with no ``T x S`` array.  Runs on TPU, or on CPU with
    ``interpret=True`` (slow; for tests).  ``block_q``/``block_k``: the
    largest query/key tiles (None: splash's defaults, `default_blocks`)."""

    name = "flash_tpu"
    platforms = ("tpu",)
    interpret_platforms = ("cpu",)
    dtypes = frozenset({"bfloat16", "float16", "float32"})
    grad = True
    dropout = True
    partitionable = False
    plain_jax = False

    def __init__(self, block_q: int | None = None, block_k: int | None = None):
        for name, block in (("block_q", block_q), ("block_k", block_k)):
            if block is not None and (not isinstance(block, int) or block <= 0):
                raise ValueError(f"{name} must be a positive int, got {block!r}")
        self.block_q, self.block_k = block_q, block_k

    def blocks(self) -> tuple[int, int]:
        """The largest ``(block_q, block_k)``: as given, else splash's defaults."""
        dq, dk = default_blocks()
        return self.block_q or dq, self.block_k or dk

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        return self.platform_reasons(ctx) + _reasons(spec)

    def plan(self, spec: AttentionSpec, interpret: bool = False) -> _Plan:
        return _plan(spec, *self.blocks(), interpret)

    def apply(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        self.require(_reasons(spec))
        extras = tuple(extras)
        _util.check_arrays(self.name, spec, q, k, v, extras)
        plan = self.plan(spec, interpret)

        def run(q, k, v, *extras):
            kdt, tp, sp = plan.kdt, plan.tp, plan.sp
            # The reference rounds q/k to compute_dtype before the product.
            q = _util.pad_axis(q.astype(spec.compute_dtype).astype(kdt), 2, tp)
            k = _util.pad_axis(k.astype(spec.compute_dtype).astype(kdt), 2, sp)
            v = _util.pad_axis(v.astype(kdt), 2, sp)
            out = _attention(plan, q, k, v, *kernel_extras(plan, spec, extras))
            return out[:, :, : spec.q_len]

        return compat.pallas_tpu_traced(run, interpret=False)(q, k, v, *extras)


def dropout_keep(spec: AttentionSpec, key, *, block_q=None, block_k=None, interpret=False):
    """The keep-mask ``[B, H, T, S]`` (int32, 1 kept) the kernel's tiles draw
    for ``spec``'s `Dropout` (``key``: its extra), written out by a Pallas
    kernel that evaluates exactly the tiles' code: for tests and diagnostics."""
    pl, _ = compat.pallas_tpu_modules()
    if spec.dropout is None:
        raise ValueError("the spec has no Dropout op")
    plan = FlashTpuKernel(block_q, block_k).plan(spec, interpret)

    def kernel(key_ref, o_ref):
        b, h, i, j = (pl.program_id(a) for a in range(4))
        qi, kj = _tile_positions(plan, i, j)
        o_ref[...] = _keep(plan, key_ref, b, h, qi, kj).astype(jnp.int32)

    def run(key):
        out = pl.pallas_call(
            kernel,
            grid=(spec.batch, spec.heads, plan.nq, plan.nk),
            in_specs=[_smem(plan)],
            out_specs=pl.BlockSpec((None, None, plan.bq, plan.bk), lambda b, h, i, j: (b, h, i, j)),
            out_shape=jax.ShapeDtypeStruct((spec.batch, spec.heads, plan.tp, plan.sp), jnp.int32),
            interpret=interpret,
        )(key.reshape(2).astype(jnp.uint32))
        return out[:, :, : spec.q_len, : spec.kv_len]

    with compat.pallas_tpu_context(False):
        return run(key)
