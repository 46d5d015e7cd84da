"""`Causal`: keys up to the row's own position (plus an offset)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import EXCLUDED, Positional


@dataclasses.dataclass(frozen=True)
class Causal(Positional):
    """``s = where(j <= i + offset, s, fill)`` for query ``i`` and key ``j``.

    The matcher only emits this when every query row keeps at least one key
    (``offset >= 0``) and the fill is still ``<= EXCLUDING_FILL`` (or ``-inf``)
    after every later score op, so excluded keys have exactly zero weight and a
    kernel may skip them.
    """

    offset: int
    fill: float

    descriptors_doc = {"causal": "causal mask (any offset >= 0)"}
    word = "causal"

    def keep(self, qi, kj, extras, kv_len=None):
        return kj <= qi + self.offset

    @property
    def keeps_first_key(self) -> bool:
        return self.offset >= 0

    def row_keys(self):
        return "own" if self.offset >= 0 else "not own"

    def apply(self, s, extras, at):
        # On the raw positions: the transposed form (rows -k, columns -q)
        # reads -q <= -k + offset, the same test.
        q, k = at.q, at.k
        keep = k[None, :] <= q[:, None] + self.offset
        return jnp.where(keep, s, jnp.asarray(self.fill, s.dtype))

    def meets(self, r0, r1, c0, c1):
        return c0 <= r1 + self.offset

    def key_ranges(self, qi):
        return ((None, qi + self.offset + 1),)

    def at_offset(self, d, t, s):
        edge = d + self.offset  # keys c <= r + edge
        if edge < -(t - 1):
            return EXCLUDED
        if edge >= s - 1:
            return None
        if edge < 0:
            return "a causal edge below the diagonal"
        return Causal(edge, self.fill)
