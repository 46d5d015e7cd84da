"""The splice route: replace only a site's ops with a call to an exported kernel.

The module is lifted as for the lift route, recording which StableHLO value
each traced value came from.  The matcher finds the sites in the lifted
jaxpr; each site's output and its q, k, v and side arrays are then values of
the module.  The ops between them (the site's *cut*) are lifted alone as a
small JAX function, rewritten by `flashpass.optimize` and exported for each of
the artifact's platforms (several are joined as `combine.join` joins the lift
route's, and the call passes the platform index on); the export's functions are
copied into the module under fresh names, the site's output is replaced by a
``func.call`` to them, and the cut's ops left without a use are erased.  Every
other op of the module is left as it was.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from flashpass import compat
from flashpass.api import Optimized
from flashpass.graph import build_scopes
from flashpass.patterns import match_scopes
from flashpass.placement import trace_time_only
from flashpass.report import Report

from . import combine, islands, ops
from .lift import (
    _PLATFORM_INDEX,
    OP_SCOPE,
    LiftedModule,
    _arg_attrs,
    _functions,
    _Interpreter,
    prepare,
)
from .report import ExportReport, SiteRoute, relocated
from .values import LiftError, tensor_aval


class SpliceError(Exception):
    """A site cannot be spliced (the message says why)."""


@dataclasses.dataclass
class _Cut:
    root: object  # the MLIR value the kernel's output replaces
    leaves: list  # the MLIR values the cut reads, in a fixed order
    ops: list  # the cut's ops, in block order
    position: int  # the root op's index in its block
    found: str = ""  # how it was found, when not in the module lifted whole


def splice(exp: jax.export.Exported, platforms, options, planned) -> tuple:
    """``(Exported, ExportReport)``: ``exp`` with each site the lift route would
    rewrite (``planned``, its `_Plan`) replaced in place, or ``exp`` unchanged.

    Where the lift route cannot lift the whole module (``planned.lift_error``),
    the sites are found in their own blocks instead (`_cuts_in_blocks`): only
    each candidate's ops are lifted."""
    platforms = tuple(platforms)
    x64 = planned.report.needs_x64

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
            needs_x64=x64,
        )

    whole = planned.report.route != "kept"
    if not whole and planned.lift_error is None:
        return kept(planned.report.kept_reason)
    if platforms != tuple(exp.platforms):
        return kept("the splice route splices an artifact for its own platforms (no retargeting)")
    if exp.nr_devices != 1:
        return kept("the splice route splices single-device artifacts")
    if whole and not any(r.rewrites for r in planned.report.by_platform.values()):
        return kept("no attention site is rewritten (the report says why)", planned.report)

    context = compat.mlir_context()
    module = compat.parse_module(exp.mlir_module_serialized, context)
    how = "found in the module lifted whole"
    try:
        if whole:
            cuts, notes = _cuts(module, exp, platforms[0])
            cuts, notes = _nested(module, platforms[0], cuts, notes)
        else:
            cuts, notes = _cuts_in_blocks(module, platforms[0])
            how = f"found in its own block (the lift route keeps the module: {planned.lift_error})"
    except LiftError as err:
        return kept(str(err))
    reports, done, sites = {p: [] for p in platforms}, 0, []
    with context:
        for cut in sorted(cuts, key=lambda c: -c.position):  # downstream first
            location = _location(cut.root)
            try:
                by_platform = _splice_one(module, cut, platforms, options, done)
            except SpliceError as err:
                notes.append(str(err))
                sites.append(SiteRoute(location, "kept", str(err)))
                continue
            for p, report in by_platform.items():
                reports[p].append(report)
            found = how if whole and not cut.found else (cut.found if whole else how)
            why = f"{found}; its cut of {len(cut.ops)} ops is replaced by a call to its kernel"
            sites.append(SiteRoute(location, "splice", why))
            done += 1
    if not done:
        return kept(
            "no site could be spliced: " + ("; ".join(notes) or "none was found"),
            planned.report if whole else None,
        )
    new = compat.exported_with_module(exp, compat.module_to_artifact(module))
    new = compat.exported_with_vjp(new, lambda _: _lift_vjp(exp, options))
    by_platform = planned.report.by_platform
    merged = {
        p: Report(
            rewrites=[r for report in reports[p] for r in report.rewrites],
            fallbacks=by_platform[p].fallbacks if p in by_platform else [],
            unrecognised=by_platform[p].unrecognised if p in by_platform else [],
            platform=p,
            jax_version=jax.__version__,
        )
        for p in platforms
    }
    first = merged[platforms[0]]
    return new, ExportReport(
        rewrites=first.rewrites,
        fallbacks=first.fallbacks,
        unrecognised=first.unrecognised,
        platform=first.platform,
        jax_version=first.jax_version,
        route="splice",
        platforms=platforms,
        by_platform=merged,
        splice_notes=notes,
        sites=sites[::-1],
        needs_x64=x64,
    )


_NOT_A_VALUE = "does not end at a value of the module"


def _nested(module, platform, cuts: list, notes: list) -> tuple[list, list]:
    """Sites in a loop body (a ``scan``'s ``while``) are not values of the
    lifted function: they are looked for again in their own blocks."""
    nested = [n for n in notes if _NOT_A_VALUE in n]
    if not nested:
        return cuts, notes
    more, _ = _cuts_in_blocks(module, platform)
    known = {cut.root for cut in cuts}
    found = [cut for cut in more if cut.root not in known]
    if not found:
        return cuts, notes
    rest = [n for n in notes if _NOT_A_VALUE not in n]
    missing = max(len(nested) - len(found), 0)
    return _disjoint(cuts + found, rest + nested[:missing])


def _location(value) -> str:
    """The module's own location of the op defining ``value``."""
    return str(value.owner.location)


def _lift_vjp(exp, options) -> jax.export.Exported:
    """The spliced artifact's derivative: the lift route's, built when asked for.

    A `jax.export` VJP takes the primal inputs and the output cotangents and
    recomputes what it needs (no residuals pass from the forward), so any
    export of the same function's VJP pairs with the spliced forward; the lift
    route's runs the kernels' own backward."""
    from .api import rewrite_and_explain

    lifted, report = rewrite_and_explain(exp, route="lift", backward="lifted", **options)
    if lifted is exp:
        raise ValueError(
            f"the spliced artifact has no derivative: the lift route kept it ({report.kept_reason})"
        )
    return lifted.vjp()


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
            # The last: an op holding the one that made the value (a ``case``
            # on the platform index around a dot_general) is recorded after it.
            where[var] = value
    main = _functions(module)["main"]
    arguments = list(main.regions[0].blocks[0].arguments)
    arguments = arguments[1:] if lifted.has_platform_index else arguments
    for var, value in zip(jaxpr.invars, arguments, strict=True):
        where.setdefault(var, value)

    return _sites(closed, where, n_out, len(extra))


def _sites(closed, where: dict, n_out: int, n_extra: int) -> tuple[list, list]:
    """The cuts of the sites the matcher finds in ``closed`` (a lifted jaxpr
    whose first ``n_out`` outputs are the program's and the others recorded
    values), ``where`` mapping its variables to module values."""
    used = [True] * n_out + [False] * n_extra
    scopes = build_scopes(compat.dce_closed_jaxpr(closed, used))
    sites, _ = match_scopes(scopes)
    cuts, notes, roots = [], [], set()
    for scope, site in sites:
        key = site.root.out
        if scope.prefix != () or key is None or key[0] != () or key[1] not in where:
            notes.append(f"the site at {site.location} {_NOT_A_VALUE}")
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
    return _disjoint(cuts, notes)


def _disjoint(cuts: list, notes: list) -> tuple[list, list]:
    """Two cuts that share ops cannot both be spliced: the later is kept."""
    taken: set = set()
    out = []
    for cut in cuts:
        # A constant hoisted out of a loop body may be read by several cuts.
        mine = {id(op) for op in cut.ops if _op_id(op).name != "stablehlo.constant"}
        if mine & taken:
            notes.append("two sites share ops; the second is kept")
            continue
        taken |= mine
        out.append(cut)
    return out, notes


#: Ops with regions a candidate's slice goes through (a softmax's reductions);
#: any other op with regions ends the slice (its results are read as they are).
_SLICE_REGIONS = ("stablehlo.reduce", "stablehlo.reduce_window")


def _cuts_in_blocks(module, platform) -> tuple[list, list]:
    """Each site's cut, found without lifting the whole module: every
    ``dot_general`` of every block is a candidate output product; the ops it
    reads, back to the block's arguments and to the operands of the product
    before it (the scores'), are lifted alone as a small function and matched,
    and a site found there is cut as `_cuts` cuts one."""
    lifted = LiftedModule(module, (), (), False)
    cuts, notes, roots = [], [], set()
    for block in _blocks(module):
        for op in block.operations:
            if op.operation.name != "stablehlo.dot_general":
                continue
            found = _slice(op, block)
            if found is None:
                continue
            leaves, slice_ops = found
            try:
                closed, where, n_extra = _lift_slice(lifted, op, leaves, slice_ops, platform)
            except LiftError as err:
                notes.append(f"the candidate at {_location(op.results[0])}: {err}")
                continue
            more, more_notes = _sites(closed, where, 1, n_extra)
            notes += more_notes
            for cut in more:
                if cut.root not in roots:
                    roots.add(cut.root)
                    cut.found = "found in its own block"
                    cuts.append(cut)
    return _disjoint(cuts, notes)


def _blocks(module):
    """Every block of every function of ``module``, regions' blocks included."""

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                yield block
                for inner in block.operations:
                    yield from walk(inner.operation)

    for func_op in _functions(module).values():
        yield from walk(func_op.operation)


def _slice(product, block) -> tuple[list, list] | None:
    """``(leaves, ops)``: the ops of ``block`` ``product`` reads, back to the
    block's arguments, values from outside it, ops with other regions and the
    operands of any other ``dot_general``; None when no exponential is among
    them (no softmax reaches the product)."""
    ir = compat.ir_module()
    order = {_op_id(op): i for i, op in enumerate(block.operations)}
    inside, leaves, seen, hoisted = {}, [], set(), {}
    inside[_op_id(product.operation)] = product.operation
    work = list(product.operands)
    while work:
        value = work.pop()
        if value in seen:
            continue
        seen.add(value)
        if _hoisted_constant(value, order):
            hoisted[_op_id(value.owner.operation)] = value.owner.operation
            continue
        if isinstance(value.owner, ir.Block) or _op_id(value.owner.operation) not in order:
            leaves.append(value)
            continue
        op = value.owner.operation
        name = op.name
        if len(op.regions) and name not in _SLICE_REGIONS:
            leaves.append(value)
            continue
        inside[_op_id(op)] = op
        if name == "stablehlo.dot_general":  # the scores: q and k are read as they are
            for operand in op.operands:
                if operand not in seen:
                    seen.add(operand)
                    leaves.append(operand)
            continue
        work.extend(op.operands)
        if len(op.regions):
            work.extend(_captured(op))
    if not any(op.name == "stablehlo.exponential" for op in inside.values()):
        return None
    ops_in_order = [*hoisted.values(), *(op for op in block.operations if _op_id(op) in inside)]
    leaves.sort(key=_leaf_order(order))
    return leaves, ops_in_order


def _lift_slice(lifted, product, leaves, slice_ops, platform):
    """The slice lifted alone: its closed jaxpr (the product's value, then each
    recorded value), which module value each variable is, and how many were recorded."""
    record: list = []
    structs = [tensor_aval(v.type) for v in leaves]
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in structs]
    root = product.results[0]

    def traced(*arrays):
        record.clear()
        interp = _Interpreter(lifted, (platform,))
        env = dict(zip(leaves, arrays, strict=True))
        interp.envs.append(env)
        for op in slice_ops:
            results = interp.run_op(op, op.name, [env[v] for v in op.operands])
            for value, result in zip(op.results, results, strict=True):
                env[value] = result
                if compat.is_tracer(result):
                    record.append((value, result))
        return (ops.as_output(env[root], tensor_aval(root.type)), *(t for _, t in record))

    closed = jax.make_jaxpr(traced)(*structs)
    jaxpr, _ = compat.closed_parts(closed)
    extra = jaxpr.outvars[1:]
    where: dict = {}
    for (value, _), var in zip(record, extra, strict=True):
        if not compat.is_literal(var):
            where[var] = value
    for var, value in zip(jaxpr.invars, leaves, strict=True):
        where.setdefault(var, value)
    return closed, where, len(extra)


def _cut(root, stops) -> _Cut:
    """The ops from ``stops`` (and the block's arguments) to ``root``."""
    ir = compat.ir_module()
    if isinstance(root.owner, ir.Block):
        raise SpliceError("its output is an argument")
    root_op = root.owner.operation
    block = root_op.block
    order = {_op_id(op): i for i, op in enumerate(block.operations)}
    inside, leaves, seen, hoisted = {}, [], set(), {}
    work = [root]
    while work:
        value = work.pop()
        if value in seen:
            continue
        seen.add(value)
        if value in stops or isinstance(value.owner, ir.Block):
            leaves.append(value)
            continue
        if _hoisted_constant(value, order):
            hoisted[_op_id(value.owner.operation)] = value.owner.operation
            continue
        op = value.owner.operation
        if _op_id(op) not in order:
            raise SpliceError("its ops are not in one block")
        inside[_op_id(op)] = op
        work.extend(op.operands)
        if len(op.regions):  # a case's branches read values from around it
            work.extend(_captured(op))
    ops_in_order = [*hoisted.values(), *(op for op in block.operations if _op_id(op) in inside)]
    leaves.sort(key=_leaf_order(order))
    return _Cut(root, leaves, ops_in_order, order[_op_id(root_op)])


def _hoisted_constant(value, order) -> bool:
    """A constant defined outside the block (JAX 0.12 hoists a loop body's
    constants out of its ``while``): lifted with the slice or cut as the
    constant it is, not read as an input (a traced ``-inf`` reduce init or
    scale would hide the softmax from the matcher)."""
    ir = compat.ir_module()
    if isinstance(value.owner, ir.Block):
        return False
    op = value.owner.operation
    return op.name == "stablehlo.constant" and _op_id(op) not in order


def _captured(op) -> list:
    """The values the regions of ``op`` read from outside ``op``."""
    return islands.captured_values(op)


def _leaf_order(order):
    ir = compat.ir_module()

    def key(value):
        if isinstance(value.owner, ir.Block):
            return (-1, value.arg_number)
        return (order.get(_op_id(value.owner.operation), -1), value.result_number)

    return key


def _op_id(op):
    return op.operation if hasattr(op, "operation") else op


def _splice_one(module, cut: _Cut, platforms: tuple, options, index: int) -> dict:
    """Replace ``cut`` in ``module`` with a call to its rewritten export (one per
    platform, joined as `combine.join` joins the lift route's); each platform's report."""
    from .api import _OPTIMIZE_PLATFORM

    ir = compat.ir_module()
    func = compat.func_dialect()
    lifted = LiftedModule(module, (), (), False)  # main's signature is not read
    root_aval = tensor_aval(cut.root.type)
    platform_index, leaves = None, list(cut.leaves)
    if len(platforms) > 1:
        platform_index = _platform_index(cut)
        # Each platform's cut is lifted with the index a constant, as the lift
        # route does: a case on it keeps only that platform's branch.
        leaves = [v for v in leaves if v != platform_index]

    def site_for(platform):
        def site(*arrays):
            interp = _Interpreter(lifted, (platform,))
            env = dict(zip(leaves, arrays, strict=True))
            if platform_index is not None:
                env[platform_index] = np.asarray(platforms.index(platform), np.int32)
            interp.envs.append(env)
            for op in cut.ops:
                name = op.operation.name
                results = interp.run_op(op, name, [env[v] for v in op.operands])
                env.update(zip(op.results, results, strict=True))
            return ops.as_output(env[cut.root], root_aval)

        return site

    structs = [tensor_aval(v.type) for v in leaves]
    structs = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in structs]
    reports, exports = {}, []
    for platform in platforms:
        optimized = Optimized(site_for(platform), platform=_OPTIMIZE_PLATFORM[platform], **options)
        with trace_time_only():
            report = relocated(optimized.explain(*structs), lifted.op_locations, OP_SCOPE)
            if len(report.rewrites) != 1:
                raise SpliceError(
                    f"its cut alone has {len(report.rewrites)} rewritten sites on {platform}, not 1"
                )
            try:
                exports.append(
                    jax.export.export(jax.jit(optimized), platforms=(platform,))(*structs)
                )
            except Exception as err:  # a kernel this host cannot lower for that platform
                raise SpliceError(
                    f"its {platform} kernel cannot be exported from this host "
                    f"({type(err).__name__}: {str(err)[:200]})"
                ) from None
        reports[platform] = report
    kernel = exports[0] if len(exports) == 1 else combine.join(exports, platforms)
    kernel_module = compat.parse_module(kernel.mlir_module_serialized, module.context)
    with ir.InsertionPoint(module.body):
        callee = combine._copy_functions(kernel_module, f"_flashpass_splice{index}_")
    symbol = ir.FlatSymbolRefAttr.get(ir.StringAttr(callee.sym_name).value)
    args = [leaves[j] for j in kernel.module_kept_var_idx]
    if platform_index is not None:
        args.insert(0, platform_index)
    with ir.InsertionPoint(cut.root.owner.operation), cut.root.owner.operation.location:
        call = func.CallOp([cut.root.type], symbol, args)
    cut.root.replace_all_uses_with(call.results[0])
    callees = []
    for op in reversed(cut.ops):  # the cut's ops left without a use
        if all(not list(r.uses) for r in op.results):
            callees += islands.called_names(op)
            op.operation.erase()
    _erase_unused_private(module, callees)
    return reports


def _erase_unused_private(module, names: list) -> None:
    """Erase the private functions among ``names`` (called by erased ops) that
    nothing calls any more, and then those only they called: a helper the cut
    called (JAX's ``@tril`` of a causal mask) would leave its T×S types behind."""
    ir = compat.ir_module()
    work = list(names)
    while work:
        name = work.pop()
        functions = _functions(module)
        func_op = functions.get(name)
        if func_op is None or "sym_visibility" not in func_op.attributes:
            continue
        if ir.StringAttr(func_op.attributes["sym_visibility"]).value != "private":
            continue
        others = (f for n, f in functions.items() if n != name)
        if any(name in islands.called_names(f, direct=False) for f in others):
            continue
        work += islands.called_names(func_op, direct=False)
        func_op.operation.erase()


def _platform_index(cut: _Cut):
    """The platform index the function holding ``cut`` takes (its first argument,
    marked as `jax.export` marks it), which the spliced call passes on."""
    block = cut.root.owner.operation.block
    owner = block.owner
    if owner is None or owner.operation.name != "func.func" or not len(block.arguments):
        raise SpliceError("it is not in a function's body, where the platform index is")
    attrs = _arg_attrs(owner, len(block.arguments))
    if not (attrs and _PLATFORM_INDEX in str(attrs[0])):
        raise SpliceError("the function holding it does not take the platform index")
    return block.arguments[0]
