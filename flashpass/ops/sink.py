"""`Sink`: attention sinks, a per-row logit in the softmax's normaliser."""

from __future__ import annotations

import dataclasses

from .base import ScoreOp


@dataclasses.dataclass(frozen=True)
class Sink(ScoreOp):
    """Attention sinks: one extra logit per row joins the softmax's normaliser
    but has no value (gpt-oss, StreamingLLM)::

        p = softmax(concat([s, sink], axis=-1))[..., :S]

    ``sink = extras[index]``, 4-D ``[B|1, H|1, T|1, 1]`` (usually one learned
    logit per head), in the scores' dtype.  Not a score op: the spec's
    normaliser (``spec.sink``), it only enters the softmax.  Rows whose every
    key is excluded put all their weight on the sink: their output is zero,
    not the mean of ``v``.
    """

    index: int
    shape: tuple[int, ...]

    uniform = True
    keeps_first_key = True
    stage = "normaliser"
    descriptors_doc = {"sinks": "attention sinks (a per-row logit in the softmax)"}
    word = "sinks"

    def extras_read(self):
        return (self.index,)

    def at_offset(self, d, t, s):
        return None  # the ring's statistics start from the sink logit, once
