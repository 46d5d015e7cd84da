"""Running a spec with ``empty_rows``: any kernel, two calls, one per row.

An additive mask ``s + where(keep, 0, fill)`` with a finite ``fill`` reaches
the kernels as its descriptors (`EmptyRows` says which ops form it).  Rows that
keep a key are what the descriptors compute.  A row that keeps none is, in the
original, ``softmax(s + fill)`` over every key, the fill added to each score,
so it is computed by the same kernel on a second spec: the mask's ops replaced
by a one-element `Bias` holding ``fill`` (O(1) memory, never a ``T x S``
array).  Which rows are empty is read from the mask's ops in key chunks
(O(B·H·T) memory), and the second call runs only when some row is empty
(``lax.cond``), so right-padded batches pay one boolean pass over the keys.
Where the second spec's scores do not depend on the query's position (a
scale, a fill, key-only biases: `rows_apart`) and the kernel is plain JAX,
the second call covers only the empty rows, gathered (`ROW_CHUNK` at a
time), so left padding pays for its empty rows, not for every row again; and
where their scores all round to the fill, for the mean of v only
(`kernels.uniform_rows`).  A ``-inf`` fill leaves those rows NaN, as the
descriptors do, but its gradient is not theirs: the fill is then per row
(`_minus_inf_rows`).

Kernels never see `EmptyRows`: the op names this module as its combinator
(`EmptyRows.combinator`), so selection asks a kernel about both specs
(`check`, `parts`) and the named kernel call runs `apply`, both through
`flashpass.kernels.combine`.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from flashpass.ops import Bias, EmptyRows, KvLengths, Scale, Softcap
from flashpass.spec import AttentionSpec, ExtraSpec

from . import uniform_rows
from .blockwise.tiles import varying
from .combine import in_layout

#: Keys per chunk of the empty-row pass: a ``[B, H|1, T, KEY_CHUNK]`` boolean
#: block at a time.
KEY_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class Split:
    """A spec with an `EmptyRows` op as the two specs kernels run."""

    masked: AttentionSpec  # the descriptors: every row that keeps a key
    filled: AttentionSpec  # the fill added to every score: the empty rows
    group: tuple  # the additive mask's key-excluding ops
    op: EmptyRows


def split(spec: AttentionSpec) -> Split | None:
    """The two specs of ``spec``, or None when it has no ``empty_rows``."""
    op = spec.empty_rows
    if op is None:
        return None
    ops, at = spec.score_ops, op.stop
    first = at - op.count
    if first < 0 or any(not hasattr(o, "keep") for o in ops[first:at]):
        raise ValueError(f"EmptyRows({op.count}) does not follow {op.count} key-excluding ops")
    if at + op.absorbed > len(ops):
        raise ValueError(f"EmptyRows absorbs {op.absorbed} ops past the spec's last")
    masked = dataclasses.replace(spec, empty_rows=None)
    shape = (spec.batch, spec.heads, spec.q_len, 1) if _minus_inf(op) else (1, 1, 1, 1)
    fill = Bias(len(spec.extras), shape, op.dtype)
    filled = dataclasses.replace(
        spec,
        # The terms the fill absorbs (`EmptyRows.absorbed`) go with the mask.
        score_ops=ops[:first] + (fill,) + ops[at + op.absorbed :],
        extras=(*spec.extras, ExtraSpec(shape, op.dtype)),
        empty_rows=None,
    )
    return Split(masked, filled, tuple(ops[first:at]), op)


def parts(spec: AttentionSpec) -> tuple[AttentionSpec, AttentionSpec] | None:
    """The specs of the two kernel calls for ``spec`` (None: it has no
    ``empty_rows``)."""
    found = split(spec)
    return None if found is None else (found.masked, found.filled)


def check(kernel, spec: AttentionSpec, ctx) -> list[str]:
    """``kernel.check`` of both specs of ``spec`` (of ``spec`` itself without
    an `EmptyRows` op)."""
    parts = split(spec)
    if parts is None:
        return list(kernel.check(spec, ctx))
    reasons = list(kernel.check(parts.masked, ctx))
    for reason in kernel.check(parts.filled, ctx):
        if reason not in reasons:
            reasons.append(f"{reason} (for the rows the additive mask may leave with no key)")
    return reasons


def apply(
    kernel,
    spec: AttentionSpec,
    q,
    k,
    v,
    extras=(),
    *,
    interpret: bool = False,
    kv_layout: str = "bhsd",
):
    """``kernel.apply`` for ``spec``, running an `EmptyRows` op as described
    above; k and v in ``kv_layout`` (passed on where it is not canonical)."""
    kernel = in_layout(kernel, kv_layout)
    parts = split(spec)
    if parts is None:
        return kernel.apply(spec, q, k, v, extras, interpret=interpret)
    out = kernel.apply(parts.masked, q, k, v, extras, interpret=interpret)
    empty = empty_rows(spec, parts.group, extras)
    if _minus_inf(parts.op):
        return _minus_inf_rows(kernel, spec, parts, q, k, v, extras, empty, out, interpret)
    fill = jnp.full((1, 1, 1, 1), parts.op.added, parts.op.dtype)
    if parts.op.grad != 1.0:
        q, k, extras = _scores_grad_scaled(spec, parts.op, q, k, extras)
    if rows_apart(kernel, parts.filled, extras):
        return _empty_rows_gathered(kernel, parts, q, k, v, (*extras, fill), empty, out, interpret)

    def with_empty_rows():
        every = kernel.apply(parts.filled, q, k, v, (*extras, fill), interpret=interpret)
        return jnp.where(empty[..., None], every, out)

    return lax.cond(jnp.any(empty), with_empty_rows, lambda: out)


def _minus_inf(op: EmptyRows) -> bool:
    return op.added == float("-inf")


def _minus_inf_rows(kernel, spec, parts: Split, q, k, v, extras, empty, out, interpret: bool):
    """``out`` with the rows an additive ``-inf`` mask leaves with no key
    computed as the original's ``s + -inf``: NaN, and a NaN score cotangent
    that reaches q, k, v and the extras (a ``where`` would drop it).  The fill
    is per row, ``-inf`` in the empty rows and 0 elsewhere: a row filled with
    ``-inf`` is NaN whatever its cotangent (``0 * nan``), so only the empty
    rows may get it; the others are finite with a zero cotangent, adding
    exactly nothing."""
    shape = (spec.batch, spec.heads, spec.q_len)
    rows = jnp.broadcast_to(empty, shape)[..., None]
    fill = jnp.where(rows, jnp.asarray(-jnp.inf, parts.op.dtype), jnp.zeros((), parts.op.dtype))

    def with_empty_rows():
        every = kernel.apply(parts.filled, q, k, v, (*extras, fill), interpret=interpret)
        return jnp.where(empty[..., None], every, out)

    return lax.cond(jnp.any(empty), with_empty_rows, lambda: out)


def _scores_grad_scaled(spec: AttentionSpec, op: EmptyRows, q, k, extras):
    """q, k and the float extras the ops before the mask read, their values
    unchanged and their gradients scaled by ``op.grad``: an empty row's
    scores are constant there, with that derivative in the scores before
    the mask (`EmptyRows.grad`), so every gradient reaching the filled call's
    scores, and through them q, k and those extras, is scaled by it (v's is
    not: it does not flow through the scores)."""
    g = op.grad
    before = {i for o in spec.score_ops[: op.stop - op.count] for i in o.extras_read()}

    def scaled(x):
        still = lax.stop_gradient(x)
        return still + jnp.asarray(g, x.dtype) * (x - still)

    extras = tuple(
        scaled(x) if i in before and jnp.issubdtype(x.dtype, jnp.floating) else x
        for i, x in enumerate(extras)
    )
    return scaled(q), scaled(k), extras


#: Query rows per call of the empty rows' pass (`_empty_rows_gathered`).
ROW_CHUNK = 256

#: Ops whose scores do not depend on the query's position (with extras that
#: hold no query axis): an empty row's filled scores are the same wherever
#: the row sits, so the empty rows can be gathered and computed on their own.
_ROW_FREE = (Scale, Softcap, Bias, KvLengths)


def rows_apart(kernel, filled: AttentionSpec, extras) -> bool:
    """Whether the empty rows' pass may run on the empty rows alone, gathered
    (`_empty_rows_gathered`): ``kernel`` runs any query length (plain JAX),
    and the filled spec's scores do not depend on the query's position."""
    if not getattr(kernel, "plain_jax", False) or filled.dropout is not None:
        return False
    if filled.sink is not None:
        return False
    if any(not isinstance(op, _ROW_FREE) for op in filled.ops):
        return False
    # Every extra goes with the gathered rows' call, read or not: none may
    # hold a query axis (the call's query length is the chunk's).
    return all(x.shape[2] == 1 for x in filled.extras)


def _empty_rows_gathered(kernel, parts: Split, q, k, v, extras, empty, out, interpret: bool):
    """``out`` with each empty row (``empty``, ``[B|1, H|1, T]``) replaced by the
    filled spec's output for it, computed for the empty rows only: they are
    gathered, `ROW_CHUNK` at a time per (batch, head), and chunks past the
    largest count of empty rows are skipped (``lax.cond`` in a ``lax.scan``,
    so the pass differentiates).  Left padding (a few hundred empty rows of
    thousands) costs those rows, not a second pass over every row."""
    spec = parts.filled
    b, h, t_len = spec.batch, spec.heads, spec.q_len
    chunk = min(t_len, ROW_CHUNK)
    n = -(-t_len // chunk)
    empty = jnp.broadcast_to(empty, (b, h, t_len))
    count = jnp.sum(empty, axis=-1)  # [B, H]
    # Each (b, h)'s empty rows first, in order; the tail padded to n chunks.
    order = jnp.argsort(~empty, axis=-1, stable=True).astype(jnp.int32)
    order = jnp.pad(order, ((0, 0), (0, 0), (0, n * chunk - t_len)))
    rows_spec = dataclasses.replace(spec, q_len=chunk)
    dv = spec.v_head_dim

    def one(_, j):
        idx = lax.dynamic_slice_in_dim(order, j * chunk, chunk, axis=2)  # [B, H, C]
        q_rows = jnp.take_along_axis(q, idx[..., None], axis=2)

        def call(q_rows, k, v, extras):
            return kernel.apply(rows_spec, q_rows, k, v, extras, interpret=interpret)

        def run():
            layout = getattr(kernel, "kv_layout", "bhsd")
            return uniform_rows.rows_call(
                call, rows_spec, parts.op.added, layout, q_rows, k, v, extras
            )

        def skip():  # typed as ``run``'s result (in a shard_map body: varying alike)
            return varying(jnp.zeros((b, h, chunk, dv), spec.out_dtype), q, k, v, extras)

        return None, lax.cond(j * chunk < jnp.max(count), run, skip)

    _, rows = lax.scan(one, None, jnp.arange(n))  # [n, B, H, C, Dv]
    rows = jnp.moveaxis(rows, 0, 2).reshape(b, h, n * chunk, dv)
    slot = jnp.clip(jnp.cumsum(empty, axis=-1) - 1, 0, None).astype(jnp.int32)
    filled = jnp.take_along_axis(rows, slot[..., None], axis=2)  # [B, H, T, Dv]
    return jnp.where(empty[..., None], filled, out)


def empty_rows(spec: AttentionSpec, group, extras):
    """Whether each query row keeps no key under all ops of ``group``:
    boolean ``[B|1, H|1, T]``, computed ``KEY_CHUNK`` keys at a time."""
    t_len, s_len = spec.q_len, spec.kv_len
    chunk = min(s_len, KEY_CHUNK)
    count = math.ceil(s_len / chunk)
    read = sorted({i for op in group for i in op.extras_read()})
    lead = [1, 1]
    padded = list(extras)
    for i in read:
        x = extras[i]
        for axis in (0, 1):
            lead[axis] = max(lead[axis], x.shape[axis])
        if x.shape[-1] != 1 and count * chunk != s_len:
            pad = [(0, 0)] * 3 + [(0, count * chunk - s_len)]
            padded[i] = jnp.pad(x, pad)  # past the keys: masked out by ``inside``
    qi = jnp.arange(t_len)[:, None]

    def keeps_a_key(c, acc):
        kj = c * chunk + jnp.arange(chunk)[None, :]
        block = list(padded)
        for i in read:
            if block[i].shape[-1] != 1:
                block[i] = lax.dynamic_slice_in_dim(block[i], c * chunk, chunk, axis=3)
        keep = kj < s_len
        for op in group:
            keep = keep & op.keep(qi, kj, block, s_len)
        keep = jnp.broadcast_to(keep, (*lead, t_len, chunk))
        return acc | jnp.any(keep, axis=-1)

    acc = varying(jnp.zeros((*lead, t_len), bool), [extras[i] for i in read])
    if count == 1:
        return ~keeps_a_key(0, acc)
    return ~lax.fori_loop(0, count, keeps_a_key, acc)
