"""`BlockCausal`: causal between blocks of positions, bidirectional within one."""

from __future__ import annotations

import dataclasses

from .base import Positional


@dataclasses.dataclass(frozen=True)
class BlockCausal(Positional):
    """``s = where(j // size <= i // size, s, fill)``: each query sees every
    key of its own block of ``size`` positions and of the blocks before it
    (block diffusion language models denoising a block at a time, frame-causal
    video models with a block per frame).  ``size >= 2`` (1 is `Causal`)."""

    size: int
    fill: float

    descriptors_doc = {"block_causal": "block-causal (causal between blocks of `size`)"}
    word = "block_causal"
    reason_words = "a block-causal mask"

    def key_ranges(self, qi):
        return ((None, (qi // self.size + 1) * self.size),)

    def row_keys(self):
        return "own"  # (its own block, so its own position, and every key before it)
