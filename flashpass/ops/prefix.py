"""`Prefix`: a prefix-LM mask."""

from __future__ import annotations

import dataclasses

from .base import Positional


@dataclasses.dataclass(frozen=True)
class Prefix(Positional):
    """``s = where((j <= i) | (j < length), s, fill)``: a prefix-LM mask (the
    first ``length`` keys are seen by every query, the rest causally)."""

    length: int
    fill: float

    descriptors_doc = {"prefix": "prefix-LM (static prefix length)"}
    word = "prefix"
    reason_words = "a prefix-LM mask"

    def keep(self, qi, kj, extras, kv_len=None):
        return (kj <= qi) | (kj < self.length)

    def key_ranges(self, qi):
        return ((None, qi + 1), (None, self.length))
