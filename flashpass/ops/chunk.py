"""`Chunk`: chunked attention, each row sees its own chunk of keys."""

from __future__ import annotations

import dataclasses

from .base import Positional


@dataclasses.dataclass(frozen=True)
class Chunk(Positional):
    """``s = where(i // size == j // size, s, fill)``: chunked attention
    (Llama 4's local layers, together with a `Causal` op)."""

    size: int
    fill: float

    descriptors_doc = {"chunk": "chunked attention (chunk size)"}
    word = "chunk"
    reason_words = "a chunked-attention mask"

    def keep(self, qi, kj, extras, kv_len=None):
        return qi // self.size == kj // self.size

    def key_ranges(self, qi):
        start = qi // self.size * self.size
        return ((start, start + self.size),)
