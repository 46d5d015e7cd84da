"""Opaque islands: an op the lifter has no rule for, called as a module of its own.

The op is cloned into a one-op ``main`` and that module is called through
`jax.export` (``Exported.call``), so the lifted program keeps it byte for
byte and the pass sees one opaque call.  Islands have no derivative: `jax.grad`
through one raises, and the report names it.
"""

from __future__ import annotations

from flashpass import compat

from .values import LiftError, tensor_aval


def call_island(op, operands: list, platforms) -> list:
    """Call ``op`` on ``operands`` (arrays) through a one-op exported module."""
    if len(op.regions) or "called_computations" in op.attributes:
        raise LiftError(
            f"{op.operation.name} has no lifting rule and holds regions or calls other "
            "functions, so it cannot be kept as an island"
        )
    module = _one_op_module(op)
    in_avals = [tensor_aval(v.type) for v in op.operands]
    out_avals = [tensor_aval(r.type) for r in op.results]
    exp = compat.exported_from_module(
        compat.module_to_artifact(module),
        fun_name=op.operation.name,
        in_avals=in_avals,
        out_avals=out_avals,
        platforms=platforms[:1],
    )
    outs = exp.call(*operands)
    return [outs] if len(out_avals) == 1 else list(outs)


def _one_op_module(op):
    ir = compat.ir_module()
    func = compat.func_dialect()
    with op.context, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            ftype = ir.FunctionType.get([v.type for v in op.operands], [r.type for r in op.results])
            main = func.FuncOp("main", ftype)
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = main.add_entry_block()
            with ir.InsertionPoint(block):
                clone = op.operation.clone()
                for i, arg in enumerate(block.arguments):
                    clone.operands[i] = arg
                func.ReturnOp(list(clone.results))
    return module
