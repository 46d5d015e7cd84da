"""`PrefixLengths`: a prefix-LM mask whose prefix length is data (per example)."""

from __future__ import annotations

import dataclasses

from .base import KeepOp
from .kv_lengths import valid_lengths


@dataclasses.dataclass(frozen=True)
class PrefixLengths(KeepOp):
    """``s = where((j <= i) | (j < L + shift), s, fill)``, ``L = extras[index]``.

    A prefix-LM over a batch whose prefixes differ: ``L`` is the program's
    integer array of prefix lengths, 4-D ``[B|1, H|1, T|1, 1]`` (never varying
    over keys), so O(B) where a `Prefix` holds one static length.  ``shift``
    absorbs the spelling as in `KvLengths` (``j <= L`` is shift 1).  Every row
    keeps its own key, so no row is fully masked.
    """

    index: int
    shape: tuple[int, ...]
    fill: float
    shift: int = 0

    descriptors_doc = {"prefix_lengths": "prefix-LM with per-example prefix lengths (data)"}
    word = "prefix_lengths"
    reason_words = "a prefix-LM mask with per-example prefix lengths"

    def extras_read(self):
        return (self.index,)

    def keep(self, qi, kj, extras, kv_len=None):
        lengths = extras[self.index]
        n = lengths + self.shift if kv_len is None else valid_lengths(self, lengths, kv_len)
        return (kj <= qi) | (kj < n)

    def at_offset(self, d, t, s):
        return "prefix-LM masks with per-example lengths depend on the device's position"
