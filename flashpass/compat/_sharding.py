"""Meshes, shardings, shard_map and varying manual axes (see compat/__init__.py)."""

from __future__ import annotations

import contextlib

import jax

from ._jaxpr import _siu, bind_equation, get_aval  # noqa: F401

# --- sharding

#: Primitives that only change a value's type (its varying manual axes inside
#: ``shard_map``), never its value: constant folding looks through them.
VALUE_IDENTITY_PRIMITIVES = frozenset({"pvary"})


def named_sharding_of(aval):
    """``aval``'s `NamedSharding` when it lives on a mesh of more than one
    device, else None (unsharded, single device, or no sharding at all)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or mesh.size <= 1:
        return None
    return sharding


def same_layout(src_aval, dst_aval) -> bool:
    """Whether a ``reshard`` from ``src_aval`` to ``dst_aval`` moves nothing:
    both unsharded (or on one device), or the same `NamedSharding` (JAX 0.12's
    ``jnp.where`` reshards its operands to the sharding they already have)."""
    src, dst = named_sharding_of(src_aval), named_sharding_of(dst_aval)
    if src is None or dst is None:
        return src is None and dst is None
    return src.mesh == dst.mesh and src.spec == dst.spec


def context_mesh():
    """The abstract mesh of the current trace context (``jax.set_mesh``,
    ``shard_map`` bodies); empty when none is set."""
    return jax.sharding.get_abstract_mesh()


def axis_kinds(mesh) -> dict[str, tuple[str, ...]]:
    """``{"explicit": names, "auto": names, "manual": names}`` of ``mesh``'s
    axes of more than one device."""
    kinds: dict[str, list[str]] = {"explicit": [], "auto": [], "manual": []}
    if mesh is None or mesh.empty:
        return {k: () for k in kinds}
    types = getattr(mesh, "axis_types", None) or (jax.sharding.AxisType.Auto,) * len(
        mesh.axis_names
    )
    for name, kind in zip(mesh.axis_names, types, strict=True):
        if mesh.shape[name] > 1:
            kinds[str(kind.name).lower()].append(name)
    return {k: tuple(v) for k, v in kinds.items()}


def shard_map(fn, *, mesh, in_specs, out_specs, axis_names, check_vma: bool):
    """`jax.shard_map` (public since JAX 0.7; ``check_vma`` was ``check_rep``)."""
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(axis_names),
        check_vma=check_vma,
    )


def reshard(x, sharding):
    """`jax.sharding.reshard` of ``x`` to ``sharding`` (Explicit mesh axes)."""
    return jax.sharding.reshard(x, sharding)


def is_shard_map(eqn) -> bool:
    return eqn.primitive.name == "shard_map"


def shard_map_params(eqn) -> dict:
    """A ``shard_map`` equation's arguments to `shard_map`, and its body."""
    p = eqn.params
    return {
        "mesh": p["mesh"],
        "in_specs": tuple(p["in_specs"]),
        "out_specs": tuple(p["out_specs"]),
        # JAX < 0.10 calls the equation's param ``manual_axes``.
        "axis_names": frozenset(
            p["newly_manual_axes"] if "newly_manual_axes" in p else p["manual_axes"]
        ),
        "check_vma": bool(p["check_vma"]),
        "body": p["jaxpr"],
    }


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (its type inside a ``shard_map``
    body with ``check_vma=True``); empty elsewhere."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary_like(x, *refs):
    """``x`` typed as varying over every manual mesh axis one of ``refs`` varies
    over (``lax.pcast(..., to="varying")``): a loop's zero accumulators must
    have the type of what the loop adds to them under ``check_vma``."""
    return vary_over(x, frozenset().union(*(varying_axes(r) for r in refs)))


def vary_over(x, axes: frozenset):
    """``x`` typed as varying over the manual mesh ``axes`` too."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


@contextlib.contextmanager
def axis_env(sizes: dict):
    """Context: manual mesh axis names bound to their sizes (``{name: size}``),
    as inside a ``shard_map`` body, so that collectives over them trace
    outside one (a backward template whose forward all-gathers)."""
    from jax._src import core

    with core.extend_axis_env_nd(list(sizes.items())):
        yield


def only_axis_effects(effects) -> bool:
    """Whether ``effects`` are all named-axis effects: what a collective over a
    manual axis carries inside a ``shard_map`` body (``reduce_scatter`` in the
    backward of an all-gather), which replacing it by other collectives over
    the same axes keeps."""
    from jax._src import core

    return all(isinstance(e, core.NamedAxisEffect) for e in effects)


def without_varying(aval):
    """``aval`` typed with no varying manual axes (shape, dtype and sharding
    kept): a backward template is traced outside the ``shard_map`` whose body
    it serves, where primitives give their outputs none either."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        if not mat.varying:
            return aval
        return type(aval)(aval.shape, aval.dtype, aval.weak_type, sharding=aval.sharding)
    if getattr(aval, "vma", None):
        return aval.update(vma=frozenset())
    return aval


def aval_key(aval) -> tuple:
    """A hashable description of ``aval`` with what ``str`` leaves out: its varying
    manual axes and its sharding (a jaxpr traced for one must not serve another)."""
    mat = getattr(aval, "mat", None)
    vma = frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))
    return (str(aval), tuple(sorted(map(str, vma))), str(getattr(aval, "sharding", None)))


def vma_checks(enabled: bool):
    """Context: trace with ``shard_map``'s varying-manual-axes checks on or off
    (off, primitives give their outputs no varying axes)."""
    from jax._src import config as _config

    return _config._check_vma(enabled)


@contextlib.contextmanager
def equation_context(eqn):
    """The source info and context ``bind_equation`` binds ``eqn`` in, for
    re-binding it through a public API instead (e.g. `shard_map`)."""
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


@contextlib.contextmanager
def outside_mesh():
    """Trace with no mesh context (no manual axes, no varying-axes checks):
    for work that must not depend on where the pass runs, such as probing a
    kernel from inside a user's ``shard_map`` body."""
    from jax._src import mesh as _mesh

    with (
        jax.sharding.use_abstract_mesh(_mesh.empty_abstract_mesh),
        vma_checks(False),
        _no_axis_names(),
    ):
        yield


@contextlib.contextmanager
def _no_axis_names():
    """Context: no named axes bound (a Pallas kernel in interpret mode asks for
    the index of every bound axis, which lowering outside the body cannot give)."""
    from jax._src import core

    prev = core.trace_ctx.axis_env
    core.trace_ctx.set_axis_env(core.top_axis_env)
    try:
        yield
    finally:
        core.trace_ctx.set_axis_env(prev)
