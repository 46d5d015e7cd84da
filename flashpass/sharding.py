"""Sharded programs: every rewritten attention site runs per shard.

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

* a kernel XLA can partition (`Kernel.partitionable`: plain JAX, or cuDNN's own
  ``custom_partitioning``) runs as is and XLA splits it;
* any other kernel is not used for a site on a mesh with Auto axes: the site
  is kept as written, with the reason in the report.

A site is also kept as written, with its reason, when its query or key
sequence axis is sharded (sequence parallelism: the kernels need whole
sequences per device), when its head dim is sharded, or when its operands
shard one axis over different mesh axes or unevenly.

Sites inside a ``shard_map`` body see per-device values already: the body is
re-traced through `jax.shard_map` (`rebind_shard_map`), so the kernel call is
traced in the body's manual-axes context.  With ``check_vma=True`` (the
default) a Pallas call cannot type-check there; it is traced with the checks
off and its output typed from its operands (`_vma_opaque`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from flashpass.patterns.regroup import Merged

from . import compat, errors, ring, zigzag
from .graph import Const
from .site import AttentionSite, Layout

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
    ring: tuple | None = None  # mesh axes of a sharded sequence: run as a ring (ring.py)
    site: AttentionSite | None = None  # the site as planned (k/v read before a gather)
    steps: tuple | None = None  # how the ring runs each step (`ring.plan`)
    zigzag: Any = None  # a load-balanced causal ring's plan (`zigzag.plan`), else None

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

    def with_steps(self, site: AttentionSite, kernels, ctx) -> ShardPlan:
        """This ring with its steps planned (`ring.plan`) and, for a causal
        ring that can be, its load balancing (`zigzag.plan`); ``site`` as planned."""
        local = localize(self.site or site, self.counts())
        n = self.ring_size()
        steps = ring.plan(local.spec, n, True, kernels, ctx)
        balanced = zigzag.plan(local.spec, n, True, kernels, ctx)
        return dataclasses.replace(self, steps=steps, zigzag=balanced)

    @property
    def axis_names(self) -> frozenset:
        return frozenset(a for names in self.axes.values() for a in names)

    def counts(self) -> dict:
        """Role -> number of shards."""
        return {r: math.prod(self.mesh.shape[a] for a in names) for r, names in self.axes.items()}


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


# --------------------------------------------------------------------------- planning


def plan_sites(planned, scopes: dict) -> tuple[dict, dict]:
    """``(shards, kept)``: root path -> `ShardPlan` for the sites that run per
    shard, root path -> reason for those that must be kept as written.

    Auto mesh axes keep shardings out of the types; a ``sharding_constraint``
    on q/k/v in the program is read instead, only to find a sequence-sharded
    site to run as a ring (otherwise XLA partitions the kernel, as before)."""
    shards, kept = {}, {}
    for p in planned:
        scope = scopes[p.site.scope_prefix]
        site = _before_gather(p.site, scope)
        result = analyze(site, p.kernel, scope.aval)
        if result is None or (isinstance(result, ShardPlan) and result.ring is None):
            hinted = analyze(site, p.kernel, scope.aval, _constrained(scope), ring_only=True)
            if isinstance(hinted, ShardPlan):
                result = hinted
        if result is None:
            result = _body_ring(p.site, scope)
        if isinstance(result, str):
            kept[p.site.root.path] = result
        elif result is not None:
            shards[p.site.root.path] = result
    return shards, kept


def _body_ring(site: AttentionSite, scope) -> BodyRing | None:
    """The `BodyRing` of a site whose k and v are both all-gathered, tiled
    along their key axis, over the same manual axes; else None (the kernel
    then runs on the gathered k and v, as written).  A differentiated site's
    backward is proven again from the local k and v (`pipeline`)."""
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
    return BodyRing(localize(site, {"S": n}), names.pop(), n)


def _axis_tuple(name) -> tuple:
    return tuple(name) if isinstance(name, tuple | list) else (name,)


def _constrained(scope):
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


def _before_gather(site: AttentionSite, scope) -> AttentionSite:
    """With Explicit mesh axes, code attending a sequence-sharded q to k/v
    must gather k and v itself (``jax.sharding.reshard(k, P())``): read them
    from before that gather, so the site sees them sequence-sharded like q and
    runs as a ring; the gathers, then unused, are removed with the dead code."""
    q_sharding = compat.named_sharding_of(scope.aval(site.q.atom))
    if q_sharding is None:
        return site
    q_axes = _entries(q_sharding.spec, len(site.q.shape))
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
        if src is None or not _entries(src.spec, len(operand.shape))[operand.axes["S"]]:
            continue
        replaced[name] = dataclasses.replace(operand, atom=scope.resolve(source))
    return dataclasses.replace(site, **replaced) if replaced else site


def analyze(
    site: AttentionSite, kernel, aval_of, sharding_of=None, ring_only: bool = False
) -> ShardPlan | str | None:
    """How ``site`` runs on its operands' mesh: a `ShardPlan`, None (unsharded:
    as is), or the reason it must be kept as written.  ``aval_of(atom)`` gives
    the abstract value of an operand; ``sharding_of(atom)`` its sharding
    (default: the one in its type).  ``ring_only``: only a ring plan is wanted
    (anything else is None)."""
    operands = _operands(site)
    if sharding_of is None:

        def sharding_of(atom):
            return compat.named_sharding_of(aval_of(atom))

    shardings = [sharding_of(atom) for _, atom, _ in operands]
    meshes = {s.mesh for s in shardings if s is not None}
    if len(meshes) > 1:
        return "the attention's operands live on different meshes; kept as written"
    mesh = next(iter(meshes), None)
    if mesh is None:
        context = compat.context_mesh()
        mesh = None if context.empty or context.size <= 1 else context
    if mesh is None:
        return None
    kinds = compat.axis_kinds(mesh)
    if kinds["auto"] and not kernel.partitionable and not ring_only:
        auto = ", ".join(f"{a}={mesh.shape[a]}" for a in kinds["auto"])
        return (
            f"the operands are on a mesh with Auto axes ({auto}): XLA chooses their "
            f"shardings after tracing, and it cannot partition the {kernel.name} kernel "
            "(it would run replicated, gathering q/k/v onto every device); use Explicit "
            "mesh axes (jax.make_mesh's default), call the attention inside jax.shard_map, "
            "or a kernel XLA can partition ('blockwise')"
        )

    axes: dict = {}
    specs: list = []
    for (name, atom, roles), sharding in zip(operands, shardings, strict=True):
        ndim = len(aval_of(atom).shape)
        entries = _entries(sharding.spec if sharding is not None else (), ndim)
        for role, axis in roles.items():
            names = entries[axis]
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
    if not axes or (ring_only and "T" not in axes and "S" not in axes):
        return None
    output = ("the output", None, {r: i for i, r in enumerate(site.out_roles)})
    for name, _, roles in [*operands, output]:
        # A merged head axis is read whole: none of its roles may be split.
        split = [p for r in roles if isinstance(r, Merged) for p, _ in r.parts if p in axes]
        if split:
            return (
                f"{name} varies along an axis merged from several head axes while "
                f"{_role_name(site.layout, split[0])} is sharded; kept as written"
            )
    ring_axes = None
    if "T" in axes or "S" in axes:
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
        spec = _spec([axes.get(r) for r in by_axis])
        index = _find(atoms, atom)
        if index is None:
            atoms.append(atom)
            in_specs.append(spec)
        elif in_specs[index] != spec:
            return "one array is both a q/k/v and a bias/mask operand in two layouts"
    for atom, _ in site.q_scales:
        if _find(atoms, atom) is None:
            atoms.append(atom)
            in_specs.append(PartitionSpec())
    out_spec = _spec([None if r == "Dv" else axes.get(r) for r in site.out_roles])
    root = compat.named_sharding_of(site.root.eqn.outvars[0].aval)
    root_spec = None
    if root is not None:
        ndim = len(site.out_roles)
        wanted = _spec(_entries(root.spec, ndim))
        if _entries(wanted, ndim) != _entries(out_spec, ndim):
            root_spec = wanted
    plan = ShardPlan(mesh, axes, tuple(atoms), tuple(in_specs), out_spec, root_spec, ring_axes)
    return dataclasses.replace(plan, site=site)


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


def _operands(site: AttentionSite) -> list:
    """``(name, atom, role -> axis)`` of every array the site reads."""
    out = [
        ("q", site.q.atom, dict(site.q.axes)),
        ("k", site.k.atom, dict(site.k.axes)),
        ("v", site.v.atom, dict(site.v.axes)),
    ]
    for i, e in enumerate(site.extras):
        out.append((f"bias/mask #{i}", e.atom, {r: a for r, a in e.axes.items() if a is not None}))
    for kind, *data in site.post_ops:
        if kind == "scale":  # an output multiplier (head mask)
            e = data[0]
            out.append(("head mask", e.atom, {r: a for r, a in e.axes.items() if a is not None}))
    return out


def _entries(spec, ndim: int) -> list[tuple]:
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


def _spec(entries) -> PartitionSpec:
    return PartitionSpec(*(None if not e else (e[0] if len(e) == 1 else tuple(e)) for e in entries))


def _roles_by_axis(roles: dict, ndim: int) -> list:
    by_axis = [None] * ndim
    for role, axis in roles.items():
        by_axis[axis] = role
    return by_axis


def _find(atoms: list, atom) -> int | None:
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


# --------------------------------------------------------------------------- running


def run_site(shard: ShardPlan | None, planned, read, compute):
    """The site's output: ``compute(site, kernel, interpret, read)``, per shard
    inside a ``shard_map`` when ``shard`` says the operands are sharded."""
    site, kernel, interpret = planned.site, planned.kernel, planned.interpret
    if isinstance(shard, BodyRing):  # already in the user's shard_map
        return _ring_output(shard.site, read, shard.ring, shard.size, q_global=False)
    if shard is None:
        atoms = _atoms(site)
        values = [read(a) for a in atoms]
        if kernel.plain_jax or not any(map(compat.varying_axes, values)):
            return compute(site, kernel, interpret, read)
        # In a shard_map body with check_vma=True: a kernel that is not
        # `Kernel.plain_jax` (a Pallas call) cannot say how
        # its output varies over the manual axes; type it from the operands.
        return _vma_opaque(lambda *v: compute(site, kernel, interpret, _reader(atoms, v)), values)
    site = shard.site or site
    local = localize(site, shard.counts())
    values = [
        _with_spec(read(atom), shard.mesh, spec)
        for atom, spec in zip(shard.atoms, shard.in_specs, strict=True)
    ]
    if shard.ring is not None:
        n = shard.ring_size()

        index = shard.sharded_index(local)

        def compute(site, kernel, interpret, read):  # noqa: F811 - the ring replaces the kernel
            options = dict(steps=shard.steps, interpret=interpret, sharded_index=index)
            return _ring_output(site, read, shard.ring, n, zz=shard.zigzag, **options)

    out = compat.shard_map(
        lambda *v: compute(local, kernel, interpret, _reader(shard.atoms, v)),
        mesh=shard.mesh,
        in_specs=shard.in_specs,
        out_specs=shard.out_spec,
        axis_names=shard.axis_names,
        # A Pallas call does not declare how its outputs vary over manual axes.
        check_vma=False,
    )(*values)
    if shard.root_spec is not None:
        out = compat.reshard(out, NamedSharding(shard.mesh, shard.root_spec))
    return out


def _ring_output(
    site: AttentionSite,
    read,
    axes: tuple,
    n: int,
    q_global: bool = True,
    steps=None,
    interpret: bool = False,
    sharded_index=None,
    zz=None,
):
    """The site's output from `ring.ring_attention` over the mesh ``axes``
    (``n`` devices in all), inside a ``shard_map`` over them, its steps run
    as ``steps`` says (`ring.plan`; None: plain JAX), or from
    `zigzag.zigzag_attention` with a `zigzag.Zigzag` plan ``zz``."""
    q, k, v, extras = site.to_kernel(read)
    name = axes[0] if len(axes) == 1 else axes
    options = dict(steps=steps, interpret=interpret, sharded_index=sharded_index)
    with jax.named_scope("flashpass_ring"):
        if zz is not None:
            out = zigzag.zigzag_attention(q, k, v, site.spec, name, n, zz, interpret)
        else:
            out = ring.ring_attention(q, k, v, extras, site.spec, name, n, q_global, **options)
    return site.from_kernel(out, read, extras)


def _atoms(site: AttentionSite) -> list:
    """Every value the site reads, once."""
    atoms: list = []
    for atom in [a for _, a, _ in _operands(site)] + [a for a, _ in site.q_scales]:
        if _find(atoms, atom) is None:
            atoms.append(atom)
    return atoms


def _reader(atoms, values):
    def read(atom):
        return values[_find(list(atoms), atom)]

    return read


def _vma_opaque(fn, args):
    """``fn(*args)`` traced without varying-manual-axes checks (which a Pallas
    call fails), its output and gradients typed as varying over the axes the
    arguments vary over, as the original computation's would be.

    Everything traced with the checks off is inside a ``jit``, whose equation
    is typed by its own jaxpr: re-binding the rewritten program with the
    checks on (as ``shard_map`` does with its body) does not re-check it.
    """
    arg_axes = [compat.varying_axes(a) for a in args]
    axes = frozenset().union(*arg_axes)

    def unchecked(f, *xs):
        with compat.vma_checks(False):
            return jax.jit(f)(*xs)

    @jax.custom_vjp
    def call(*xs):
        return _varying(unchecked(lambda *a: fn(*[_invariant(x) for x in a]), *xs), axes)

    def fwd(*xs):
        plain = unchecked(lambda *a: [_invariant(x) for x in a], *xs)
        with compat.vma_checks(False):
            out, vjp = jax.vjp(jax.jit(fn), *plain)
        return _varying(out, axes), vjp

    def bwd(vjp, g):
        cts = unchecked(lambda g: vjp(_invariant(g)), g)
        return tuple(_varying(c, a) for c, a in zip(cts, arg_axes, strict=True))

    call.defvjp(fwd, bwd)
    return call(*args)


def _invariant(x):
    """``x`` as a new value (with vma checks off, typed as not varying)."""
    x = jax.numpy.asarray(x)
    if x.dtype == bool:
        return jax.lax.bitwise_or(x, jax.numpy.zeros((), bool))
    return jax.lax.add(x, jax.numpy.zeros((), x.dtype))


def _varying(x, axes: frozenset):
    missing = tuple(sorted(axes - compat.varying_axes(x)))
    if not missing or not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return x
    return jax.lax.pcast(x, missing, to="varying")


def _with_spec(x, mesh, spec: PartitionSpec):
    """``x`` with the sharding ``shard_map`` expects: an operand replicated along
    a sharded role (a bias shared by all heads, a constant) is sliced to it,
    which is local (no collective)."""
    x = jax.numpy.asarray(x)
    current = compat.named_sharding_of(compat.get_aval(x))
    ndim = x.ndim
    have = _entries(current.spec, ndim) if current is not None else [()] * ndim
    if have == _entries(spec, ndim):
        return x
    if compat.axis_kinds(mesh)["auto"]:
        # Auto axes are not in the types (no reshard): shard_map's in_specs
        # make XLA lay the operand out as the ring expects.
        return x
    return compat.reshard(x, NamedSharding(mesh, spec))


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
    ops = tuple(op.localized(shape4) for op in spec.score_ops)
    spec = dataclasses.replace(
        spec,
        batch=layout.batch,
        heads=layout.heads,
        kv_heads=layout.kv_heads,
        q_len=layout.sizes["T"],
        kv_len=layout.sizes["S"],
        score_ops=ops,
        extras=tuple(dataclasses.replace(e, shape=shape4(e.shape)) for e in spec.extras),
    )
    return dataclasses.replace(site, layout=layout, spec=spec)


# --------------------------------------------------------------------------- shard_map bodies


def rebind_shard_map(eqn, invals, plan, prefix: tuple, run_body) -> list:
    """Bind a ``shard_map`` equation whose body holds sites, re-tracing the body
    (``run_body(plan, prefix, jaxpr, args)``) through `jax.shard_map`, which
    sets up the body's manual axes, axis names and varying-axes types (and
    closes over any constants a kernel creates).  If re-tracing fails, the
    body's sites fall back (``plan.failed``) and the equation is bound as
    written.
    """
    p = compat.shard_map_params(eqn)
    body = p["body"]
    fn = compat.shard_map(
        lambda *args: tuple(run_body(plan, prefix, body, args)),
        mesh=p["mesh"],
        in_specs=p["in_specs"],
        out_specs=p["out_specs"],
        axis_names=p["axis_names"],
        check_vma=p["check_vma"],
    )
    try:
        with compat.equation_context(eqn):
            return list(fn(*invals))
    except Exception as err:  # keep the body as written: its sites fall back
        if errors.strict():
            raise
        plan.failed[prefix] = errors.describe(err)
        return compat.bind_equation(eqn, invals)
