"""Stage 5, placement: where and how each planned site runs.

`place` (plan.py) gives each planned site a `Placement`, a closed union of
frozen types (types.py); `emit` (emit.py) looks up the rule of a placement's
type in `EMIT` and emits the site at its root while the program is rewritten
(stage 6).
"""

from .deferred import Decision, clear_decisions, decision_count, decisions
from .emit import EMIT, emit, kernel_output, rebind_shard_map
from .plan import RING_IN_TRAINING, place, trace_time_only
from .types import BodyRing, Deferred, Kept, Local, PerShard, Placed, Placement, Ring

__all__ = [
    "EMIT",
    "RING_IN_TRAINING",
    "BodyRing",
    "Decision",
    "Deferred",
    "Kept",
    "Local",
    "PerShard",
    "Placed",
    "Placement",
    "Ring",
    "clear_decisions",
    "decision_count",
    "decisions",
    "emit",
    "kernel_output",
    "place",
    "rebind_shard_map",
    "trace_time_only",
]
