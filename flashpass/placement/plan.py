"""Stage 5: one decision per site (`decide`), and `place`, which makes it for
every planned site at trace time.

`decide(planned, shardings, kernels, context)` is a pure function of the
site, what is known of its operands' shardings, the kernel order for a ring's
steps and the context.  It is the only decider, and it runs on one of two
readers of the shardings:

* `InProgram` (here, at trace time): the shardings the program states: the
  operands' types, ``sharding_constraint``s on q/k/v under Auto axes, the
  program's gathers of k and v (read from before them: a ring), and the
  all-gathers of the user's ``shard_map`` body (`BodyRing`);
* `deferred.Chosen` (at partitioning): the shardings XLA's partitioner chose,
  for a site whose decision `InProgram` left pending (`Deferred`: Auto axes,
  nothing stated).

So a site is placed per shard, as a ring, as a ring inside the user's
``shard_map``, by query rows (its queries alone sequence-sharded: at trace
time only, since a partition runs no per-shard offsets), where it stands,
deferred, or kept with the reason.  A
differentiated ring reads k and v from before the program's gathers, with
the backward that matching proved for those reads (`AttentionSite.ungathered`,
stage 3); a ring's step kernels are chosen as a site's kernel is
(`select.choose`: checked and probed).  A site whose
placement raises is kept alone, with the error.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from .. import compat, errors, ring, sharding
from ..ops import EXCLUDED, step_shape
from ..ring import cases as ring_cases
from ..ring import zigzag as zigzag_ring
from ..select import PlannedSite
from ..site import AttentionSite
from ..spec import ExtraSpec
from .types import (
    BodyRing,
    Context,
    Deferred,
    Kept,
    Local,
    PerShard,
    Placed,
    Placement,
    QueryShards,
    Ring,
)

RING_IN_TRAINING = (
    "a sequence-sharded site would run as a ring attention, which reads k and v from "
    "before the program's gather; with its backward in the same program (a training step) "
    "that is not supported yet: the site is kept as written"
)


#: `InProgram.read`'s answer where the decision waits for XLA's partitioner.
PENDING = "pending"

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
    context = Context(ctx, zigzag)
    out = []
    for p in planned:
        try:
            placement = decide(p, InProgram(scopes[p.site.scope_prefix]), kernels, context)
            out.append(Placed(placement.runs(p), placement))
        except Exception as err:
            if errors.strict():
                raise
            out.append(Placed(p, Kept(errors.describe(err), internal=True)))
    return out


def decide(planned: PlannedSite, shardings, kernels, context: Context) -> Placement:
    """Where and how ``planned`` runs, given what ``shardings`` (`InProgram`
    or `deferred.Chosen`) knows of its operands: a `Placement`."""
    found = shardings.read(planned)
    if found is PENDING:
        return Deferred(tuple(kernels), context)
    gathered = ""
    if shardings.at_partitioning and getattr(found, "queries", None) is not None:
        found = found.query_reason()  # gathered below: a partition runs no row offsets
    if isinstance(found, str) and shardings.at_partitioning:
        # The call must run on what XLA chose: gather to the nearest sharding
        # the kernel runs on (batch and heads kept, sequences and head dims
        # whole), or whole arrays.
        gathered, found = found, shardings.without_sequences().read(planned)
        if isinstance(found, str) or (found is not None and found.ring is not None):
            found = None
    if found is None:
        return Local(gathered)
    if isinstance(found, str):
        return Kept(found)
    if getattr(found, "queries", None) is not None:
        return _query_shards(planned, found, context)
    if isinstance(found, sharding.ShardPlan) and found.ring is None:
        return PerShard(found, gathered)
    if planned.site.backward is not None:
        proven = _trained_ring(planned.site, found.site)
        if proven is None and isinstance(found, BodyRing):
            return Local()  # the kernel on the gathered k/v, as written
        if proven is None:
            return Kept(RING_IN_TRAINING)
        found = dataclasses.replace(found, site=proven)
    if isinstance(found, BodyRing):
        return found
    local = sharding.localize(found.site, found.counts())
    n, check = found.ring_size(), context.check
    steps = ring.plan(local.spec, n, True, kernels, check)
    balanced = zigzag_ring.plan(local.spec, n, True, kernels, check) if context.zigzag else None
    return Ring(found, steps, balanced)


def _query_shards(planned: PlannedSite, found, context: Context) -> Placement:
    """`QueryShards`: shard ``i``'s spec is the site's at its rows' offset
    ``i * t`` from the keys (every key on each device), which the site's
    kernel must accept; else the site is kept, saying why."""
    local = sharding.localize(found.site or planned.site, found.counts())
    spec, axes = local.spec, "x".join(found.queries)
    t, s = spec.q_len, spec.kv_len
    where = f"sequence-sharded queries over mesh axis {axes} (keys whole)"
    problem = ring.unsupported(spec)
    if problem is not None:
        return Kept(f"{where}: {problem}; kept as written")
    extras = tuple(
        ExtraSpec(step_shape(e.shape, t, s), e.dtype) if len(e.shape) == 4 else e
        for e in spec.extras
    )
    specs = []
    for i in range(planned.site.layout.sizes["T"] // t):
        ops = ring_cases.local_ops(spec, i * t)
        if ops is EXCLUDED or isinstance(ops, str):
            why = ops if isinstance(ops, str) else "the masks exclude every key of its rows"
            return Kept(f"{where}: shard {i}: {why}; kept as written")
        shard_spec = spec.with_ops(ops, extras=extras)
        reasons = planned.kernel.check(shard_spec, context.check) if context.check else []
        if reasons:
            return Kept(f"{where}: {planned.kernel.name} on shard {i}: {'; '.join(reasons)}")
        specs.append(shard_spec)
    return QueryShards(found, tuple(specs))


def _trained_ring(site: AttentionSite, ring_site: AttentionSite) -> AttentionSite | None:
    """A differentiated site as a ring runs it: ``ring_site`` (k and v read
    from before the program's gathers, `sharding.before_gather`, or from
    before the all-gathers of the user's ``shard_map``, `BodyRing`) with the
    backward matching proved for those reads (`AttentionSite.ungathered`:
    the gathers join the forward, their transposes the backward); None where
    none was proven for them."""
    if ring_site is None or ring_site is site:
        return site
    proven = site.ungathered
    if proven is None or any(
        sharding.find([getattr(proven, n).atom], getattr(ring_site, n).atom) is None
        for n in ("k", "v")
    ):
        return None
    return dataclasses.replace(ring_site, nodes=proven.nodes, backward=proven.backward)


@dataclasses.dataclass(frozen=True)
class InProgram:
    """The shardings a site's operands have at trace time, as the program
    (``scope``) states them."""

    scope: object

    #: The decision may keep a site as written (at partitioning it may not).
    at_partitioning = False

    def read(self, planned: PlannedSite):
        """How the site's operands are sharded: `PENDING`, a
        `sharding.ShardPlan`, a `BodyRing`, None (unsharded) or the reason
        to keep it.

        Auto mesh axes keep shardings out of the types; a ``sharding_constraint``
        on q/k/v in the program is read instead, only to find a sequence-sharded
        site to run as a ring (otherwise XLA partitions the kernel)."""
        if self._pending(planned):
            return PENDING
        scope = self.scope
        result = sharding.stated(planned.site, scope, planned.kernel)
        if result is None:
            result = _body_ring(planned.site, scope)
        return result

    def _pending(self, planned: PlannedSite) -> bool:
        """Whether the decision waits for XLA's partitioner (`Deferred`): its
        operands live on a mesh of several devices whose axes of more than
        one device are all Auto (none Manual: not inside a ``shard_map`` body;
        none Explicit: those shardings are in the types), and the program
        states no sharding of them (no ``sharding_constraint`` on q/k/v, no
        sharded type).  A single-device program never qualifies, nor does a
        Pallas kernel in interpret mode (its host callbacks are ordered
        effects, which a ``custom_partitioning`` body cannot carry), nor a
        program traced in `trace_time_only`."""
        if (planned.interpret and not planned.kernel.plain_jax) or _TRACE_TIME_ONLY.get():
            return False
        meshes = set()
        for _, atom, _ in sharding.operands(planned.site):
            found = compat.named_sharding_of(self.scope.aval(atom))
            if found is not None:
                if any(found.spec):
                    return False
                meshes.add(found.mesh)
            node = self.scope.producer(atom)
            if node is not None and node.prim == "sharding_constraint":
                return False
        context = compat.context_mesh()
        if not context.empty and context.size > 1:
            meshes.add(context)
        if len(meshes) != 1:
            return False
        kinds = compat.axis_kinds(meshes.pop())
        return not (kinds["manual"] or kinds["explicit"] or not kinds["auto"])


def _body_ring(site: AttentionSite, scope) -> BodyRing | None:
    """The `BodyRing` of a site whose k and v are both all-gathered, tiled
    along their key axis, over the same manual axes; else None (the kernel
    then runs on the gathered k and v, as written).  A differentiated site's
    backward is the one matching proved from the local k and v (`_trained_ring`)."""
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
