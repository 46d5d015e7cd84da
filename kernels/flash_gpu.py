"""``flash_gpu``: the op-protocol flash kernel of `flash_tpu`, in Pallas Triton for GPU.

The same tiles as `flashpass.kernels.flash_tpu` (its plan, its per-tile score
function that asks the spec's ops, its tile states, skipped-tile folding and
dropout keep-mask), on the Pallas Triton backend: one program per (batch,
query head, query tile) loops over the key tiles (``lax.fori_loop``), each
tile switching at run time between skipped, interior and edge
(``lax.switch``).  The backward is two such kernels (dQ with the extras'
cotangent tiles, over key tiles; dK/dV over query tiles).  Dropout draws the
keep-mask with `flashpass.compat.threefry2x32_rounds` (Triton has no rule for
JAX's Threefry primitive): bit-equal to the blockwise kernel's.

Triton needs power-of-two tiles and head dims: query and key tiles are
powers of two (default 64), head dims zero-padded to a power of two >= 16.
JAX deprecates the Pallas Triton backend from 0.11.2 (in favour of Mosaic
GPU, which lowers no ``dot_general``, see docs/kernels.md): the kernel then
declines every site (`flashpass.compat.TRITON_ATTENTION`), as ``pallas_gpu`` does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from flashpass import compat
from flashpass.spec import AttentionSpec

from . import _util
from . import flash_tiles as tiles
from .base import CheckContext, Kernel
from .dropout import apply_dropout, keep_mask_words

#: Default query and key tile (Triton: a power of two).
DEFAULT_BLOCK = 64


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _plan(spec: AttentionSpec, block_q: int, block_k: int, interpret: bool):
    plan = tiles._plan(spec, block_q, block_k, interpret)
    bq = min(_pow2(block_q), _pow2(spec.q_len))
    bk = min(_pow2(block_k), _pow2(spec.kv_len))
    return dataclasses.replace(
        plan, bq=bq, bk=bk, nq=-(-spec.q_len // bq), nk=-(-spec.kv_len // bk)
    )


def _keep(plan, key_ref, b, h, qi, kj):
    op = plan.spec.dropout
    return keep_mask_words(
        op, key_ref[0], key_ref[1], b, h, qi, kj, threefry=compat.threefry2x32_rounds
    )


def _extra_tile(plan, index, ref, j):
    """Extra ``index``'s tile of key tile ``j`` from its block ``[bq|1, Sp|1]``."""
    _, _, _, es = plan.spec.extras[index].shape
    if es > 1:
        x = ref[:, pl_ds(j * plan.bk, plan.bk)]
    else:
        x = ref[...]
    return x != 0 if index in plan.bools else x


def pl_ds(start, size):
    pl, _ = compat.pallas_triton_modules()
    return pl.ds(start, size)


def _extras(plan, refs, j):
    ex = [None] * len(plan.spec.extras)
    for index, ref in zip(plan.tile_extras, refs, strict=True):
        ex[index] = _extra_tile(plan, index, ref, j)
    return ex


def _switch(plan, i, j, body, skipped, state):
    """``body(edge, state)`` on tile ``(i, j)`` by its run-time state, or
    ``skipped(state)`` (the state unchanged without `_Plan.fold`)."""
    visit, full = tiles._tile_state(plan, i, j)
    if visit is None:
        return body(True, state)
    index = jnp.where(visit, jnp.where(full, 1, 2), 0).astype(jnp.int32)
    skip = skipped if plan.fold is not None else (lambda s: s)
    branches = (skip, functools.partial(body, False), functools.partial(body, True))
    return lax.switch(index, branches, state)


# --------------------------------------------------------------------------- blocks


def _blocks(plan, order: str):
    """BlockSpecs of q, k, v, dO/out rows, row statistics and extras for a
    grid ``(B, H, n)`` over query tiles (``"q"``) or key tiles (``"k"``)."""
    pl, _ = compat.pallas_triton_modules()
    spec = plan.spec
    g = spec.groups
    Dp, Dvp = _pow2(spec.head_dim), _pow2(spec.v_head_dim)
    if order == "q":
        rows = lambda w: pl.BlockSpec((None, None, plan.bq, w), lambda b, h, i: (b, h, i, 0))  # noqa: E731
    else:
        rows = lambda w: pl.BlockSpec((None, None, plan.tp, w), lambda b, h, j: (b, h, 0, 0))  # noqa: E731
    if order == "q":
        keys = lambda w: pl.BlockSpec(
            (None, None, plan.sp, w), lambda b, h, i: (b, lax.div(h, g), 0, 0)
        )  # noqa: E731
    else:
        keys = lambda w: pl.BlockSpec(
            (None, None, plan.bk, w), lambda b, h, j: (b, lax.div(h, g), j, 0)
        )  # noqa: E731

    def extra(index):
        eb, eh, et, es = spec.extras[index].shape
        t = (plan.bq if order == "q" else plan.tp) if et > 1 else 1
        s = plan.sp if es > 1 else 1

        def index_map(b, h, n):
            return (
                b if eb > 1 else 0,
                h if eh > 1 else 0,
                n if (et > 1 and order == "q") else 0,
                0,
            )

        return pl.BlockSpec((None, None, t, s), index_map)

    return rows, keys, extra, Dp, Dvp


# --------------------------------------------------------------------------- forward


def _forward(plan, q, k, v, ex, sink, key):
    pl, plgpu = compat.pallas_triton_modules()
    spec = plan.spec
    B, H = spec.batch, spec.heads
    rows, keys, extra, Dp, Dvp = _blocks(plan, "q")
    n_ex = len(plan.tile_extras)
    has_sink, has_key = sink is not None, key is not None
    # k, v: whole (padded) sequences per head; tiles sliced in the loop.
    full_keys = lambda w: pl.BlockSpec(  # noqa: E731
        (None, None, plan.sp, w), lambda b, h, i: (b, lax.div(h, spec.groups), 0, 0)
    )

    def kernel(*refs):
        q_ref, k_ref, v_ref, ex_refs, sink_ref, key_ref, rest = tiles.forward_refs(
            refs, n_ex, has_sink, has_key
        )
        o_ref, m_ref, l_ref = rest
        b, h, i = (pl.program_id(a) for a in range(3))
        qt = q_ref[...]
        if has_sink:
            m0 = jnp.broadcast_to(sink_ref[...].astype(jnp.float32), (plan.bq, 1))
            l0 = jnp.where(m0 == -jnp.inf, 0.0, 1.0).astype(jnp.float32)
        else:
            m0 = jnp.full((plan.bq, 1), -jnp.inf, jnp.float32)
            l0 = jnp.zeros((plan.bq, 1), jnp.float32)
        acc0 = jnp.zeros((plan.bq, Dvp), jnp.float32)

        def step(j, state):
            qi, kj = tiles._tile_positions(plan, i, j)
            kt = k_ref[pl.ds(j * plan.bk, plan.bk), :]
            vt = v_ref[pl.ds(j * plan.bk, plan.bk), :]

            def body(edge, state):
                m_prev, l_prev, acc = state
                s = tiles._nt(qt, kt)
                s = tiles._score_fn(plan, qi, kj, edge)(s, _extras(plan, ex_refs, j))
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp(m_prev - m_safe)
                p = jnp.exp(s - m_safe)
                l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
                if has_key:
                    p = apply_dropout(spec.dropout, p, _keep(plan, key_ref, b, h, qi, kj))
                pv = tiles._nn(p.astype(spec.p_dtype).astype(plan.kdt), vt)
                return m_new, l_new, alpha * acc + pv

            def skipped(state):
                m_prev, l_prev, acc = state
                c = jnp.float32(plan.fold)
                n = jnp.clip(spec.kv_len - j * plan.bk, 0, plan.bk).astype(jnp.float32)
                vsum = jnp.sum(vt.astype(jnp.float32), axis=0, keepdims=True)
                m_new = jnp.maximum(m_prev, c)
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp(m_prev - m_safe)
                beta = jnp.exp(c - m_safe)
                beta_p = beta.astype(spec.p_dtype).astype(jnp.float32)
                return m_new, alpha * l_prev + n * beta, alpha * acc + beta_p * vsum

            return _switch(plan, i, j, body, skipped, state)

        m, den, acc = lax.fori_loop(0, plan.nk, step, (m0, l0, acc0))
        o_ref[...] = (acc / den).astype(o_ref.dtype)
        m_ref[...] = m
        l_ref[...] = den

    in_specs = [rows(Dp), full_keys(Dp), full_keys(Dvp)]
    in_specs += [extra(index) for index in plan.tile_extras]
    args = [q, k, v, *ex]
    if has_sink:
        eb, eh, et, _ = spec.extras[spec.sink.index].shape
        in_specs.append(
            pl.BlockSpec(
                (None, None, plan.bq if et > 1 else 1, 1),
                lambda b, h, i: (b if eb > 1 else 0, h if eh > 1 else 0, i if et > 1 else 0, 0),
            )
        )
        args.append(sink)
    if has_key:
        in_specs.append(pl.BlockSpec((2,), lambda b, h, i: (0,)))
        args.append(key)
    stat = jax.ShapeDtypeStruct((B, H, plan.tp, 1), jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(B, H, plan.nq),
        in_specs=in_specs,
        out_specs=[rows(Dvp), rows(1), rows(1)],
        out_shape=[jax.ShapeDtypeStruct((B, H, plan.tp, Dvp), spec.out_dtype), stat, stat],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=plan.interpret,
        name="flashpass_flash_gpu_fwd",
    )(*args)


# --------------------------------------------------------------------------- backward


def _grads_of_tile(plan, qt, kt, vt, dot, m, inv_l, delta, ex, key_ref, b, h, qi, kj, edge, want):
    spec = plan.spec
    grads = {index: ex[index].astype(jnp.float32) for index in plan.grad_extras} if want else {}
    score = tiles._score_fn(plan, qi, kj, edge)

    def f(s, g):
        full = list(ex)
        for index, x in g.items():
            full[index] = x
        return score(s, full)

    s, vjp = jax.vjp(f, tiles._nt(qt, kt), grads)
    p = jnp.exp(s - m) * inv_l
    dp = tiles._nt(dot, vt)
    pd = p
    if spec.dropout is not None:
        keep = _keep(plan, key_ref, b, h, qi, kj)
        pd = apply_dropout(spec.dropout, p, keep)
        dp = apply_dropout(spec.dropout, dp, keep)
    ds, dg = vjp(p * (dp - delta))
    return ds, pd, dg


def _backward(plan, q, k, v, ex, key, do, m, inv_l, delta):
    """``(dq, dk, dv per query head, dextra tiles)``: two kernels over the same
    inputs, dQ by query tile and dK/dV by key tile."""
    has_key = key is not None
    args = [q, k, v, do, m, inv_l, delta, *ex] + ([key] if has_key else [])
    dq, dex = _backward_dq(plan, args, has_key)
    dk, dv = _backward_dkv(plan, args, has_key)
    return dq, dk, dv, dex


def _backward_params():
    _, plgpu = compat.pallas_triton_modules()
    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _split_refs(plan, refs, has_key: bool):
    """A backward kernel's refs: ``((q, k, v, dO, m, 1/l, delta), extras, key, outputs)``."""
    n_ex = len(plan.tile_extras)
    q_ref, k_ref, v_ref, do_ref, m_ref, il_ref, d_ref = refs[:7]
    ex_refs = refs[7 : 7 + n_ex]
    rest = list(refs[7 + n_ex :])
    key_ref = rest.pop(0) if has_key else None
    return (q_ref, k_ref, v_ref, do_ref, m_ref, il_ref, d_ref), ex_refs, key_ref, rest


def _backward_dq(plan, args, has_key: bool):
    """dQ (and the extras' cotangent tiles): one program per query tile."""
    pl, _ = compat.pallas_triton_modules()
    spec = plan.spec
    B, H, G = spec.batch, spec.heads, spec.groups
    Dp, Dvp = _pow2(spec.head_dim), _pow2(spec.v_head_dim)
    kdt = plan.kdt
    dtiles = []
    for index in plan.grad_extras:
        _, _, et, es = spec.extras[index].shape
        dtiles.append((plan.bq if et > 1 else 1, plan.bk if es > 1 else 1))

    rows, _, extra_q, _, _ = _blocks(plan, "q")
    full_keys = lambda w: pl.BlockSpec(  # noqa: E731
        (None, None, plan.sp, w), lambda b, h, i: (b, lax.div(h, G), 0, 0)
    )

    def dq_kernel(*refs):
        (q_ref, k_ref, v_ref, do_ref, m_ref, il_ref, d_ref), ex_refs, key_ref, outs = _split_refs(
            plan, refs, has_key
        )
        dq_ref, *dex_refs = outs
        b, h, i = (pl.program_id(a) for a in range(3))
        qt, dot, mt, il, dl = q_ref[...], do_ref[...], m_ref[...], il_ref[...], d_ref[...]

        def step(j, dq):
            qi, kj = tiles._tile_positions(plan, i, j)
            kt = k_ref[pl.ds(j * plan.bk, plan.bk), :]
            vt = v_ref[pl.ds(j * plan.bk, plan.bk), :]
            ex = _extras(plan, ex_refs, j)

            def body(edge, dq):
                ds, _, dg = _grads_of_tile(
                    plan, qt, kt, vt, dot, mt, il, dl, ex, key_ref, b, h, qi, kj, edge, True
                )
                for ref, index in zip(dex_refs, plan.grad_extras, strict=True):
                    ref[j] = dg[index].astype(jnp.float32)
                return dq + tiles._nn(ds.astype(kdt), kt)

            def skipped(dq):
                return dq

            for ref, shape in zip(dex_refs, dtiles, strict=True):
                ref[j] = jnp.zeros(shape, jnp.float32)
            return _switch(plan, i, j, body, skipped, dq)

        dq_ref[...] = lax.fori_loop(0, plan.nk, step, jnp.zeros((plan.bq, Dp), jnp.float32))

    in_specs = [rows(Dp), full_keys(Dp), full_keys(Dvp), rows(Dvp), rows(1), rows(1), rows(1)]
    in_specs += [extra_q(index) for index in plan.tile_extras]
    if has_key:
        in_specs.append(pl.BlockSpec((2,), lambda b, h, i: (0,)))
    dq, *dex = pl.pallas_call(
        dq_kernel,
        grid=(B, H, plan.nq),
        in_specs=in_specs,
        out_specs=[rows(Dp)]
        + [
            pl.BlockSpec((None, None, None, plan.nk, *t), lambda b, h, i: (b, h, i, 0, 0, 0))
            for t in dtiles
        ],
        out_shape=[jax.ShapeDtypeStruct((B, H, plan.tp, Dp), jnp.float32)]
        + [jax.ShapeDtypeStruct((B, H, plan.nq, plan.nk, *t), jnp.float32) for t in dtiles],
        compiler_params=_backward_params(),
        interpret=plan.interpret,
        name="flashpass_flash_gpu_dq",
    )(*args)
    return dq, dex


def _backward_dkv(plan, args, has_key: bool):
    """dK, dV per query head: one program per key tile."""
    pl, _ = compat.pallas_triton_modules()
    spec = plan.spec
    B, H = spec.batch, spec.heads
    Dp, Dvp = _pow2(spec.head_dim), _pow2(spec.v_head_dim)
    kdt = plan.kdt
    rows_k, keys_k, extra_k, _, _ = _blocks(plan, "k")
    per_head = lambda w: pl.BlockSpec((None, None, plan.bk, w), lambda b, h, j: (b, h, j, 0))  # noqa: E731

    def dkv_kernel(*refs):
        (q_ref, k_ref, v_ref, do_ref, m_ref, il_ref, d_ref), ex_refs, key_ref, outs = _split_refs(
            plan, refs, has_key
        )
        dk_ref, dv_ref = outs
        b, h, j = (pl.program_id(a) for a in range(3))
        kt, vt = k_ref[...], v_ref[...]

        def step(i, carry):
            qi, kj = tiles._tile_positions(plan, i, j)
            rows_i = pl.ds(i * plan.bq, plan.bq)
            qt, dot = q_ref[rows_i, :], do_ref[rows_i, :]
            mt, il, dl = m_ref[rows_i, :], il_ref[rows_i, :], d_ref[rows_i, :]

            def ex_rows(index, ref):
                _, _, et, es = spec.extras[index].shape
                x = ref[rows_i if et > 1 else slice(None), :]
                return x != 0 if index in plan.bools else x

            ex = [None] * len(spec.extras)
            for index, ref in zip(plan.tile_extras, ex_refs, strict=True):
                ex[index] = ex_rows(index, ref)

            def body(edge, carry):
                dk, dv = carry
                ds, pd, _ = _grads_of_tile(
                    plan, qt, kt, vt, dot, mt, il, dl, ex, key_ref, b, h, qi, kj, edge, False
                )
                dv = dv + tiles._tn(pd.astype(spec.p_dtype).astype(kdt), dot)
                return dk + tiles._tn(ds.astype(kdt), qt), dv

            def skipped(carry):
                dk, dv = carry
                w = jnp.exp(jnp.float32(plan.fold) - mt) * il
                w = w.astype(spec.p_dtype).astype(jnp.float32)
                wdo = jnp.sum(w * dot.astype(jnp.float32), axis=0, keepdims=True)
                keys = j * plan.bk + lax.broadcasted_iota(jnp.int32, (plan.bk, 1), 0)
                return dk, dv + jnp.where(keys < spec.kv_len, wdo, 0.0)

            return _switch(plan, i, j, body, skipped, carry)

        zeros = (jnp.zeros((plan.bk, Dp), jnp.float32), jnp.zeros((plan.bk, Dvp), jnp.float32))
        dk, dv = lax.fori_loop(0, plan.nq, step, zeros)
        dk_ref[...] = dk
        dv_ref[...] = dv

    def extra_by_key(index):
        eb, eh, et, es = spec.extras[index].shape
        t = plan.tp if et > 1 else 1
        s = plan.bk if es > 1 else 1
        return pl.BlockSpec(
            (None, None, t, s),
            lambda b, h, j: (b if eb > 1 else 0, h if eh > 1 else 0, 0, j if es > 1 else 0),
        )

    in_specs = [rows_k(Dp), keys_k(Dp), keys_k(Dvp), rows_k(Dvp), rows_k(1), rows_k(1), rows_k(1)]
    in_specs += [extra_by_key(index) for index in plan.tile_extras]
    if has_key:
        in_specs.append(pl.BlockSpec((2,), lambda b, h, j: (0,)))
    dk, dv = pl.pallas_call(
        dkv_kernel,
        grid=(B, H, plan.nk),
        in_specs=in_specs,
        out_specs=[per_head(Dp), per_head(Dvp)],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, plan.sp, Dp), jnp.float32),
            jax.ShapeDtypeStruct((B, H, plan.sp, Dvp), jnp.float32),
        ],
        compiler_params=_backward_params(),
        interpret=plan.interpret,
        name="flashpass_flash_gpu_dkv",
    )(*args)
    return dk, dv


# --------------------------------------------------------------------------- custom_vjp


_attention = tiles.vjp_attention(_forward, _backward)


# --------------------------------------------------------------------------- adapter


class FlashGpuKernel(Kernel):
    """`flash_tpu`'s op-protocol kernel on Pallas Triton (module docstring):
    every descriptor, sinks and exact dropout, forward and backward, with no
    ``T x S`` array.  GPU, or CPU with ``interpret=True``; JAX < 0.11.1 only."""

    name = "flash_gpu"
    platforms = ("gpu",)
    interpret_platforms = ("cpu",)
    dtypes = frozenset({"bfloat16", "float16", "float32"})
    grad = True
    dropout = True

    def __init__(self, block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK):
        for name, block in (("block_q", block_q), ("block_k", block_k)):
            if not isinstance(block, int) or block < 16 or block & (block - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {block!r}")
        self.block_q, self.block_k = block_q, block_k

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        reasons = self.platform_reasons(ctx)
        if not compat.TRITON_ATTENTION:
            reasons.append(
                "flash_gpu runs on Pallas Triton, which this JAX deprecates (0.11.1+); "
                "the 'blockwise' kernel takes the site"
            )
        return reasons + tiles._reasons(spec)

    def plan(self, spec: AttentionSpec, interpret: bool = False):
        return _plan(spec, self.block_q, self.block_k, interpret)

    def apply(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        self.require(tiles._reasons(spec))
        extras = tuple(extras)
        _util.check_arrays(self.name, spec, q, k, v, extras)
        plan = self.plan(spec, interpret)
        Dp, Dvp = _pow2(spec.head_dim), _pow2(spec.v_head_dim)
        kdt, tp, sp = plan.kdt, plan.tp, plan.sp

        def prep(x, length, width, rounded=True):
            x = x.astype(spec.compute_dtype) if rounded else x
            return _util.pad_axis(_util.pad_axis(x.astype(kdt), 2, length), 3, width)

        def run(q, k, v, *extras):
            qp, kp = prep(q, tp, Dp), prep(k, sp, Dp)
            vp = prep(v, sp, Dvp, rounded=False)
            out = _attention(plan, qp, kp, vp, *tiles.kernel_extras(plan, spec, extras))
            return out[:, :, : spec.q_len, : spec.v_head_dim]

        # (x64 off while tracing, forward and backward, as for the TPU kernels.)
        return compat.pallas_tpu_traced(run, interpret=False)(q, k, v, *extras)
