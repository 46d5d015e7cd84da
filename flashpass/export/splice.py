"""The splice route: replace only a site's ops with a call to an exported kernel.

The module is lifted as for the lift route, recording which StableHLO value
each traced value came from.  The matcher finds the sites in the lifted
jaxpr; each site's output and its q, k, v and side arrays are then values of
the module.  The ops between them (the site's *cut*) are lifted alone as a
small JAX function, rewritten by `flashpass.optimize` and exported for the
artifact's platform; the export's functions are copied into the module under
fresh names, the site's output is replaced by a ``func.call`` to them, and the
cut's ops left without a use are erased.  Every other op of the module is left
as it was.
"""

from __future__ import annotations

import dataclasses

import jax

from flashpass import compat
from flashpass.api import Optimized
from flashpass.graph import build_scopes
from flashpass.match import match_scopes
from flashpass.placement import trace_time_only
from flashpass.report import Report

from . import combine, ops
from .lift import _functions, _Interpreter, prepare
from .report import ExportReport
from .values import LiftError, tensor_aval

#: Ops of a cut that may hold regions: their bodies read only their own arguments.
_ISOLATED_REGIONS = ("stablehlo.reduce",)


class SpliceError(Exception):
    """A site cannot be spliced (the message says why)."""


@dataclasses.dataclass
class _Cut:
    root: object  # the MLIR value the kernel's output replaces
    leaves: list  # the MLIR values the cut reads, in a fixed order
    ops: list  # the cut's ops, in block order
    position: int  # the root op's index in its block


def splice(exp: jax.export.Exported, platforms, options, planned) -> tuple:
    """``(Exported, ExportReport)``: ``exp`` with each site the lift route would
    rewrite (``planned``, its `_Plan`) replaced in place, or ``exp`` unchanged."""
    platforms = tuple(platforms)

    def kept(reason, report=None):
        by = {} if report is None else report.by_platform
        first = Report() if report is None else report
        return exp, ExportReport(
            fallbacks=first.fallbacks,
            unrecognised=first.unrecognised,
            route="kept",
            kept_reason=reason,
            platforms=platforms,
            by_platform=by,
        )

    if planned.report.route == "kept":
        return kept(planned.report.kept_reason)
    if len(platforms) > 1 or platforms != tuple(exp.platforms):
        return kept(
            "the splice route splices single-platform artifacts on their own platform "
            "(one call to an exported kernel cannot dispatch on the platform index; "
            "the lift route joins per-platform rewrites)"
        )
    if exp.nr_devices != 1:
        return kept("the splice route splices single-device artifacts")
    if planned.lifted.islands:
        return kept("the splice route does not splice artifacts with opaque islands")
    if not planned.report.rewrites:
        return kept("no attention site is rewritten (the report says why)", planned.report)

    platform = platforms[0]
    context = compat.mlir_context()
    module = compat.parse_module(exp.mlir_module_serialized, context)
    try:
        cuts, notes = _cuts(module, exp, platform)
    except LiftError as err:
        return kept(str(err))
    reports, done = [], 0
    with context:
        for cut in sorted(cuts, key=lambda c: -c.position):  # downstream first
            try:
                report = _splice_one(module, cut, platform, options, done)
            except SpliceError as err:
                notes.append(str(err))
                continue
            reports.append(report)
            done += 1
    if not done:
        return kept("no site could be spliced: " + "; ".join(notes), planned.report)
    new = compat.exported_with_module(exp, compat.module_to_artifact(module))
    rewrites = [r for report in reports for r in report.rewrites]
    merged = Report(
        rewrites=rewrites,
        fallbacks=planned.report.fallbacks,
        unrecognised=planned.report.unrecognised,
        platform=platform,
        jax_version=jax.__version__,
    )
    return new, ExportReport(
        rewrites=rewrites,
        fallbacks=merged.fallbacks,
        unrecognised=merged.unrecognised,
        platform=platform,
        jax_version=merged.jax_version,
        route="splice",
        platforms=platforms,
        by_platform={platform: merged},
        splice_notes=notes,
    )


def _cuts(module, exp, platform) -> tuple[list, list]:
    """Each site's cut in ``module`` (parsed in the splice's context), and notes
    on the sites that have none."""
    lifted = prepare(module)
    record: list = []
    fn = lifted.function(0, (platform,), record=record)
    kept_avals = [exp.in_avals[i] for i in exp.module_kept_var_idx]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in kept_avals]
    n_out = len(lifted.out_avals)

    def traced(*arrays):
        record.clear()
        outs = fn(*arrays)
        return (*outs, *(t for _, t in record))

    closed = jax.make_jaxpr(traced)(*structs)
    jaxpr, _ = compat.closed_parts(closed)
    extra = jaxpr.outvars[n_out:]
    # Each variable of the lifted jaxpr that is a module value: which value.
    where: dict = {}
    for (value, _), var in zip(record, extra, strict=True):
        if not compat.is_literal(var):
            where.setdefault(var, value)
    main = _functions(module)["main"]
    arguments = list(main.regions[0].blocks[0].arguments)
    arguments = arguments[1:] if lifted.has_platform_index else arguments
    for var, value in zip(jaxpr.invars, arguments, strict=True):
        where.setdefault(var, value)

    used = [True] * n_out + [False] * len(extra)
    scopes = build_scopes(compat.dce_closed_jaxpr(closed, used))
    sites, _ = match_scopes(scopes)
    cuts, notes, roots = [], [], set()
    for scope, site in sites:
        key = site.root.out
        if scope.prefix != () or key is None or key[0] != () or key[1] not in where:
            notes.append(f"the site at {site.location} does not end at a value of the module")
            continue
        root = where[key[1]]
        if root in roots:
            continue  # a function inlined twice: its one body is spliced once
        stops = set()
        for atom in site.atoms:
            if isinstance(atom, tuple) and atom[0] == () and atom[1] in where:
                stops.add(where[atom[1]])
        try:
            cuts.append(_cut(root, stops))
        except SpliceError as err:
            notes.append(f"the site at {site.location}: {err}")
            continue
        roots.add(root)
    # Two cuts that share ops cannot both be spliced: the later is kept.
    taken: set = set()
    out = []
    for cut in cuts:
        mine = {id(op) for op in cut.ops}
        if mine & taken:
            notes.append("two sites share ops; the second is kept")
            continue
        taken |= mine
        out.append(cut)
    return out, notes


def _cut(root, stops) -> _Cut:
    """The ops from ``stops`` (and the block's arguments) to ``root``."""
    ir = compat.ir_module()
    if isinstance(root.owner, ir.Block):
        raise SpliceError("its output is an argument")
    root_op = root.owner.operation
    block = root_op.block
    order = {_op_id(op): i for i, op in enumerate(block.operations)}
    inside, leaves, seen = {}, [], set()
    work = [root]
    while work:
        value = work.pop()
        vid = _value_id(value)
        if vid in seen:
            continue
        seen.add(vid)
        if value in stops or isinstance(value.owner, ir.Block):
            leaves.append(value)
            continue
        op = value.owner.operation
        if _op_id(op) not in order:
            raise SpliceError("its ops are not in one block")
        if len(op.regions) and op.name not in _ISOLATED_REGIONS:
            raise SpliceError(f"it holds {op.name}, whose regions may read values around it")
        inside[_op_id(op)] = op
        work.extend(op.operands)
    ops_in_order = [op for op in block.operations if _op_id(op) in inside]
    leaves.sort(key=_leaf_order(order))
    return _Cut(root, leaves, ops_in_order, order[_op_id(root_op)])


def _leaf_order(order):
    ir = compat.ir_module()

    def key(value):
        if isinstance(value.owner, ir.Block):
            return (-1, value.arg_number)
        return (order.get(_op_id(value.owner.operation), -1), value.result_number)

    return key


def _op_id(op):
    return op.operation if hasattr(op, "operation") else op


def _value_id(value):
    return value


def _splice_one(module, cut: _Cut, platform: str, options, index: int) -> Report:
    """Replace ``cut`` in ``module`` with a call to its rewritten export."""
    from .api import _OPTIMIZE_PLATFORM

    ir = compat.ir_module()
    func = compat.func_dialect()
    lifted = prepare(module)
    root_aval = tensor_aval(cut.root.type)

    def site(*arrays):
        interp = _Interpreter(lifted, (platform,))
        interp.envs.append(dict(zip(cut.leaves, arrays, strict=True)))
        env = interp.envs[-1]
        for op in cut.ops:
            name = op.operation.name
            results = interp.run_op(op, name, [env[v] for v in op.operands])
            env.update(zip(op.results, results, strict=True))
        return ops.as_output(env[cut.root], root_aval)

    structs = [tensor_aval(v.type) for v in cut.leaves]
    structs = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in structs]
    optimized = Optimized(site, platform=_OPTIMIZE_PLATFORM[platform], **options)
    with trace_time_only():
        report = optimized.explain(*structs)
        if len(report.rewrites) != 1:
            raise SpliceError(f"its cut alone has {len(report.rewrites)} rewritten sites, not 1")
        kernel = jax.export.export(jax.jit(optimized), platforms=(platform,))(*structs)
    kernel_module = compat.parse_module(kernel.mlir_module_serialized, module.context)
    with ir.InsertionPoint(module.body):
        callee = combine._copy_functions(kernel_module, f"_flashpass_splice{index}_")
    symbol = ir.FlatSymbolRefAttr.get(ir.StringAttr(callee.sym_name).value)
    args = [cut.leaves[j] for j in kernel.module_kept_var_idx]
    with ir.InsertionPoint(cut.root.owner.operation), cut.root.owner.operation.location:
        call = func.CallOp([cut.root.type], symbol, args)
    cut.root.replace_all_uses_with(call.results[0])
    for op in reversed(cut.ops):  # the cut's ops left without a use
        if all(not list(r.uses) for r in op.results):
            op.operation.erase()
    return report
