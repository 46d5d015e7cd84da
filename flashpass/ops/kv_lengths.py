"""`KvLengths`: per-row valid key counts (a KV cache's fill level)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import KeepOp


@dataclasses.dataclass(frozen=True)
class KvLengths(KeepOp):
    """``s = where(j < L + shift, s, fill)`` for key ``j``, ``L = extras[index]``.

    ``L`` is the user's integer lengths array (a KV cache's fill level), 4-D
    ``[B|1, H|1, T|1, 1]``: it varies over batch rows and heads, and over
    queries in chunked prefill (each query's own cache position), never over
    keys.  ``shift`` absorbs the comparison's spelling: ``j < L``
    is shift 0, ``j <= L`` shift 1, ``j + 2 < L`` shift -2.  Kernels read the
    valid length of a row as ``clip(L + shift, 0, kv_len)`` computed without
    overflow (`valid_lengths`).  A row whose valid length is 0 keeps no key:
    the original computes it over every key's fill, and kernels must too.  The
    matcher emits the op only with a fill that excludes keys
    (``<= EXCLUDING_FILL`` or ``-inf``).  In key-range form each row keeps
    ``[0, valid length)``, a range read from data (so no static tile state).
    """

    index: int
    shape: tuple[int, ...]
    fill: float
    shift: int = 0

    descriptors_doc = {"kv_lengths": "per-row kv lengths (`j < lengths[b]`)"}
    word = "kv_lengths"
    keeps_first_key = True  # (a length of 0 aside: `empties_a_row`)

    def extras_read(self):
        return (self.index,)

    def row_keys(self):
        return "maybe none"

    def meets_block(self, r0, r1, c0, c1, extras, kv_len):
        return c0 < jnp.max(valid_lengths(self, extras[self.index], kv_len))

    def empties_a_row(self, extras, kv_len):
        return jnp.min(valid_lengths(self, extras[self.index], kv_len)) < 1

    def key_counts(self, kv_len):
        return {self.index: kv_len + abs(self.shift) + 1}

    def keep(self, qi, kj, extras, kv_len=None):
        return kj < valid_lengths(self, extras[self.index], kv_len)

    def apply(self, s, extras, at):
        k = at.k  # (keys only: no query grid)
        n = valid_lengths(self, extras[self.index], at.kv_len)
        return jnp.where(k < n, s, jnp.asarray(self.fill, s.dtype))


def valid_lengths(op: KvLengths, lengths, kv_len: int):
    """The valid key count ``clip(L + op.shift, 0, kv_len)`` of each row, int32,
    shaped like ``lengths``.  ``L`` is clipped in its own dtype first, to
    bounds that change no comparison with a key position, so nothing overflows."""
    bound = kv_len + abs(op.shift) + 1
    n = jnp.clip(lengths, -bound, bound).astype(jnp.int32) + op.shift
    return jnp.clip(n, 0, kv_len)
