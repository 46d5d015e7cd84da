"""`SinkWindow`: sink tokens plus a causal sliding window (StreamingLLM)."""

from __future__ import annotations

import dataclasses

from .base import Positional


@dataclasses.dataclass(frozen=True)
class SinkWindow(Positional):
    """``s = where((j < sinks) | ((j <= i) & (j > i - window)), s, fill)``:
    the first ``sinks`` keys are seen by every query, the others within a
    causal window of ``window`` keys (StreamingLLM's attention sinks as
    tokens; the `Sink` op is a logit instead).  ``sinks >= 1``, ``window >= 1``."""

    sinks: int
    window: int
    fill: float

    descriptors_doc = {"sink_window": "sink tokens + causal sliding window (StreamingLLM)"}
    word = "sink_window"
    reason_words = "sink tokens with a sliding window (a StreamingLLM mask)"

    def key_ranges(self, qi):
        return ((None, self.sinks), (qi - self.window + 1, qi + 1))

    def band(self, qi):
        return self.key_ranges(qi)[1]  # the window moves with the row; the sinks stay
