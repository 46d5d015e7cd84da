"""Sharded programs: how a site's operands are sharded (read by stage 5).

Under ``jax.jit`` with `NamedSharding` operands, XLA's SPMD partitioner
splits ordinary JAX code (the ``blockwise`` kernel included) but not a Pallas
kernel, which is a custom call: it runs it replicated, gathering q/k/v onto
every device.  So each site of a sharded program is rewritten to::

    shard_map(site, mesh, in_specs=<the operands' specs>, out_specs=<the output's>)

where ``site`` is the layout transform, the ``flashpass_<kernel>`` call and
the inverse transform, on per-shard shapes (`localize`).  The mesh axes are
those that shard the batch and head axes of q/k/v (and of the bias/mask
arrays, broadcast axes aside); each device computes attention for its own
batch elements and heads, so no collective is added and the output keeps the
sharding the original computes.

The shardings are read at trace time from the operands' types
(``jax.typeof(x).sharding``).  Only *Explicit* mesh axes (``jax.make_mesh``'s
default in JAX 0.10) are in types; for *Auto* axes the partition specs are
chosen by XLA after tracing, so:

* a site whose program states no sharding of its operands is placed at
  partitioning time, by the shardings XLA chose (`flashpass.placement.deferred`
  runs the same decision, `flashpass.placement.decide`, on them);
* where the program does state one (a ``sharding_constraint`` on q/k/v), a
  kernel XLA can partition (`Kernel.partitionable`: plain JAX, or cuDNN's own
  ``custom_partitioning``) runs as is and XLA splits it, and any other kernel
  is not used: the site is kept as written, with the reason in the report.

A site whose query and key sequence axes are sharded alike (sequence
parallelism) runs as a ring (`flashpass.ring`; `analyze` names its mesh
axes).  A site whose queries alone are sequence-sharded, its keys whole on
every device, runs each device's query rows against all the keys
(`ShardPlan.queries`; no communication).  A site is kept as written, with its
reason, when its keys alone are sequence-sharded, when the ring does not
support its score ops, when its head dim is sharded, or when its operands
shard one axis over different mesh axes or unevenly.

`analyze` is this module's answer; `flashpass.placement.decide` turns it into
a placement, and `flashpass.placement.emit` emits it (the ``shard_map``, the
ring, and sites inside a user's ``shard_map`` body).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from . import compat, ring
from .graph import Const
from .roles import Merged
from .site import AttentionSite, Layout
from .terms import Unsplit

_SEQUENCE = {"T": "query", "S": "key"}


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How one site runs per shard.

    ``atoms`` are the values the site reads (q, k, v, bias/mask arrays, scale
    scalars), passed to ``shard_map`` in this order with ``in_specs``;
    ``axes`` maps each sharded role to its mesh axes.
    """

    mesh: Any
    axes: dict  # role -> tuple of mesh axis names
    atoms: tuple
    in_specs: tuple
    out_spec: PartitionSpec
    root_spec: PartitionSpec | None  # the original output's spec, when it differs
    ring: tuple | None = None  # mesh axes of a sharded sequence: run as a ring (flashpass.ring)
    site: AttentionSite | None = None  # the site as planned (k/v read before a gather)
    #: Mesh axes of the query sequence where it alone is sharded (the keys whole).
    queries: tuple | None = None

    def query_reason(self) -> str:
        """Why no kernel call per shard runs a site whose queries alone are
        sequence-sharded where the decision may not place it so (the words
        `analyze` used before such sites had a placement)."""
        return (
            f"sequence-sharded: q's query sequence axis is sharded over mesh axis "
            f"{'x'.join(self.queries)}, the other sequence axis is not sharded"
        )

    def ring_size(self) -> int:
        """Devices along the ring's mesh axes."""
        return math.prod(self.mesh.shape[a] for a in self.ring)

    def sharded_index(self, local: AttentionSite):
        """How a ring's local batch and head indices map to global ones
        (`ring.ShardedIndex`), or None when batch and heads are whole."""
        b, h, _ = local.layout.groups
        counts = self.counts()
        if not any(r in self.axes for r in (*b, *h)):
            return None

        def digits(roles):
            return tuple(
                (local.layout.sizes[r], tuple(self.axes.get(r, ())), counts.get(r, 1))
                for r in roles
            )

        return ring.ShardedIndex(digits(b), digits(h))

    @property
    def axis_names(self) -> frozenset:
        return frozenset(a for names in self.axes.values() for a in names)

    def counts(self) -> dict:
        """Role -> number of shards."""
        return {r: math.prod(self.mesh.shape[a] for a in names) for r, names in self.axes.items()}


def constrained(scope):
    """``sharding_of(atom)``: the type's sharding, else that of a
    ``sharding_constraint`` producing the value (how Auto-axes code says it)."""

    def sharding_of(atom):
        found = compat.named_sharding_of(scope.aval(atom))
        if found is not None and any(found.spec):  # Auto axes type an empty spec
            return found
        node = scope.producer(atom)
        if node is not None and node.prim == "sharding_constraint":
            constraint = node.params.get("sharding")
            if isinstance(constraint, NamedSharding) and constraint.mesh.size > 1:
                return constraint
        return None

    return sharding_of


def stated(site: AttentionSite, scope, kernel) -> ShardPlan | str | None:
    """What the program (``scope``) states of how ``site`` runs on its
    operands' mesh at trace time, for ``kernel``: `analyze` of their types,
    k and v read from before the program's gathers (`before_gather`), or,
    where that finds no ring, of the ``sharding_constraint``s on q/k/v
    (`constrained`: how Auto-axes code says it, read only to find a ring).
    A `ShardPlan`, None (unsharded) or the reason to keep the site."""
    site = before_gather(site, scope)
    result = mesh_of(site, lambda atom: compat.named_sharding_of(scope.aval(atom)))
    if result is not None and not isinstance(result, str):
        # (On Auto axes the types state nothing; XLA partitions a kernel it can.)
        reason = auto_axes_reason(result, kernel)
        result = reason if reason is not None else analyze(site, scope.aval)
    if result is None or (isinstance(result, ShardPlan) and result.ring is None):
        hinted = analyze(site, scope.aval, constrained(scope))
        if isinstance(hinted, ShardPlan) and hinted.ring is not None:
            result = hinted
    return result


def before_gather(site: AttentionSite, scope) -> AttentionSite:
    """With Explicit mesh axes, code attending a sequence-sharded q to k/v
    must gather k and v itself (``jax.sharding.reshard(k, P())``): read them
    from before that gather, so the site sees them sequence-sharded like q and
    runs as a ring; the gathers, then unused, are removed with the dead code."""
    q_sharding = compat.named_sharding_of(scope.aval(site.q.atom))
    if q_sharding is None:
        return site
    q_axes = entries(q_sharding.spec, len(site.q.shape))
    if not q_axes[site.q.axes["T"]]:
        return site
    replaced = {}
    for name in ("k", "v"):
        operand = getattr(site, name)
        node = scope.producer(operand.atom)
        if node is None or node.prim != "reshard":
            continue
        source = node.ins[0]
        src = compat.named_sharding_of(scope.aval(source))
        if src is None or not entries(src.spec, len(operand.shape))[operand.axes["S"]]:
            continue
        replaced[name] = dataclasses.replace(operand, atom=scope.resolve(source))
    return dataclasses.replace(site, **replaced) if replaced else site


def analyze(site: AttentionSite, aval_of, sharding_of=None) -> ShardPlan | str | None:
    """How ``site`` runs on its operands' mesh: a `ShardPlan`, None (unsharded:
    as is), or the reason it must be kept as written.  ``aval_of(atom)`` gives
    the abstract value of an operand; ``sharding_of(atom)`` its sharding
    (default: the one in its type; at partitioning, the one XLA chose)."""
    read = operands(site)
    if sharding_of is None:

        def sharding_of(atom):
            return compat.named_sharding_of(aval_of(atom))

    shardings = [sharding_of(atom) for _, atom, _ in read]
    mesh = _mesh(shardings)
    if mesh is None or isinstance(mesh, str):
        return mesh

    axes: dict = {}
    specs: list = []
    for (name, atom, roles), sharding in zip(read, shardings, strict=True):
        ndim = len(aval_of(atom).shape)
        by_dim = entries(sharding.spec if sharding is not None else (), ndim)
        for role, axis in roles.items():
            names = by_dim[axis]
            if not names:
                continue
            if isinstance(role, Merged):
                return (
                    f"{name} is sharded along an axis merged from several head axes ({role}) "
                    "over mesh axis " + "x".join(names) + "; kept as written"
                )
            if role in ("D", "Dv"):
                return (
                    f"{name}'s head dim is sharded over mesh axis {'x'.join(names)}; a kernel "
                    "needs whole heads on each device, so the attention is kept as written"
                )
            previous = axes.setdefault(role, names)
            if previous != names:
                return (
                    f"the operands shard the {_role_name(site.layout, role)} axis differently "
                    f"({'x'.join(previous)} and {'x'.join(names)}); kept as written"
                )
        specs.append((atom, roles, ndim))
    if not axes:
        return None
    whole = [e.transform for e in site.extras if getattr(e.transform, "reads_whole", False)]
    if whole:
        # Each such transform may say why in its own words (`terms.Padded`).
        return getattr(
            whole[0],
            "sharded_reason",
            "a mask is computed from a causal pattern and key-side data whole (not per "
            "shard) and the operands are sharded; kept as written",
        )
    if any(isinstance(e.transform, Unsplit) for e in site.extras):
        return (
            "a bias is added to the scores while their axes are split into factors (it is "
            "built from its terms whole, not per shard) and the operands are sharded; kept "
            "as written"
        )
    output = ("the output", None, {r: i for i, r in enumerate(site.out_roles)})
    for name, _, roles in [*read, output]:
        # A merged head axis is read whole: none of its roles may be split.
        split = [p for r in roles if isinstance(r, Merged) for p, _ in r.parts if p in axes]
        if split:
            return (
                f"{name} varies along an axis merged from several head axes while "
                f"{_role_name(site.layout, split[0])} is sharded; kept as written"
            )
    ring_axes = queries = None
    if "T" in axes and "S" not in axes:
        queries = axes["T"]  # each device its query rows against every key
    elif "T" in axes or "S" in axes:
        ring_axes = _ring_axes(site, axes)
        if isinstance(ring_axes, str):
            return ring_axes
    for role, names in axes.items():
        n = math.prod(mesh.shape[a] for a in names)
        if site.layout.sizes[role] % n:
            return (
                f"the {_role_name(site.layout, role)} axis ({site.layout.sizes[role]}) is not "
                f"divisible by its {n} shards; kept as written"
            )

    atoms, in_specs = [], []
    for atom, roles, ndim in specs:
        by_axis = _roles_by_axis(roles, ndim)
        if ring_axes is not None and "T" in roles:
            # A [.., T, S] bias or mask: one mesh axis cannot shard both; the
            # ring reads it by query block, whole along the keys.
            by_axis = [None if r == "S" else r for r in by_axis]
        spec = partition_spec([axes.get(r) for r in by_axis])
        index = find(atoms, atom)
        if index is None:
            atoms.append(atom)
            in_specs.append(spec)
        elif in_specs[index] != spec:
            return (
                "one array is read in two shardings (as q/k/v and as a bias/mask, or "
                "segment ids at the query and at the key positions while only the queries "
                "are sharded); kept as written"
            )
    for scale in site.q_scales:  # a scalar (a per-head one is an operand above)
        if find(atoms, scale.atom) is None:
            atoms.append(scale.atom)
            in_specs.append(PartitionSpec())
    out_spec = partition_spec([None if r == "Dv" else axes.get(r) for r in site.out_roles])
    root = compat.named_sharding_of(site.root.eqn.outvars[0].aval)
    root_spec = None
    if root is not None:
        ndim = len(site.out_roles)
        wanted = partition_spec(entries(root.spec, ndim))
        if entries(wanted, ndim) != entries(out_spec, ndim):
            root_spec = wanted
    plan = ShardPlan(mesh, axes, tuple(atoms), tuple(in_specs), out_spec, root_spec, ring_axes)
    return dataclasses.replace(plan, site=site, queries=queries)


def mesh_of(site: AttentionSite, sharding_of):
    """The mesh ``site``'s operands live on (`analyze`'s): that of their
    shardings, else the context's of several devices; None, or the reason
    (several meshes)."""
    return _mesh([sharding_of(atom) for _, atom, _ in operands(site)])


def _mesh(shardings: list):
    meshes = {s.mesh for s in shardings if s is not None}
    if len(meshes) > 1:
        return "the attention's operands live on different meshes; kept as written"
    mesh = next(iter(meshes), None)
    if mesh is None:
        context = compat.context_mesh()
        mesh = None if context.empty or context.size <= 1 else context
    return mesh


def auto_axes_reason(mesh, kernel) -> str | None:
    """Why ``kernel`` cannot run on ``mesh`` when its shardings are not known
    (Auto axes: XLA chooses them after tracing, and cannot partition a kernel
    that is not `Kernel.partitionable`); None where it can."""
    kinds = compat.axis_kinds(mesh)
    if not kinds["auto"] or kernel.partitionable:
        return None
    auto = ", ".join(f"{a}={mesh.shape[a]}" for a in kinds["auto"])
    return (
        f"the operands are on a mesh with Auto axes ({auto}): XLA chooses their "
        f"shardings after tracing, and it cannot partition the {kernel.name} kernel "
        "(it would run replicated, gathering q/k/v onto every device); use Explicit "
        "mesh axes (jax.make_mesh's default), call the attention inside jax.shard_map, "
        "or a kernel XLA can partition ('blockwise')"
    )


def _ring_axes(site: AttentionSite, axes: dict) -> tuple | str:
    """The mesh axes a sequence-sharded site runs its ring over, or why it can't."""
    t, s = axes.get("T"), axes.get("S")
    if t != s:
        if t is not None:
            first = f"q's query sequence axis is sharded over mesh axis {'x'.join(t)}"
        else:
            first = f"k's key sequence axis is sharded over mesh axis {'x'.join(s)}"
        other = "not sharded" if t is None or s is None else f"sharded over {'x'.join(s)}"
        return (
            f"sequence-sharded: {first}, the other sequence axis is {other}; a ring needs q "
            "and k/v sharded alike along their sequences, so the attention is kept as written"
        )
    problem = ring.unsupported(site.spec)
    if problem is not None:
        return f"sequence-sharded over mesh axis {'x'.join(t)}: {problem}; kept as written"
    return t


def operands(site: AttentionSite) -> list:
    """``(name, atom, role -> axis)`` of every array the site reads."""
    out = [
        ("q", site.q.atom, dict(site.q.axes)),
        ("k", site.k.atom, dict(site.k.axes)),
        ("v", site.v.atom, dict(site.v.axes)),
    ]
    for i, e in enumerate(site.extras):
        # An `Unsplit` term's or a `Replayed` mask's axes are not its atom's (read whole).
        whole = isinstance(e.transform, Unsplit) or getattr(e.transform, "reads_whole", False)
        axes = {} if whole else e.axes
        out.append((f"bias/mask #{i}", e.atom, {r: a for r, a in axes.items() if a is not None}))
    for scale in site.q_scales:  # a per-batch or per-head multiplier folded into q
        roles = scale.operand_roles()
        if roles:
            out.append((scale.name, scale.atom, roles))
    for op in site.post_ops:  # what sits after the softmax and reads an array
        roles = op.operand_roles()
        if roles is not None:
            [atom] = op.atoms()
            out.append((op.name, atom, roles))
    return out


def entries(spec, ndim: int) -> list[tuple]:
    """Mesh axes of each dimension (a tuple, empty when not sharded)."""
    out = []
    for i in range(ndim):
        entry = spec[i] if i < len(spec) else None
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return out


def partition_spec(entries) -> PartitionSpec:
    """The `PartitionSpec` of per-dimension mesh axes (`entries`' inverse)."""
    return PartitionSpec(*(None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in entries))


def _roles_by_axis(roles: dict, ndim: int) -> list:
    by_axis = [None] * ndim
    for role, axis in roles.items():
        by_axis[axis] = role
    return by_axis


def find(atoms: list, atom) -> int | None:
    for i, a in enumerate(atoms):
        if a is atom or (not isinstance(a, Const) and not isinstance(atom, Const) and a == atom):
            return i
    return None


def _role_name(layout: Layout, role) -> str:
    if role in _SEQUENCE:
        return f"{_SEQUENCE[role]} sequence"
    if role == "G":
        return "query-group"
    batch, heads, _ = layout.groups
    if role in heads:
        return "heads"
    return "batch" if len(batch) == 1 else f"batch #{batch.index(role)}"


def localize(site: AttentionSite, counts: dict) -> AttentionSite:
    """``site`` on one shard: role sizes divided by their shard counts, and the
    kernel spec (batch, heads, bias/mask shapes) to match."""
    sizes = {r: s // counts.get(r, 1) for r, s in site.layout.sizes.items()}
    layout = Layout(sizes)

    def shape4(shape):
        return (
            shape[0] if shape[0] == 1 else layout.batch,
            shape[1] if shape[1] == 1 else layout.heads,
            *shape[2:],
        )

    spec = site.spec
    ops = tuple(op.localized(shape4) for op in spec.ops)
    spec = spec.with_ops(
        ops,
        batch=layout.batch,
        heads=layout.heads,
        kv_heads=layout.kv_heads,
        q_len=layout.sizes["T"],
        kv_len=layout.sizes["S"],
        extras=tuple(dataclasses.replace(e, shape=shape4(e.shape)) for e in spec.extras),
    )
    return dataclasses.replace(site, layout=layout, spec=spec)
