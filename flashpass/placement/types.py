"""Stage 5's result: where and how each planned site runs (a closed union).

* `Local`: where it stands, on the values it reads (an unsharded program, a
  site inside the user's ``shard_map`` body, or, at partitioning, arrays
  gathered whole: ``gathered`` says why);
* `PerShard`: inside a ``shard_map`` of its own over the mesh that shards its
  batch and head axes (`sharding.ShardPlan`);
* `Ring`: a sequence-sharded site, as a ring over the mesh axes that shard
  its sequences (`flashpass.ring`), each step run as ``steps`` says;
* `BodyRing`: a site inside the user's ``shard_map`` whose k and v are
  all-gathered there, as a ring over the gathers' manual axes;
* `QueryShards`: a site whose queries alone are sequence-sharded, its keys
  whole on every device: each device runs its query rows against every key,
  in a ``shard_map`` of its own (no communication);
* `Deferred`: a decision still pending: its operands live on a mesh with Auto
  axes and carry no sharding at trace time, so `decide` runs again when XLA's
  partitioner has chosen their shardings (`flashpass.placement.deferred`);
* `Kept`: kept as written, with the reason (``internal``: placing it raised).

Each type describes itself for the report and the partitioning log
(`kernel`, `ring_steps`, `note`, `how`, `kept`) and says which site it runs
(`runs`); `flashpass.placement.emit.EMIT` maps each type to the code that
emits it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..ring import cases as ring_cases
from ..select import PlannedSite
from ..sharding import ShardPlan
from ..site import AttentionSite

#: `Rewrite.placement` of a site XLA's partitioner places (`Deferred`).
PLACED_AT_PARTITIONING = "placed at partitioning"


@dataclasses.dataclass(frozen=True)
class Context:
    """What a decision reads besides the site and the shardings: ``check``
    (the `CheckContext` ring-step kernels are checked and probed in) and
    ``zigzag`` (balance causal rings where they can be)."""

    check: Any
    zigzag: bool = True


class _Described:
    """What a placement says of itself (defaults: the site's kernel, where it
    stands)."""

    #: The reason the site is kept as written ("" where it runs).
    kept = ""

    def kernel(self, planned: PlannedSite) -> str:
        """The kernel the report names."""
        return planned.kernel.name

    @property
    def ring_steps(self) -> str:
        """The kernels a ring's steps run ("" for no ring)."""
        return ""

    @property
    def note(self) -> str:
        """`Rewrite.placement`: "" where the placement is known at trace time."""
        return ""

    @property
    def how(self) -> str:
        """How the site runs, as the partitioning log says it (`Decision.how`)."""
        raise NotImplementedError(type(self).__name__)

    #: Why it runs so where XLA's shardings forced a gather (`Decision.reason`).
    why = ""

    def runs(self, planned: PlannedSite) -> PlannedSite:
        """The planned site as this placement runs it."""
        return planned


@dataclasses.dataclass(frozen=True)
class Local(_Described):
    """The site runs where it stands (``gathered``: at partitioning, on
    arrays XLA gathers whole, and why)."""

    gathered: str = ""

    @property
    def how(self) -> str:
        return "gathered" if self.gathered else "as is"

    @property
    def why(self) -> str:
        return self.gathered


@dataclasses.dataclass(frozen=True)
class PerShard(_Described):
    """The site runs per shard of its batch and head axes (``gathered``: at
    partitioning, after its sequences and head dims are gathered, and why)."""

    shard: ShardPlan
    gathered: str = ""

    @property
    def how(self) -> str:
        return "gathered, then per shard" if self.gathered else "per shard"

    @property
    def why(self) -> str:
        return self.gathered


@dataclasses.dataclass(frozen=True)
class Ring(_Described):
    """The site runs as a ring over ``shard.ring`` (its sequences' mesh axes):
    ``steps`` per step of the ring (`flashpass.ring.cases.plan_steps`), or
    load-balanced (``zigzag``: a `flashpass.ring.zigzag.Zigzag`, else None).
    ``shard.site`` is the site as the ring runs it (k and v read before the
    program's gathers; in a training step, its backward proven with them)."""

    shard: ShardPlan
    steps: tuple
    zigzag: Any = None

    def kernel(self, planned: PlannedSite) -> str:
        return "ring"

    @property
    def ring_steps(self) -> str:
        if self.zigzag is not None:
            return f"{self.zigzag.kernel.name}, zig-zag"  # every block the kernel's
        return ring_cases.describe(self.steps)

    @property
    def how(self) -> str:
        return f"ring over {'x'.join(self.shard.ring)} ({self.ring_steps})"

    def runs(self, planned: PlannedSite) -> PlannedSite:
        if planned.site.backward is None:
            return planned
        return dataclasses.replace(planned, site=self.shard.site)


@dataclasses.dataclass(frozen=True)
class BodyRing(_Described):
    """A site inside the user's ``shard_map`` whose k and v are all-gathered
    along the key axis over manual mesh axes (``lax.all_gather(k, axis,
    tiled=True)``): it runs as a ring over those axes where it stands (no
    ``shard_map`` of its own), reading k and v from before the gathers, which
    then go with the dead code.  ``site`` has the local key length."""

    site: AttentionSite
    ring: tuple  # the manual axis names
    size: int

    def kernel(self, planned: PlannedSite) -> str:
        return "ring"

    @property
    def ring_steps(self) -> str:
        return ring_cases.PLAIN  # plain JAX steps (the queries are local)

    @property
    def how(self) -> str:
        return f"ring over {'x'.join(self.ring)} ({self.ring_steps})"

    def runs(self, planned: PlannedSite) -> PlannedSite:
        if planned.site.backward is None:
            return planned
        return dataclasses.replace(planned, site=self.site)


@dataclasses.dataclass(frozen=True)
class QueryShards(_Described):
    """The site runs per shard of its query sequence (``shard.queries``, with
    any batch and head shards), every key on each device: shard ``i`` runs
    ``specs[i]``, the site's spec at its rows' offset (its position masks in
    local positions, `flashpass.ring.cases.local_ops`)."""

    shard: ShardPlan
    specs: tuple

    @property
    def how(self) -> str:
        return f"query rows per shard over {'x'.join(self.shard.queries)}"


@dataclasses.dataclass(frozen=True)
class Deferred(_Described):
    """A pending decision: `decide` with these ``kernels`` (in order, for a
    ring's steps) and ``context``, run again by the call's partition rule
    when XLA has chosen the shardings of the site's operands."""

    kernels: tuple
    context: Context

    @property
    def note(self) -> str:
        return PLACED_AT_PARTITIONING

    @property
    def how(self) -> str:
        return PLACED_AT_PARTITIONING


@dataclasses.dataclass(frozen=True)
class Kept(_Described):
    """The site is kept as written: ``reason`` says why (``internal``: an
    error of the pass while placing it)."""

    reason: str
    internal: bool = False

    @property
    def kept(self) -> str:
        return self.reason

    @property
    def how(self) -> str:
        return "kept as written"


Placement = Local | PerShard | Ring | BodyRing | QueryShards | Deferred | Kept


@dataclasses.dataclass(frozen=True, eq=False)
class Placed:
    """A planned site (as it runs: a ring in a training step reads k and v
    from before the program's gathers) and its placement."""

    planned: PlannedSite
    placement: Placement

    @property
    def site(self) -> AttentionSite:
        return self.planned.site
