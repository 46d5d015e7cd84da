"""Opaque islands: an op the lifter has no rule for, called as a module of its own.

The op is cloned into a one-op ``main`` and that module is called through
`jax.export` (``Exported.call``), so the lifted program keeps it byte for
byte and the pass sees one opaque call.  An op holding regions (``sort``,
``select_and_scatter``, a ``while`` with several blocks, ...) is cloned with
them: values its regions read from around it become extra arguments of the
island's ``main``, and the functions it calls (``called_computations``, a
``func.call`` in a body) are copied along.  Islands have no derivative:
`jax.grad` through one raises, and the report names it.
"""

from __future__ import annotations

import re

from flashpass import compat

from .values import tensor_aval

_SYMBOL = re.compile(r"@([A-Za-z_][\w.$-]*)")


def call_island(op, operands: list, platforms, functions=None, captured=()) -> list:
    """Call ``op`` on ``operands`` (arrays), then the values ``captured`` by its
    regions (their values), through a one-op exported module.  ``functions``
    (name -> ``func.func``) are the module's, which the op may call."""
    # A constant read by a region is cloned next to the op (where XLA's export
    # sinks it into the region: a sort's comparator may read no argument).
    constants = [v for v, _ in captured if _is_constant_op(v)]
    captured = [(v, x) for v, x in captured if not _is_constant_op(v)]
    captured_values = [value for value, _ in captured]
    module = _one_op_module(op, captured_values, functions or {}, constants)
    in_avals = [tensor_aval(v.type) for v in [*op.operands, *captured_values]]
    out_avals = [tensor_aval(r.type) for r in op.results]
    exp = compat.exported_from_module(
        compat.module_to_artifact(module),
        fun_name=op.operation.name,
        in_avals=in_avals,
        out_avals=out_avals,
        platforms=platforms[:1],
    )
    outs = exp.call(*operands, *(x for _, x in captured))
    return [outs] if len(out_avals) == 1 else list(outs)


def captured_values(op) -> list:
    """The values the regions of ``op`` read from outside ``op``, in first-use order."""
    inside, uses = set(), []

    def walk(parent):
        for region in parent.regions:
            for block in region.blocks:
                inside.update(block.arguments)
                for inner in block.operations:
                    uses.extend(inner.operands)
                    inside.update(inner.results)
                    walk(inner.operation)

    walk(op.operation)
    out = []
    for v in uses:
        if v not in inside and v not in out:
            out.append(v)
    return out


def called_names(op, direct: bool = True) -> list:
    """The symbols ``op`` names (``func.call``'s callee, ``called_computations``,
    and with ``direct=False`` any inside its regions)."""
    if direct and not len(op.regions):
        text = " ".join(
            str(op.attributes[a]) for a in ("callee", "called_computations") if a in op.attributes
        )
    else:
        text = str(op)
    return list(dict.fromkeys(_SYMBOL.findall(text)))


def _called(op, functions: dict) -> list:
    """The module's functions ``op`` calls, directly or through them."""
    found, work = [], [str(op)]
    while work:
        for name in _SYMBOL.findall(work.pop()):
            if name in functions and name not in found:
                found.append(name)
                work.append(str(functions[name]))
    return found


def _is_constant_op(value) -> bool:
    owner = value.owner
    return hasattr(owner, "operation") and owner.operation.name == "stablehlo.constant"


def _one_op_module(op, captured: list, functions: dict, constants=()):
    ir = compat.ir_module()
    func = compat.func_dialect()
    # Every function the op names: a region's calls, ``called_computations``,
    # a composite's ``decomposition`` (a module without it does not verify).
    called = _called(op, functions)
    with op.context, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            types = [v.type for v in [*op.operands, *captured]]
            ftype = ir.FunctionType.get(types, [r.type for r in op.results])
            main = func.FuncOp("main", ftype)
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = main.add_entry_block()
            with ir.InsertionPoint(block):
                copies = [c.owner.operation.clone().results[0] for c in constants]
                clone = op.operation.clone()
                n = len(op.operands)
                for i in range(n):
                    clone.operands[i] = block.arguments[i]
                mapping = dict(zip(captured, block.arguments[n:], strict=True))
                mapping.update(zip(constants, copies, strict=True))
                if mapping:
                    _rebind(clone, mapping)
                func.ReturnOp(list(clone.results))
            for name in called:
                if name != "main":
                    copy = functions[name].operation.clone()
                    copy.attributes["sym_visibility"] = ir.StringAttr.get("private")
    return module


def _rebind(op, mapping: dict) -> None:
    """Point every use, inside ``op``'s regions, of a key of ``mapping`` at its value."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                for i, v in enumerate(inner.operands):
                    if v in mapping:
                        inner.operation.operands[i] = mapping[v]
                _rebind(inner.operation, mapping)
