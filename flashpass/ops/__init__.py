"""Score ops, one module per kind, each carrying its own semantics (`base`).

`KINDS` lists every kind in the order reports and docs name them; the
consumers (the reference, blockwise bounds, ring steps, reports, adapters'
reasons) loop over a spec's ops and ask each through the `base` protocol.
A new mask kind is one module here, added to `KINDS`.
"""

from __future__ import annotations

from .alibi import Alibi
from .band_select import BandSelect
from .base import EXCLUDED, KeepOp, Positional, Positions, ScoreOp, apply_score_ops
from .bias_mask import Bias, Mask, step_shape
from .block_causal import BlockCausal
from .causal import Causal
from .chunk import Chunk
from .dropout import Dropout
from .empty_rows import EmptyRows
from .kv_lengths import KvLengths, valid_lengths
from .outer_mask import OuterMask
from .position_mask import PositionMask
from .prefix import Prefix
from .prefix_lengths import PrefixLengths
from .scale import Scale, Softcap
from .segments import Segments
from .sink import Sink
from .sink_window import SinkWindow
from .window import Window

#: Every score-op kind, in the order reports name their words and docs their
#: descriptors.
KINDS = (Scale, Bias, Causal, Window, Chunk, Prefix, Segments, KvLengths, Sink, Mask)
KINDS += (Softcap, Dropout, SinkWindow, PrefixLengths, PositionMask, Alibi, BandSelect)
KINDS += (EmptyRows, BlockCausal, OuterMask)

#: Score ops that exclude keys by position or segment id, so kernels may skip
#: whole blocks (`Causal` is one of them).
STRUCTURED = tuple(kind for kind in KINDS if kind.structured)

#: What a spec may use beyond plain scaled attention (`AttentionSpec.descriptors`),
#: with the words docs/kernels.md shows.  Kernels declare the ones they accept
#: (`Kernel.descriptors`).
DESCRIPTORS: dict[str, str] = {}
for _kind in (Causal, Mask, Bias, Softcap):
    DESCRIPTORS.update(_kind.descriptors_doc)
DESCRIPTORS["gqa"] = "GQA / MQA (fewer K/V heads)"
for _kind in KINDS:
    DESCRIPTORS.update(_kind.descriptors_doc)

__all__ = [
    "DESCRIPTORS",
    "Alibi",
    "BandSelect",
    "BlockCausal",
    "EXCLUDED",
    "KINDS",
    "STRUCTURED",
    "Bias",
    "Causal",
    "Chunk",
    "Dropout",
    "EmptyRows",
    "KeepOp",
    "KvLengths",
    "Mask",
    "OuterMask",
    "Positional",
    "PositionMask",
    "Positions",
    "Prefix",
    "PrefixLengths",
    "Scale",
    "ScoreOp",
    "Segments",
    "Sink",
    "SinkWindow",
    "Softcap",
    "Window",
    "apply_score_ops",
    "step_shape",
    "valid_lengths",
]
