"""`Window`: a local (sliding) window around the diagonal."""

from __future__ import annotations

import dataclasses

from .base import EXCLUDED, Positional


@dataclasses.dataclass(frozen=True)
class Window(Positional):
    """``s = where(i - left <= j <= i + right, s, fill)``: a local (sliding)
    window; ``right=None`` leaves it unbounded on the right (in practice
    together with a `Causal` op).  A causal window has ``right == 0``.

    Like `Causal`, these structured ops (`STRUCTURED`) are only emitted when
    the fill still excludes keys after the later ops; the position ones also
    only when every query row keeps a key.
    """

    left: int
    right: int | None
    fill: float

    descriptors_doc = {"window": "local window `(left, right)`"}
    word = "window"
    reason_words = "a local window (sliding-window mask)"

    def keep(self, qi, kj, extras, kv_len=None):
        keep = kj >= qi - self.left
        return keep if self.right is None else keep & (kj <= qi + self.right)

    def row_keys(self):
        own = self.left >= 0 and (self.right is None or self.right >= 0)
        return "some" if own else "not own"

    def key_ranges(self, qi):
        return ((qi - self.left, None if self.right is None else qi + self.right + 1),)

    def at_offset(self, d, t, s):
        upper = None if self.right is None else d + self.right
        lower = d - self.left  # keys c >= r + lower
        if (upper is not None and upper < -(t - 1)) or lower > s - 1:
            return EXCLUDED
        if upper is not None and upper >= s - 1:
            upper = None
        if lower > 0 or (upper is not None and upper < 0):
            return "a window edge off the diagonal's side"
        if lower > -(t - 1) or upper is not None:
            return Window(-lower, upper, self.fill)
        return None
