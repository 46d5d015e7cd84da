"""One step of a ring: what the forward and the backward share.

`RingStep` holds what a ring over ``n`` devices fixes when it is built (the
spec, the step cases, which extras travel with the K/V blocks) and the
helpers a step applies to its query rows and the visiting K/V block: the
block's positions, whether it can hold a visible key, the score ops at
global positions, the dropout keep-mask and the chunking of query rows.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from flashpass.kernels.dropout import apply_dropout, keep_mask

from ..ops import KeepOp, Positions
from ..spec import AttentionSpec
from . import cases


class RingStep:
    """The static parts of a ring over ``n`` devices along ``axis_name``
    (`flashpass.ring.ring_attention` documents the arguments; ``budget``:
    the most scores a chunk of query rows may hold)."""

    def __init__(
        self,
        spec: AttentionSpec,
        axis_name,
        n: int,
        q_global: bool,
        budget: int,
        steps,
        interpret,
        sharded_index,
        skippable: bool,
        rows: int,
    ):
        self.spec, self.axis_name, self.n, self.q_global = spec, axis_name, n, q_global
        self.steps, self.interpret, self.sharded_index = steps, interpret, sharded_index
        self.g = spec.groups
        self.perm = [(i, (i + 1) % n) for i in range(n)]
        self.rows = rows
        self.chunks = spec.q_len // rows
        # Steps whose K/V block every position mask excludes are skipped (where
        # `can_skip`); with kv lengths a step is skipped only when, at run time,
        # every row keeps key 0 (each length >= 1; only ops besides that keep
        # it too, `ScoreOp.keeps_first_key`) and no row's length reaches the
        # block; with segment ids (`can_skip`) when no query id meets a key id
        # of the visiting block.  Each op answers for itself
        # (`ScoreOp.meets_block`, `ScoreOp.empties_a_row`).
        self.skippable = skippable
        # Extras that vary along the keys: read at key positions only and, on a
        # sequence-sharded site, sharded like k (`moving`: they travel with K/V),
        # or whole along the keys (`sliced` at the visiting block).
        # (Score ops only: the normaliser's and dropout's extras hold no keys.)
        keyed = {i for op in spec.score_ops for i in op.extras_read()}
        keyed = {i for i in keyed if spec.extras[i].shape[3] > 1}
        self.moving = tuple(sorted(i for i in keyed if q_global and spec.extras[i].shape[2] == 1))
        self.sliced = tuple(sorted(keyed - set(self.moving)))
        # (Their cotangents: biases, ALiBi slopes.)
        self.biases = tuple(sorted({i for op in spec.ops for i in op.grad_extras()}))
        # Key counts (kv lengths): shifted to a step's K/V block, clipped first.
        total = spec.kv_len * n
        bounds = [b for op in spec.ops for b in op.key_counts(total).values()]
        self.by_length = bool(bounds) and all(op.keeps_first_key for op in spec.ops)
        self.length_bound = max(bounds, default=total + 1)

    def positions(self, step):
        """Row and (global) column offsets of this step's query and K/V blocks."""
        spec = self.spec
        me = lax.axis_index(self.axis_name)
        src = (me - step) % self.n
        return (me * spec.q_len if self.q_global else 0), src * spec.kv_len

    def visible(self, q0, k0, extras):
        """Whether the K/V block at ``k0`` (``extras`` with its key ids) can
        hold a key the query block sees."""
        spec = self.spec
        ok = jnp.bool_(True)
        if not (self.skippable or self.by_length):
            return ok
        q_last, k_last = q0 + spec.q_len - 1, k0 + spec.kv_len - 1
        total = spec.kv_len * self.n
        for op in spec.ops:
            meets = op.meets_block(q0, q_last, k0, k_last, extras, total)
            if meets is not True:
                ok &= meets
        # A row with no key needs every key's fill: then nothing is skipped.
        empty = [op.empties_a_row(extras, total) for op in spec.ops]
        empty = [e for e in empty if e is not False]
        if empty:
            ok |= jnp.any(jnp.stack(empty))
        return ok

    def scores(self, qf, kb, q0, k0, extras):
        """The step's scores after every score op, in program order."""
        raw = jnp.einsum("bhgtd,bhsd->bhgts", qf, kb.astype(jnp.float32))
        return self.score_ops(raw, q0, k0, extras)

    def score_ops(self, s, q0, k0, extras):
        """The spec's score ops on raw scores ``s`` (global positions ``q0``,
        ``k0``): elementwise, so the backward differentiates it (`jax.vjp`)."""
        spec, heads5 = self.spec, self.heads5
        rows = q0 + jnp.arange(s.shape[-2])[:, None]
        cols = k0 + jnp.arange(s.shape[-1])[None, :]
        extras = _Heads5(extras, heads5)
        total = spec.kv_len * self.n
        at = Positions(s.shape, rows[:, 0], cols[0], kv_len=total)
        for op in spec.ops:
            if isinstance(op, KeepOp):  # (kv lengths: the local queries' own limits, or 1)
                s = jnp.where(op.keep(rows, cols, extras, total), s, op.fill)
            else:  # the row statistics (`sink_rows`) and weights (`dropped`) take the rest
                s = op.apply(s, extras, at)
        return s

    def heads5(self, x):
        """A ``[B|1, H|1, T|1, S|1]`` extra as ``[B|1, Hkv|1, G|1, T|1, S|1]``."""
        b, h, t, s = x.shape
        g = self.g
        return x.reshape(b, *((h // g, g) if h > 1 else (1, 1)), t, s)

    def with_blocks(self, extras, blocks, k0):
        """``extras`` as the visiting K/V block at ``k0`` reads them."""
        out = list(extras)
        for i, block in zip(self.moving, blocks, strict=True):
            out[i] = block
        for i in self.sliced:
            out[i] = lax.dynamic_slice_in_dim(extras[i], k0, self.spec.kv_len, axis=3)
        return tuple(out)

    def over_rows(self, body, state):
        """``body(r0, state)`` for each chunk of query rows starting at ``r0``."""
        if self.chunks == 1:
            return body(0, state)
        return lax.fori_loop(0, self.chunks, lambda c, st: body(c * self.rows, st), state)

    def take(self, x, r0):
        """Rows ``[r0, r0 + rows)`` of a grouped array (query axis 3)."""
        return x if self.chunks == 1 else lax.dynamic_slice_in_dim(x, r0, self.rows, axis=3)

    def put(self, x, y, r0):
        return y if self.chunks == 1 else lax.dynamic_update_slice_in_dim(x, y, r0, axis=3)

    def rows_of(self, extras, r0):
        """The extras' rows of one chunk (those with a query axis)."""
        if self.chunks == 1:
            return extras
        return tuple(
            lax.dynamic_slice_in_dim(x, r0, self.rows, axis=2)
            if x.shape[2] == self.spec.q_len
            else x
            for x in extras
        )

    def keep_of(self, w, q0, k0, extras):
        """The program's keep-mask of weights ``w [B, Hkv, G, t, s]`` (rows at
        ``q0``, keys at ``k0``), regenerated at global positions (batch and
        heads too, `ShardedIndex`), or None without dropout."""
        spec, g, index = self.spec, self.g, self.sharded_index
        op = spec.dropout
        if op is None:
            return None
        b = jnp.arange(spec.batch)
        h = jnp.arange(spec.kv_heads)[:, None] * g + jnp.arange(g)
        if index is not None:  # the global indices of the local ones
            b = index.of(index.batch, b)
            h = index.of(index.heads, h)
        b, h = b[:, None, None, None, None], h[None, :, :, None, None]
        t = q0 + jnp.arange(w.shape[-2])[:, None]
        s = k0 + jnp.arange(w.shape[-1])[None, :]
        return keep_mask(op, extras[op.index], b, h, t, s)

    def dropped(self, w, keep):
        return w if keep is None else apply_dropout(self.spec.dropout, w, keep)

    @staticmethod
    def replaced(extras, new: dict):
        return tuple(new.get(i, x) for i, x in enumerate(extras))

    @staticmethod
    def add_part(total, part, r0, k0):
        """``total`` (an extra's cotangent) plus ``part`` at rows ``r0`` (when
        it has a query axis) and keys ``k0``."""
        r0 = r0 if total.shape[2] > 1 else 0
        at = (0, 0, r0, k0)
        old = lax.dynamic_slice(total, at, part.shape)
        return lax.dynamic_update_slice(total, old + part.astype(total.dtype), at)

    def grouped(self, x):  # [B, H, T, D] -> [B, Hkv, G, T, D]
        b, _, t, d = x.shape
        return x.reshape(b, self.spec.kv_heads, self.g, t, d)

    def sink_rows(self, extras):
        """The local query rows' sink logits ``[B, Hkv, G, T]`` (float32)."""
        spec = self.spec
        sink = extras[spec.sink.index].astype(jnp.float32)[..., 0]
        full = (spec.batch, spec.heads, spec.q_len)
        return jnp.broadcast_to(sink, full).reshape(spec.batch, spec.kv_heads, self.g, spec.q_len)

    def by_case(self, step, run, *state):
        """``run(case, *state)`` for this device's case of ``step`` (its own
        block, or a wrapped one on devices ``i < step``)."""
        step_cases = self.steps[step]
        if len(step_cases) == 1 or step_cases[0] == step_cases[1]:
            return run(step_cases[0], *state)
        own = lax.axis_index(self.axis_name) >= step
        first, second = step_cases
        return lax.cond(own, lambda *st: run(first, *st), lambda *st: run(second, *st), *state)

    def step_extras(self, case, here, k0):
        """The extras as the case's kernel reads them: kv lengths shifted to
        the visiting block (the bias, mask and id arrays are already its)."""
        out = list(here)
        for i in {i for op in case.spec.ops for i in op.key_counts(case.spec.kv_len)}:
            out[i] = cases.shifted_lengths(here[i], k0, self.length_bound)
        return tuple(out)

    def stats5(self, x):  # [B, H, T] -> [B, Hkv, G, T]
        spec = self.spec
        return x.reshape(spec.batch, spec.kv_heads, self.g, -1)

    def permute(self, x):
        """``x`` moved one device along the ring."""
        return lax.ppermute(x, self.axis_name, self.perm)


class _Heads5:
    """``extras[i]`` as `RingStep.heads5` reshapes it, made when read."""

    def __init__(self, extras, heads5):
        self.extras, self.heads5, self.made = extras, heads5, {}

    def __getitem__(self, i):
        if i not in self.made:
            self.made[i] = self.heads5(self.extras[i])
        return self.made[i]
