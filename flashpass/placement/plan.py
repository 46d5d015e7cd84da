"""Stage 5: `place`, a pure function from planned sites to their placements.

For each site it reads the shardings of what the site reads (`sharding`):
per shard, as a ring, as a ring inside the user's ``shard_map``, where it
stands, deferred to XLA's partitioner (Auto axes, nothing stated), or kept
with the reason.  A differentiated ring reads k and v from
before the program's gathers, so its backward is proven again with those
reads; a ring's step kernels are chosen as a site's kernel is
(`select.choose`: checked and probed).  A site whose placement raises is
kept alone, with the error.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from flashpass.patterns.common import Miss

from .. import compat, errors, ring, sharding
from ..backward import match_backward
from ..ring import zigzag as zigzag_ring
from ..select import PlannedSite
from ..site import AttentionSite
from .types import BodyRing, Deferred, Kept, Local, PerShard, Placed, Ring

RING_IN_TRAINING = (
    "a sequence-sharded site would run as a ring attention, which reads k and v from "
    "before the program's gather; with its backward in the same program (a training step) "
    "that is not supported yet: the site is kept as written"
)


_TRACE_TIME_ONLY = contextvars.ContextVar("flashpass_trace_time_only", default=False)


@contextlib.contextmanager
def trace_time_only():
    """Within the block, every site is placed while the program is traced:
    none is `Deferred` to XLA's partitioner.  For programs that are serialized
    (``jax.export``; `flashpass.export` uses it): a deferred site's
    ``custom_partitioning`` keeps Python callbacks, which an export cannot
    carry.  Trace (or export) inside the block."""
    token = _TRACE_TIME_ONLY.set(True)
    try:
        yield
    finally:
        _TRACE_TIME_ONLY.reset(token)


def place(planned, scopes: dict, kernels, ctx, zigzag: bool = True) -> list[Placed]:
    """Every planned site with its placement.  ``scopes``: prefix -> scope;
    ``kernels``: the order to try for ring steps; ``zigzag``: balance causal
    rings where they can be (`flashpass.ring.zigzag`)."""
    out = []
    for p in planned:
        try:
            out.append(_place(p, scopes[p.site.scope_prefix], kernels, ctx, zigzag))
        except Exception as err:
            if errors.strict():
                raise
            out.append(Placed(p, Kept(errors.describe(err), internal=True)))
    return out


def _place(p: PlannedSite, scope, kernels, ctx, zigzag: bool) -> Placed:
    # (A Pallas kernel in interpret mode runs host callbacks, ordered effects
    # that a custom_partitioning body cannot carry: placed at trace time.)
    interpreted = p.interpret and not p.kernel.plain_jax
    if not interpreted and not _TRACE_TIME_ONLY.get() and _deferrable(p.site, p.kernel, scope):
        return Placed(p, Deferred(tuple(kernels), ctx, zigzag))
    found = _sharded(p, scope)
    if found is None:
        return Placed(p, Local())
    if isinstance(found, str):
        return Placed(p, Kept(found))
    if found.ring is None:
        return Placed(p, PerShard(found))
    site = p.site
    if site.backward is not None:
        site = _ring_backward(site, found.site, scope)
        if site is None and isinstance(found, BodyRing):
            return Placed(p, Local())  # the kernel on the gathered k/v, as written
        if site is None:
            return Placed(p, Kept(RING_IN_TRAINING))
        p = dataclasses.replace(p, site=site)
        found = dataclasses.replace(found, site=site)
    if isinstance(found, BodyRing):
        return Placed(p, found)
    local = sharding.localize(found.site, found.counts())
    n = found.ring_size()
    steps = ring.plan(local.spec, n, True, kernels, ctx)
    balanced = zigzag_ring.plan(local.spec, n, True, kernels, ctx) if zigzag else None
    return Placed(p, Ring(found, steps, balanced))


def _deferrable(site: AttentionSite, kernel, scope) -> bool:
    """Whether the site's placement waits for XLA's partitioner (`Deferred`):
    its operands live on a mesh of several devices whose axes of more than
    one device are all Auto (none Manual: not inside a ``shard_map`` body;
    none Explicit: those shardings are in the types), and the program states
    no sharding of them (no ``sharding_constraint`` on q/k/v, no sharded
    type).  A single-device program never qualifies."""
    meshes = set()
    for _, atom, _ in sharding.operands(site):
        found = compat.named_sharding_of(scope.aval(atom))
        if found is not None:
            if any(found.spec):
                return False
            meshes.add(found.mesh)
    context = compat.context_mesh()
    if not context.empty and context.size > 1:
        meshes.add(context)
    if len(meshes) != 1:
        return False
    kinds = compat.axis_kinds(meshes.pop())
    if kinds["manual"] or kinds["explicit"] or not kinds["auto"]:
        return False
    hinted = sharding.analyze(site, kernel, scope.aval, sharding.constrained(scope), ring_only=True)
    return hinted is None and not _has_constraint(site, scope)


def _has_constraint(site: AttentionSite, scope) -> bool:
    """Whether a ``sharding_constraint`` produces one of the site's operands."""
    for _, atom, _ in sharding.operands(site):
        node = scope.producer(atom)
        if node is not None and node.prim == "sharding_constraint":
            return True
    return False


def _sharded(p: PlannedSite, scope):
    """How the site's operands are sharded: a `sharding.ShardPlan`, a
    `BodyRing`, None (unsharded) or the reason to keep it.

    Auto mesh axes keep shardings out of the types; a ``sharding_constraint``
    on q/k/v in the program is read instead, only to find a sequence-sharded
    site to run as a ring (otherwise XLA partitions the kernel)."""
    site = sharding.before_gather(p.site, scope)
    result = sharding.analyze(site, p.kernel, scope.aval)
    if result is None or (isinstance(result, sharding.ShardPlan) and result.ring is None):
        constrained = sharding.constrained(scope)
        hinted = sharding.analyze(site, p.kernel, scope.aval, constrained, ring_only=True)
        if isinstance(hinted, sharding.ShardPlan):
            result = hinted
    if result is None:
        result = _body_ring(p.site, scope)
    return result


def _ring_backward(site: AttentionSite, ring_site: AttentionSite, scope):
    """A differentiated site that runs as a ring reads k and v from before the
    program's gather (`sharding.before_gather`, or the all-gathers in the
    user's ``shard_map``, `BodyRing`): prove its backward again with those
    reads, the gathers joining the forward (and their transposes the
    backward).  The site as the ring runs it, or None."""
    if ring_site is None or ring_site is site:
        return site
    forward = site.nodes - site.backward.nodes
    ring_site = dataclasses.replace(ring_site, nodes=forward, backward=None)
    backward = match_backward(scope, ring_site)
    if isinstance(backward, Miss):
        return None
    return dataclasses.replace(ring_site, nodes=forward | backward.nodes, backward=backward)


def _body_ring(site: AttentionSite, scope) -> BodyRing | None:
    """The `BodyRing` of a site whose k and v are both all-gathered, tiled
    along their key axis, over the same manual axes; else None (the kernel
    then runs on the gathered k and v, as written).  A differentiated site's
    backward is proven again from the local k and v (`_ring_backward`)."""
    if ring.unsupported(site.spec) is not None or site.spec.dropout is not None:
        return None  # (dropout: the body's keep-mask is drawn at its local positions)
    gathers = []
    for operand in (site.k, site.v):
        node = scope.producer(operand.atom)
        if node is None or node.prim != "all_gather":
            return None
        params = node.params
        if (
            not params.get("tiled")
            or params.get("axis_index_groups") is not None
            or params.get("all_gather_dimension") != operand.axes["S"]
        ):
            return None
        gathers.append(node)
    names = {_axis_tuple(node.params["axis_name"]) for node in gathers}
    sizes = {node.params["axis_size"] for node in gathers}
    if len(names) != 1 or len(sizes) != 1:
        return None
    if site.backward is not None and len(next(iter(names))) != 1:
        return None  # its backward template binds one manual axis (`backward`)
    q_node = scope.producer(site.q.atom)
    if q_node is not None and q_node.prim == "all_gather":
        return None  # queries gathered too: every device computes every row
    n = sizes.pop()
    if n <= 1 or site.layout.sizes["S"] % n:
        return None

    def local(operand, node):
        shape = list(operand.shape)
        shape[operand.axes["S"]] //= n
        return dataclasses.replace(operand, atom=scope.resolve(node.ins[0]), shape=tuple(shape))

    site = dataclasses.replace(site, k=local(site.k, gathers[0]), v=local(site.v, gathers[1]))
    return BodyRing(sharding.localize(site, {"S": n}), names.pop(), n)


def _axis_tuple(name) -> tuple:
    return tuple(name) if isinstance(name, tuple | list) else (name,)
