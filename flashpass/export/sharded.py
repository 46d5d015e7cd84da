"""Artifacts exported over several devices: their meshes and shardings.

`jax.export` records an artifact's input and output shardings as
`NamedSharding`s over abstract meshes, and its module names those meshes
(``sdy.mesh``) and constrains values inside (``sdy.sharding_constraint``).
The lift route re-exports the rewritten program with the same shardings over
a concrete mesh of this host's first ``nr_devices`` devices (an artifact is
independent of which devices it ran on) and lifts each constraint to
``jax.lax.with_sharding_constraint``, so the result calls on the same
devices as the original.  A form this module cannot reproduce raises
`LiftError` with the reason, and the artifact is kept.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from flashpass import compat

from .values import LiftError

# ``sdy.mesh @name = <["a"=4, "b"=2]>``; any further field (device ids) is refused.
_MESH = re.compile(r'^sdy\.mesh @(\w+) = <\[((?:"\w+"=\d+(?:, )?)*)\]>')
_MESH_AXIS = re.compile(r'"(\w+)"=(\d+)')
# ``<@mesh, [{"a"}, {}, {?}, {"a", "b"}]>`` (a dimension lists axes or is open).
_SHARDING = re.compile(r"^(?:#sdy\.sharding)?<@(\w+), \[(.*)\]>$")
_DIM = re.compile(r'\{((?:"\w+"(?:, )?)*)\}|\{\?\}')


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a multi-device artifact is laid out on this host."""

    meshes: dict  # sdy mesh symbol -> concrete Mesh
    in_shardings: tuple  # NamedSharding | None per input
    out_shardings: tuple  # NamedSharding | None per output

    def structs(self, avals, shardings) -> list:
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(avals, shardings, strict=True)
        ]


def layout(exp: jax.export.Exported, module) -> Layout | None:
    """The layout of an artifact exported over several devices (``None`` for one)."""
    if exp.nr_devices == 1:
        return None
    named = compat.exported_named_shardings(exp)
    if named is None:
        raise LiftError(
            "the artifact records only HloShardings (exported by an older JAX); "
            "lift reproduces NamedShardings"
        )
    if jax.device_count() < exp.nr_devices:
        raise LiftError(
            f"the artifact is sharded over {exp.nr_devices} devices and this host has "
            f"{jax.device_count()} (lift re-exports on as many devices as the artifact)"
        )
    devices = jax.devices()[: exp.nr_devices]
    abstract = {s.mesh for s in named[0] + named[1] if s is not None}
    if len(abstract) > 1:
        raise LiftError("the artifact's shardings use several meshes (lift keeps one mesh)")
    types = {AxisType.Auto}
    if abstract:
        (one,) = abstract
        types = set(one.axis_types)
        if types not in ({AxisType.Auto}, {AxisType.Explicit}):
            raise LiftError(
                f"the artifact's mesh has {'/'.join(str(t) for t in one.axis_types)} axes "
                "(lift reproduces all-Auto or all-Explicit meshes)"
            )
    (kind,) = types
    meshes = {
        name: _concrete(axes, devices, exp, kind) for name, axes in _module_meshes(module).items()
    }
    mesh = None
    if abstract:
        mesh = _concrete(
            tuple(zip(one.axis_names, one.axis_sizes, strict=True)), devices, exp, kind
        )

    def concrete(shardings):
        return tuple(None if s is None else NamedSharding(mesh, s.spec) for s in shardings)

    return Layout(meshes, concrete(named[0]), concrete(named[1]))


def _module_meshes(module) -> dict:
    found = {}
    for op in module.body.operations:
        if op.operation.name != "sdy.mesh":
            continue
        text = str(op).strip()
        m = _MESH.match(text)
        rest = "" if m is None else text[m.end() :].strip()
        if m is None or (rest and not rest.startswith(("{stablehlo.mesh", "loc("))):
            raise LiftError(f"mesh with fields lift does not reproduce: {text[:120]}")
        axes = tuple((a, int(n)) for a, n in _MESH_AXIS.findall(m.group(2)))
        found[m.group(1)] = axes
    return found


def _concrete(axes, devices, exp, kind) -> Mesh:
    sizes = tuple(n for _, n in axes)
    if int(np.prod(sizes, dtype=int)) != exp.nr_devices:
        raise LiftError(f"a mesh of {sizes} devices in an artifact over {exp.nr_devices} devices")
    names = tuple(a for a, _ in axes)
    return Mesh(np.asarray(devices).reshape(sizes), names, axis_types=(kind,) * len(names))


def constrain(x, text: str, meshes: dict):
    """``x`` under an ``sdy.sharding_constraint`` whose sharding attribute is ``text``.

    On Auto axes it is ``with_sharding_constraint``.  On Explicit axes the
    sharding is in ``x``'s type, which JAX's own ops already propagate (the
    constraints JAX exports there restate it): a constraint the type already
    satisfies, or one on a constant, is dropped so the matcher sees the
    program as written, any other is a ``reshard``."""
    sharding = constraint(text, meshes, x.ndim)
    if AxisType.Explicit not in sharding.mesh.axis_types:
        return jax.lax.with_sharding_constraint(x, sharding)
    if PartitionSpec.UNCONSTRAINED in sharding.spec:
        raise LiftError(f"an open dimension on Explicit mesh axes is not reproduced: {text[:120]}")
    if isinstance(x, np.ndarray | np.generic):
        return x
    typed = compat.named_sharding_of(jax.typeof(x))
    if typed is not None and _padded(typed.spec, x.ndim) == _padded(sharding.spec, x.ndim):
        return x
    return jax.sharding.reshard(x, sharding)


def _padded(spec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def constraint(text: str, meshes: dict, ndim: int) -> NamedSharding:
    """The `NamedSharding` of an ``sdy.sharding_constraint``'s sharding attribute."""
    m = _SHARDING.match(text.strip())
    if m is None or m.group(1) not in meshes:
        raise LiftError(f"sharding constraint not reproduced: {text[:120]}")
    dims = [d.strip() for d in _split_dims(m.group(2))]
    if len(dims) != ndim:
        raise LiftError(f"sharding constraint of rank {len(dims)} on rank {ndim}: {text[:120]}")
    spec = []
    for dim in dims:
        d = _DIM.fullmatch(dim)
        if d is None:  # sub-axes, priorities, an open dimension with axes
            raise LiftError(f"sharding constraint dimension {dim!r} not reproduced: {text[:120]}")
        if dim == "{?}":
            spec.append(PartitionSpec.UNCONSTRAINED)
            continue
        names = tuple(re.findall(r'"(\w+)"', d.group(1)))
        spec.append(None if not names else names[0] if len(names) == 1 else names)
    return NamedSharding(meshes[m.group(1)], PartitionSpec(*spec))


def _split_dims(body: str) -> list[str]:
    if not body.strip():
        return []
    dims, depth, start = [], 0, 0
    for i, c in enumerate(body):
        depth += c == "{"
        depth -= c == "}"
        if c == "," and depth == 0:
            dims.append(body[start:i])
            start = i + 1
    dims.append(body[start:])
    return dims
