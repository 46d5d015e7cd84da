"""`CausalSelect`: a mask that is one key mask below a causal diagonal and another above it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import KeepOp, with_shape


@dataclasses.dataclass(frozen=True)
class CausalSelect(KeepOp):
    """``s = where(where(j <= i + offset, below[j], above[j]), s, fill)``.

    A mask computed elementwise from one causal pattern and key-side data (a
    padding vector): whatever the arithmetic, such a mask is, entry by entry,
    the arithmetic evaluated with the causal pattern's "in" value (``below``)
    or its "out" value (``above``), both functions of the keys only
    (`patterns.causal_select` proves it and builds both).  keras-hub's
    ``minimum(int(padding)[:, None], int(causal))`` is ``below = padding !=
    0``, ``above = padding < 0``: an int padding input need not hold only 0
    and 1, and this reads it exactly.  ``extras[below]`` and
    ``extras[above]`` are ``[B|1, H|1, 1, S]`` booleans: O(B·S), never
    ``T x S``.
    """

    below: int
    above: int
    shape: tuple[int, ...]
    offset: int
    fill: float

    descriptors_doc = {
        "causal_select": "a causal diagonal choosing between two key masks "
        "(`where(j <= i, a[j], b[j])`)"
    }
    word = "causal-select"
    reason_words = "a mask choosing between two key masks by a causal diagonal"

    def extras_read(self):
        return (self.below, self.above)

    def keep(self, qi, kj, extras, kv_len=None):
        return jnp.where(kj <= qi + self.offset, extras[self.below], extras[self.above])

    def at_offset(self, d, t, s):
        return "masks choosing between key masks by a diagonal depend on the device's position"

    def localized(self, shape4):
        return with_shape(self, shape4)
