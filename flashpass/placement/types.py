"""Stage 5's result: where and how each planned site runs (a closed union).

* `Local`: where it stands, on the values it reads (an unsharded program, or
  a site inside the user's ``shard_map`` body);
* `PerShard`: inside a ``shard_map`` of its own over the mesh that shards its
  batch and head axes (`sharding.ShardPlan`);
* `Ring`: a sequence-sharded site, as a ring over the mesh axes that shard
  its sequences (`flashpass.ring`), each step run as ``steps`` says;
* `BodyRing`: a site inside the user's ``shard_map`` whose k and v are
  all-gathered there, as a ring over the gathers' manual axes;
* `Deferred`: its operands live on a mesh with Auto axes and carry no
  sharding at trace time: XLA's partitioner decides (per shard, a ring, or
  gathered), when it has chosen their shardings (`flashpass.placement.deferred`);
* `Kept`: kept as written, with the reason (``internal``: placing it raised).

`flashpass.placement.emit.EMIT` maps each type to the code that emits it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..select import PlannedSite
from ..sharding import ShardPlan
from ..site import AttentionSite


@dataclasses.dataclass(frozen=True)
class Local:
    """The site runs where it stands."""


@dataclasses.dataclass(frozen=True)
class PerShard:
    """The site runs per shard of its batch and head axes."""

    shard: ShardPlan


@dataclasses.dataclass(frozen=True)
class Ring:
    """The site runs as a ring over ``shard.ring`` (its sequences' mesh axes):
    ``steps`` per step of the ring (`flashpass.ring.cases.plan_steps`), or
    load-balanced (``zigzag``: a `flashpass.ring.zigzag.Zigzag`, else None)."""

    shard: ShardPlan
    steps: tuple
    zigzag: Any = None


@dataclasses.dataclass(frozen=True)
class BodyRing:
    """A site inside the user's ``shard_map`` whose k and v are all-gathered
    along the key axis over manual mesh axes (``lax.all_gather(k, axis,
    tiled=True)``): it runs as a ring over those axes where it stands (no
    ``shard_map`` of its own), reading k and v from before the gathers, which
    then go with the dead code.  ``site`` has the local key length."""

    site: AttentionSite
    ring: tuple  # the manual axis names
    size: int


@dataclasses.dataclass(frozen=True)
class Deferred:
    """The site's placement is decided at partitioning time, by the shardings
    XLA chose for its operands: ``kernels`` (in order) and ``ctx`` choose a
    ring's step kernels there (``zigzag``: balance causal rings)."""

    kernels: tuple
    ctx: Any
    zigzag: bool = True


@dataclasses.dataclass(frozen=True)
class Kept:
    """The site is kept as written: ``reason`` says why (``internal``: an
    error of the pass while placing it)."""

    reason: str
    internal: bool = False


Placement = Local | PerShard | Ring | BodyRing | Deferred | Kept


@dataclasses.dataclass(frozen=True, eq=False)
class Placed:
    """A planned site (as it runs: a ring in a training step reads k and v
    from before the program's gathers) and its placement."""

    planned: PlannedSite
    placement: Placement

    @property
    def site(self) -> AttentionSite:
        return self.planned.site
