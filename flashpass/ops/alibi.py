"""`Alibi`: a per-head linear position bias (ALiBi), O(H) slopes."""

from __future__ import annotations

import dataclasses

from .base import ScoreOp, with_shape


@dataclasses.dataclass(frozen=True)
class Alibi(ScoreOp):
    """``s = s + slopes * (j - query_coef * i + offset)`` for query ``i``, key ``j``.

    ``slopes = extras[index]`` is the program's slope array, 4-D ``[B|1, H|1,
    1, 1]``: it never varies over queries or keys (a constant of the program,
    e.g. ``2 ** (-8 h / H)``, or an input).  ``query_coef`` is 1 for the
    relative form ``slope[h] * (j - i)`` and 0 for ``slope[h] * j`` (Bloom's),
    which equals the relative form up to a per-row constant, i.e. in the
    softmax, but is kept as written.  The kernel computes the bias per tile
    from the positions, so no ``[H, T, S]`` bias exists; the slopes'
    gradient is the tile sums of ``dS * (j - query_coef * i + offset)``.
    """

    index: int
    shape: tuple[int, ...]
    query_coef: int
    offset: int = 0

    descriptors_doc = {"alibi": "ALiBi slopes `slope[h] * (j - i)` / `slope[h] * j`"}
    reason_words = "an ALiBi bias (per-head slopes times the key's distance)"
    reason_hint = "computes it per tile from the O(H) slopes"

    def extras_read(self):
        return (self.index,)

    def grad_extras(self):
        return (self.index,)

    def distance(self, at):
        """``j - query_coef * i + offset`` of the block, broadcastable (int)."""
        qi, kj = at.grid()
        return kj - self.query_coef * qi + self.offset

    def apply(self, s, extras, at):
        slope = extras[self.index].astype(s.dtype)
        return s + slope * self.distance(at).astype(s.dtype)

    def at_offset(self, d, t, s):
        # Global j - i is the local j' - i' - d (the query block starts d later);
        # j alone needs the key block's own start, which no static spec states.
        if not self.query_coef:
            return "an ALiBi bias on key positions alone depends on the device's position"
        return dataclasses.replace(self, offset=self.offset - d)

    def localized(self, shape4):
        return with_shape(self, shape4)
