"""One multi-platform artifact from single-platform ones, each with its own kernels.

`lax.platform_dependent` lowers every branch for every platform of the
export, and a Pallas TPU kernel has no CPU lowering, so a rewritten
``("cpu", "tpu")`` artifact is exported once per platform and the modules
are joined: their functions are copied under per-platform names and the new
``main`` dispatches on the platform index (`jax.export`'s calling convention
for multi-platform modules) with a ``stablehlo.case``.  The derivative is
joined the same way, from each platform's own.
"""

from __future__ import annotations

import jax

from flashpass import compat


def join(exps: list, platforms: tuple) -> jax.export.Exported:
    """A multi-platform `Exported` running ``exps[i]`` (single-platform) on ``platforms[i]``."""
    first = exps[0]
    for exp in exps:
        if len(exp.platforms) != 1 or exp.in_avals != first.in_avals:
            raise ValueError("join takes single-platform exports of one signature")
    module = _joined_module(exps, platforms)
    joined = compat.exported_from_module(
        compat.module_to_artifact(module),
        fun_name=first.fun_name,
        in_avals=first.in_avals,
        out_avals=first.out_avals,
        platforms=platforms,
        in_tree=first.in_tree,
        out_tree=first.out_tree,
    )
    if all(e.has_vjp() for e in exps):
        joined = compat.exported_with_vjp(
            joined, lambda _: join([e.vjp() for e in exps], platforms)
        )
    return joined


def _joined_module(exps, platforms):
    ir = compat.ir_module()
    func = compat.func_dialect()
    sh = compat.stablehlo_dialect()
    context = compat.mlir_context()
    modules = [compat.parse_module(e.mlir_module_serialized, context) for e in exps]
    with context, ir.Location.unknown():
        joined = ir.Module.create()
        for name in ("mhlo.num_partitions", "mhlo.num_replicas"):
            if name in modules[0].operation.attributes:
                joined.operation.attributes[name] = modules[0].operation.attributes[name]
        mains = []
        with ir.InsertionPoint(joined.body):
            for platform, module in zip(platforms, modules, strict=True):
                mains.append(_copy_functions(module, f"_flashpass_{platform}_"))
            index_type = ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))
            array_types = [
                ir.RankedTensorType.get(a.shape, compat.ir_element_type(a.dtype))
                for a in exps[0].in_avals
            ]
            result_types = list(ir.FunctionType(mains[0].type).results)
            main = func.FuncOp(
                "main", ir.FunctionType.get([index_type, *array_types], result_types)
            )
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            constant = ir.DictAttr.get(
                {"jax.global_constant": ir.StringAttr.get("_platform_index")}
            )
            empty = ir.DictAttr.get({})
            main.arg_attrs = ir.ArrayAttr.get([constant] + [empty] * len(array_types))
            block = main.add_entry_block()
            with ir.InsertionPoint(block):
                index, *arrays = block.arguments
                case = sh.CaseOp(result_types, index=index, num_branches=len(mains))
                for i, (exp, callee) in enumerate(zip(exps, mains, strict=True)):
                    branch = case.regions[i].blocks.append()
                    with ir.InsertionPoint(branch):
                        args = [arrays[j] for j in exp.module_kept_var_idx]
                        symbol = ir.FlatSymbolRefAttr.get(ir.StringAttr(callee.sym_name).value)
                        call = func.CallOp(result_types, symbol, args)
                        sh.ReturnOp(list(call.results))
                func.ReturnOp(list(case.results))
    return joined


def _copy_functions(module, prefix: str):
    """Clone ``module``'s functions here, renamed with ``prefix``; its ``main`` clone."""
    ir = compat.ir_module()
    main = None
    for op in module.body.operations:
        if op.operation.name != "func.func":
            raise ValueError(f"cannot join a module holding {op.operation.name}")
        clone = op.operation.clone()
        name = ir.StringAttr(clone.attributes["sym_name"]).value
        clone.attributes["sym_name"] = ir.StringAttr.get(prefix + name)
        clone.attributes["sym_visibility"] = ir.StringAttr.get("private")
        _rename_calls(clone, prefix)
        if name == "main":
            main = clone.opview
    if main is None:
        raise ValueError("a module without main")
    return main


def _rename_calls(op, prefix: str) -> None:
    ir = compat.ir_module()
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "func.call":
                    callee = ir.FlatSymbolRefAttr(inner.attributes["callee"]).value
                    inner.attributes["callee"] = ir.FlatSymbolRefAttr.get(prefix + callee)
                if "called_computations" in inner.attributes:
                    raise ValueError("cannot join a module whose custom calls name functions")
                _rename_calls(inner.operation, prefix)
