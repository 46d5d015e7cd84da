"""Emitting a placed site: one rule per placement type (`EMIT`).

The evaluator (`flashpass.rewrite`) calls `emit` at a site's root with a
``read(atom)`` of the values the site reads; the rule returns the site's
output in the layout and dtype of its root.  ``shard_map`` equations whose
bodies hold sites are re-bound by `rebind_shard_map`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .. import compat, ring, sharding
from ..calls import KERNEL_PREFIX, kernel_call
from ..ring import zigzag
from ..site import AttentionSite
from .types import BodyRing, Deferred, Local, PerShard, Placed, QueryShards, Ring


def emit(placed: Placed, read):
    """The output of ``placed``'s site from the values ``read`` gives."""
    return EMIT[type(placed.placement)](placed, read)


def kernel_output(site: AttentionSite, kernel, interpret: bool, read):
    """The kernel's output for ``site``, in the layout and dtype of its root.

    K and v reach the kernel in the program's own layout where the kernel
    reads it (`Kernel.kv_layouts`): a decode step never transposes its cache."""
    layout = site.kv_layout()
    if layout not in kernel.kv_layouts:
        layout = "bhsd"
    q, k, v, extras = site.to_kernel(read, layout)
    call = kernel_call(kernel, site.spec, interpret, layout)
    with jax.named_scope(f"{KERNEL_PREFIX}{kernel.name}"):
        out = call(q, k, v, *extras)
    return site.from_kernel(out, read, extras)


def _local(placed: Placed, read):
    planned = placed.planned
    site, kernel, interpret = planned.site, planned.kernel, planned.interpret
    atoms = atoms_of(site)
    values = [read(a) for a in atoms]
    if kernel.plain_jax or not any(map(compat.varying_axes, values)):
        return kernel_output(site, kernel, interpret, read)
    # In a shard_map body with check_vma=True: a kernel that is not
    # `Kernel.plain_jax` (a Pallas call) cannot say how its output varies
    # over the manual axes; type it from the operands.
    return _vma_opaque(lambda *v: kernel_output(site, kernel, interpret, reader(atoms, v)), values)


def _per_shard(placed: Placed, read):
    planned = placed.planned

    def compute(local, read):
        return kernel_output(local, planned.kernel, planned.interpret, read)

    return _in_shard_map(placed.placement.shard, placed.site, read, compute)


def _ring(placed: Placed, read):
    placement = placed.placement
    shard = placement.shard
    n = shard.ring_size()

    def compute(local, read):
        options = dict(steps=placement.steps, interpret=placed.planned.interpret)
        index = shard.sharded_index(local)
        return ring_output(
            local, read, shard.ring, n, sharded_index=index, zz=placement.zigzag, **options
        )

    return _in_shard_map(shard, placed.site, read, compute)


def _body_ring(placed: Placed, read):  # already in the user's shard_map
    p = placed.placement
    return ring_output(p.site, read, p.ring, p.size, q_global=False)


def _query_shards(placed: Placed, read):
    p, planned = placed.placement, placed.planned
    atoms = p.shard.atoms

    def compute(local, read):
        def branch(spec):
            site = dataclasses.replace(local, spec=spec)
            return lambda *v: kernel_output(
                site, planned.kernel, planned.interpret, reader(atoms, v)
            )

        values = [read(a) for a in atoms]
        if all(spec == p.specs[0] for spec in p.specs):  # no op reads the rows' offset
            return branch(p.specs[0])(*values)
        axes = p.shard.queries
        index = jax.lax.axis_index(axes[0] if len(axes) == 1 else axes)
        return jax.lax.switch(index, [branch(spec) for spec in p.specs], *values)

    return _in_shard_map(p.shard, placed.site, read, compute)


def _deferred(placed: Placed, read):  # placed by XLA's partitioner
    from .deferred import emit_deferred  # (deferred.py builds on this module)

    return emit_deferred(placed, read)


#: How each placement is emitted.
EMIT = {
    Local: _local,
    PerShard: _per_shard,
    Ring: _ring,
    BodyRing: _body_ring,
    QueryShards: _query_shards,
    Deferred: _deferred,
}


def _in_shard_map(shard: sharding.ShardPlan, site: AttentionSite, read, compute):
    """``compute(local site, read)`` per shard, inside a ``shard_map`` over
    ``shard``'s mesh, the output resharded as the original's was."""
    local = sharding.localize(shard.site or site, shard.counts())
    values = [
        _with_spec(read(atom), shard.mesh, spec)
        for atom, spec in zip(shard.atoms, shard.in_specs, strict=True)
    ]
    out = compat.shard_map(
        lambda *v: compute(local, reader(shard.atoms, v)),
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


def ring_output(
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


def atoms_of(site: AttentionSite) -> list:
    """Every value the site's forward reads, once."""
    atoms: list = []
    operands = [atom for _, atom, _ in sharding.operands(site)]
    for atom in operands + [scale.atom for scale in site.q_scales]:
        if sharding.find(atoms, atom) is None:
            atoms.append(atom)
    return atoms


def reader(atoms, values):
    def read(atom):
        return values[sharding.find(list(atoms), atom)]

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
    """``x`` typed as varying over ``axes`` (a float: integers carry no cotangent)."""
    if not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return x
    return compat.vary_over(x, axes)


def _with_spec(x, mesh, spec: PartitionSpec):
    """``x`` with the sharding ``shard_map`` expects: an operand replicated along
    a sharded role (a bias shared by all heads, a constant) is sliced to it,
    which is local (no collective)."""
    x = jax.numpy.asarray(x)
    current = compat.named_sharding_of(compat.get_aval(x))
    ndim = x.ndim
    have = sharding.entries(current.spec, ndim) if current is not None else [()] * ndim
    if have == sharding.entries(spec, ndim):
        return x
    if compat.axis_kinds(mesh)["auto"]:
        # Auto axes are not in the types (no reshard): shard_map's in_specs
        # make XLA lay the operand out as the ring expects.
        return x
    return compat.reshard(x, NamedSharding(mesh, spec))


def rebind_shard_map(eqn, invals, run_body) -> list:
    """Bind a ``shard_map`` equation whose body holds sites, re-tracing the body
    (``run_body(jaxpr, args)``) through `jax.shard_map`, which sets up the
    body's manual axes, axis names and varying-axes types (and closes over
    any constants a kernel creates)."""
    p = compat.shard_map_params(eqn)
    body = p["body"]
    fn = compat.shard_map(
        lambda *args: tuple(run_body(body, args)),
        mesh=p["mesh"],
        in_specs=p["in_specs"],
        out_specs=p["out_specs"],
        axis_names=p["axis_names"],
        check_vma=p["check_vma"],
    )
    with compat.equation_context(eqn):
        return list(fn(*invals))
