"""`rewrite` and `explain` for `jax.export.Exported` artifacts (the lift route)."""

from __future__ import annotations

import contextlib
import dataclasses

import jax

from flashpass import compat
from flashpass.api import Optimized
from flashpass.placement import trace_time_only
from flashpass.platforms import KERNEL_PLATFORM_OF, export_platform

from . import combine, sharded
from .lift import OP_SCOPE, LiftedModule, prepare
from .report import ExportReport, SiteRoute, relocated
from .values import LiftError, x64_scope_for

#: jax.export platform names -> flashpass.optimize's platform names.
_OPTIMIZE_PLATFORM = KERNEL_PLATFORM_OF


@dataclasses.dataclass
class _Plan:
    exp: jax.export.Exported
    platforms: tuple
    lifted: LiftedModule | None = None
    layout: sharded.Layout | None = None  # several devices: the meshes and shardings
    optimized: dict = dataclasses.field(default_factory=dict)  # platform -> Optimized
    report: ExportReport | None = None
    lift_error: str | None = None  # why the module could not be lifted whole


def explain(exp: jax.export.Exported, *, platforms=None, **options) -> ExportReport:
    """What `rewrite` would do with ``exp``: each platform's `Report`, the ops kept
    as opaque islands, or why the artifact is kept unchanged.

    ``options`` are `flashpass.optimize`'s (``kernel=``, ``interpret=``, ...);
    the platform of each rewrite is the artifact's (``platforms=`` retargets).
    """
    with _x64_scope(exp):
        return _plan(exp, platforms, options).report


def rewrite(
    exp: jax.export.Exported,
    *,
    platforms=None,
    route: str = "lift",
    backward: str = "auto",
    **options,
) -> jax.export.Exported:
    """``exp`` with its attention sites rewritten to flash-attention kernels.

    The result is an `Exported` with the same input and output structure,
    avals and platforms (``platforms=`` retargets a single-platform module);
    it calls, serializes (use ``vjp_order=1`` to ship the derivative) and
    deserializes like any other.  Its derivative (``backward=``): by default
    the artifact's own where it carries one (``has_vjp()``: exported in this
    process, or serialized with ``vjp_order=1``), which keeps what the
    exporter differentiated (``stop_gradient``, custom derivatives) but runs
    the original backward; ``backward="lifted"``: the rewritten program's,
    the kernels' own backward, exact except where the exporter's derivative
    rules are lost (StableHLO holds the primal ops only; docs/stablehlo.md).
    An artifact that cannot be lifted (sharded over several devices,
    shape-polymorphic, with effects) is returned unchanged; `explain` says why.
    An artifact exported over several devices keeps its input and output
    shardings and its sharding constraints (a mesh of all-Auto or
    all-Explicit axes; this host needs as many devices).

    ``route="splice"`` replaces only each site's ops with a call to the
    rewritten site, exported on its own, and leaves every other op of the
    module as it was (single-device artifacts, each platform its kernel; with
    ``backward="lifted"`` its derivative is the lift route's).  See
    docs/stablehlo.md.
    """
    new, _ = rewrite_and_explain(
        exp, platforms=platforms, route=route, backward=backward, **options
    )
    return new


def rewrite_and_explain(
    exp: jax.export.Exported,
    *,
    platforms=None,
    route: str = "lift",
    backward: str = "auto",
    **options,
) -> tuple[jax.export.Exported, ExportReport]:
    """`rewrite` and `explain` at once (the module is lifted once)."""
    if route not in ("lift", "splice"):
        raise ValueError(f"route={route!r}: 'lift' or 'splice'")
    if backward not in BACKWARDS:
        raise ValueError(f"backward={backward!r}: one of {', '.join(map(repr, BACKWARDS))}")
    if backward == "artifact" and isinstance(exp, jax.export.Exported) and not exp.has_vjp():
        raise ValueError(
            "backward='artifact': this artifact carries no derivative "
            "(serialize it with vjp_order=1, or use backward='lifted')"
        )
    new, report = _rewrite(exp, platforms, route, options)
    if new is not exp and backward != "lifted" and exp.has_vjp():
        # The artifact's own derivative: what its exporter differentiated,
        # stop_gradient and custom_jvp/vjp rules included, which StableHLO's
        # primal ops do not hold (a jax.export VJP recomputes from the primal
        # inputs, so it pairs with any forward of the same function).
        new = compat.exported_with_vjp(new, lambda _: exp.vjp())
        report = dataclasses.replace(report, backward="artifact")
    return new, report


#: ``backward=``: "auto" (the artifact's own derivative where it carries one,
#: else the lifted program's), "artifact" (the artifact's own, required) or
#: "lifted" (the lifted program's: the kernels' backward; see docs/stablehlo.md).
BACKWARDS = ("auto", "artifact", "lifted")


def _rewrite(exp, platforms, route, options):
    with _x64_scope(exp):
        plan = _plan(exp, platforms, options)
        if route == "splice":
            from .splice import splice

            return splice(exp, plan.platforms, options, plan)
        if plan.report.route == "kept":
            return exp, plan.report
        new = _export(plan)
    if (new.in_avals, new.out_avals) != (exp.in_avals, exp.out_avals):
        reason = "the re-exported avals differ from the artifact's"
        return exp, ExportReport(route="kept", kept_reason=reason, platforms=plan.platforms)
    if compat.exported_hlo_shardings(new) != compat.exported_hlo_shardings(exp):
        reason = "the re-exported shardings differ from the artifact's"
        return exp, ExportReport(route="kept", kept_reason=reason, platforms=plan.platforms)
    return new, plan.report


def _x64_scope(exp):
    """x64 on while lifting and exporting an artifact with 64-bit types (an
    int64 token input), so they are not narrowed to 32 bits: the result keeps
    the artifact's avals and is called as the original is."""
    if not isinstance(exp, jax.export.Exported):  # `_plan` says what is wrong with it
        return contextlib.nullcontext()
    return x64_scope_for(exp.mlir_module())


def _plan(exp, platforms, options) -> _Plan:
    if not isinstance(exp, jax.export.Exported):
        raise TypeError(f"expected a jax.export.Exported (see flashpass.export.load), got {exp!r}")
    if "platform" in options:
        raise TypeError("rewrite/explain take platforms=(...); each platform gets its kernel")
    if platforms is not None:  # one vocabulary: "gpu" is the artifact's cuda or rocm
        host = jax.default_backend()
        platforms = [export_platform(p, exp.platforms, host) for p in platforms]
    platforms = tuple(exp.platforms if platforms is None else platforms)
    plan = _Plan(exp, platforms)
    reason = _not_liftable(exp, platforms)
    if reason is None:
        try:
            _lift(plan, options)
        except LiftError as err:
            reason = plan.lift_error = str(err)
    if reason is not None:
        plan.report = ExportReport(route="kept", kept_reason=reason, platforms=platforms)
    plan.report.needs_x64 = needs_x64(exp)
    return plan


_WIDE = {"int64", "uint64", "float64", "complex128"}


def needs_x64(exp) -> bool:
    """Whether calling ``exp`` takes x64 on: an input or output with a 64-bit type."""
    return any(str(a.dtype) in _WIDE for a in (*exp.in_avals, *exp.out_avals))


def _not_liftable(exp, platforms) -> str | None:
    if exp.nr_devices != 1 and len(platforms) > 1:
        return "the artifact is sharded and has several platforms (lift keeps one of the two)"
    if exp.ordered_effects or exp.unordered_effects:
        return "the artifact has effects (lift keeps effect-free programs)"
    if any(not all(isinstance(d, int) for d in a.shape) for a in exp.in_avals):
        return "the artifact is shape-polymorphic (lift keeps static shapes)"
    for p in platforms:
        if p not in exp.platforms and len(exp.platforms) > 1:
            return f"platform {p} is not one of the artifact's {exp.platforms}"
    return None


def _structs(avals) -> list:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def _lift(plan: _Plan, options) -> None:
    exp = plan.exp
    module = compat.parse_module(exp.mlir_module_serialized, compat.mlir_context())
    lifted = prepare(module)
    plan.layout = sharded.layout(exp, module)
    in_shardings = (None,) * len(exp.in_avals)
    if plan.layout is not None:
        lifted.meshes = plan.layout.meshes
        in_shardings = plan.layout.in_shardings
    kept = [exp.in_avals[i] for i in exp.module_kept_var_idx]
    if [(a.shape, a.dtype) for a in lifted.in_avals] != [(a.shape, a.dtype) for a in kept]:
        raise LiftError("main's inputs do not match the artifact's avals")
    plan.lifted = lifted
    reports = {}
    for p in plan.platforms:
        index = exp.platforms.index(p) if p in exp.platforms else 0
        fn = lifted.function(index, (p,))
        fn.__name__ = exp.fun_name if exp.fun_name.isidentifier() else "main"
        optimized = Optimized(fn, platform=_OPTIMIZE_PLATFORM[p], **options)
        plan.optimized[p] = optimized
        structs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=in_shardings[i])
            for i, a in ((i, exp.in_avals[i]) for i in exp.module_kept_var_idx)
        ]
        with trace_time_only():  # an artifact cannot carry custom_partitioning
            report = optimized.explain(*structs)
        reports[p] = relocated(report, lifted.op_locations, OP_SCOPE)
    first = reports[plan.platforms[0]]
    why = "the module was lifted whole and re-exported with the site rewritten"
    sites = [SiteRoute(str(r.location), "lift", why) for r in first.rewrites]
    sites += [SiteRoute(str(f.location), "kept", f.reason) for f in first.fallbacks]
    plan.report = ExportReport(
        sites=sites,
        rewrites=first.rewrites,
        fallbacks=first.fallbacks,
        errors=first.errors,
        unrecognised=first.unrecognised,
        platform=plan.platforms[0],
        jax_version=first.jax_version,
        route="lift",
        platforms=plan.platforms,
        islands=list(lifted.islands.values()),
        by_platform=reports,
    )


def _export(plan: _Plan) -> jax.export.Exported:
    """Export each platform's rewritten program, then join them (`combine.join`)."""
    exp, platforms, layout = plan.exp, plan.platforms, plan.layout
    structs, shardings = _structs(exp.in_avals), {}
    if layout is not None:
        structs = layout.structs(exp.in_avals, layout.in_shardings)
        # The inputs' shardings ride on their structs; the outputs' are a pytree.
        outs = jax.tree_util.tree_unflatten(exp.out_tree, layout.out_shardings)
        shardings = dict(out_shardings=outs)
    args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, structs)
    exps = []
    for p in platforms:
        program = jax.jit(_program(exp, plan.optimized[p]), **shardings)
        with trace_time_only():
            exps.append(jax.export.export(program, platforms=(p,))(*args, **kwargs))
    return exps[0] if len(exps) == 1 else combine.join(exps, platforms)


def _program(exp, optimized):
    """The artifact's signature around the rewritten lifted function."""
    kept_idx = exp.module_kept_var_idx

    def main(*args, **kwargs):
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        outs = optimized(*[leaves[i] for i in kept_idx])
        return jax.tree_util.tree_unflatten(exp.out_tree, list(outs))

    return main
