"""Stage 5, placement: where and how each planned site runs.

`decide` (plan.py) is the one decision: a `Placement`, a closed union of
frozen types (types.py) that describe themselves for the report, from a site
and what is known of its operands' shardings.  `place` makes it for every
planned site at trace time; a `Deferred` placement is a decision still
pending, which the site's ``custom_partitioning`` call finishes with the
same `decide` when XLA has chosen the shardings (deferred.py).  `emit`
(emit.py) looks up the rule of a placement's type in `EMIT` and emits the
site at its root while the program is rewritten (stage 6).
"""

from .deferred import Decision, clear_decisions, decision_count, decisions
from .emit import EMIT, emit, kernel_output, rebind_shard_map
from .plan import RING_IN_TRAINING, InProgram, decide, place, trace_time_only
from .types import (
    PLACED_AT_PARTITIONING,
    BodyRing,
    Context,
    Deferred,
    Kept,
    Local,
    PerShard,
    Placed,
    Placement,
    Ring,
)

__all__ = [
    "EMIT",
    "PLACED_AT_PARTITIONING",
    "RING_IN_TRAINING",
    "BodyRing",
    "Context",
    "Decision",
    "Deferred",
    "InProgram",
    "Kept",
    "Local",
    "PerShard",
    "Placed",
    "Placement",
    "Ring",
    "clear_decisions",
    "decide",
    "decision_count",
    "decisions",
    "emit",
    "kernel_output",
    "place",
    "rebind_shard_map",
    "trace_time_only",
]
