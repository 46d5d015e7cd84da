"""Lift a StableHLO module to a JAX function, op by op.

Each StableHLO op becomes the `lax` op a traced JAX program would contain
(see `ops.py` for the table), ``func.call`` is inlined, and regions (reduce
bodies, while, case, if) are interpreted in place.  The JAX function's jaxpr
is what the pass matches, so a lifted program is rewritten exactly as the
same program written in JAX would be.  An op without a lifting rule becomes
an opaque island: it is called as a one-op module of its own (`islands.py`)
and reported.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from flashpass import compat

from . import expansions, islands, ops
from .values import LiftError, Splat, tensor_aval

#: The argument attribute JAX puts on the platform index of a multi-platform module.
_PLATFORM_INDEX = "_platform_index"
#: The name scope each lifted op is traced under: ``OP_SCOPE`` and its index in
#: `LiftedModule.op_locations` (`flashpass.export.report.relocated` reads it back).
OP_SCOPE = "stablehlo_op_"


@dataclasses.dataclass(frozen=True)
class Island:
    """An op the lifter has no rule for, called as its own module."""

    op: str
    location: str
    count: int = 1


@dataclasses.dataclass
class LiftedModule:
    """A parsed module ready to be called as a JAX function of its array inputs."""

    module: object
    in_avals: tuple  # the arrays ``main`` takes (without the platform index)
    out_avals: tuple
    has_platform_index: bool
    islands: dict = dataclasses.field(default_factory=dict)  # op name -> Island
    meshes: dict = dataclasses.field(default_factory=dict)  # sdy mesh -> Mesh (several devices)
    #: Each lifted op's ``loc(...)``, by the index its name scope carries
    #: (``OP_SCOPE``): the report points at the artifact's own locations.
    op_locations: list = dataclasses.field(default_factory=list)
    #: Each block's elementwise regions of one input (`expansions.plan`), found
    #: and probed once: they depend on the module's ops and constants only.
    plans: dict = dataclasses.field(default_factory=dict)

    def function(self, platform_index: int = 0, platforms=("cpu",), record=None):
        """A JAX function ``f(*arrays) -> tuple of arrays`` computing ``main``.

        ``platform_index`` selects the platform-specific branches of a
        multi-platform module (its ``case`` on the platform index is resolved
        while lifting).  ``record``, a list, receives ``(MLIR value, traced
        value)`` for each op result lifted to a traced value (the splice
        route finds a site's values in the module through it)."""

        def lifted(*arrays):
            interp = _Interpreter(self, platforms)
            interp.record = record
            args = list(arrays)
            if self.has_platform_index:
                args.insert(0, np.asarray(platform_index, np.int32))
            outs = interp.call("main", args)
            return tuple(ops.as_output(x, a) for x, a in zip(outs, self.out_avals, strict=True))

        return lifted


def prepare(module) -> LiftedModule:
    """Check ``main``'s signature and collect what lifting needs."""
    main = _functions(module).get("main")
    if main is None:
        raise LiftError("the module has no function named main")
    ir = compat.ir_module()
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    inputs = list(ftype.inputs)
    arg_attrs = _arg_attrs(main, len(inputs))
    has_index = bool(arg_attrs) and _PLATFORM_INDEX in str(arg_attrs[0])
    first = 1 if has_index else 0
    for attrs in arg_attrs[first:]:
        if "jax.global_constant" in str(attrs):
            raise LiftError(
                "main takes dimension variables (shape-polymorphic modules are not lifted)"
            )
    in_avals = tuple(tensor_aval(t) for t in inputs[first:])
    out_avals = tuple(tensor_aval(t) for t in ftype.results)
    return LiftedModule(module, in_avals, out_avals, has_index)


def _arg_attrs(func, n: int) -> list:
    if "arg_attrs" not in func.attributes:
        return [None] * n
    ir = compat.ir_module()
    attrs = ir.ArrayAttr(func.attributes["arg_attrs"])
    return [attrs[i] for i in range(len(attrs))]


def _functions(module) -> dict:
    ir = compat.ir_module()
    found = {}
    for op in module.body.operations:
        if op.operation.name == "func.func":
            found[ir.StringAttr(op.attributes["sym_name"]).value] = op
    return found


class _Interpreter:
    """Runs a module's ops on JAX values (tracers, numpy constants, `Splat`s)."""

    def __init__(self, lifted: LiftedModule, platforms):
        self.lifted = lifted
        self.funcs = _functions(lifted.module)
        self.platforms = tuple(platforms)
        self.depth = 0
        # One value map per function being run; regions (reduce bodies,
        # branches, loops) read and extend their function's map.
        self.envs: list[dict] = []
        self.record: list | None = None  # (MLIR value, traced value), see `function`

    def call(self, name: str, args: list) -> list:
        func = self.funcs.get(name)
        if func is None:
            raise LiftError(f"func.call to unknown function @{name}")
        self.depth += 1
        if self.depth > 64:
            raise LiftError("func.call nesting deeper than 64 (recursion is not lifted)")
        self.envs.append({})
        try:
            return self.run_block(func.regions[0].blocks[0], args)
        finally:
            self.envs.pop()
            self.depth -= 1

    def run_region(self, region, args: list) -> list:
        blocks = list(region.blocks)
        if len(blocks) != 1:
            raise ops.NoRule  # a region with several blocks: its op is an island
        return self.run_block(blocks[0], args)

    def run_block(self, block, args: list) -> list:
        env = self.envs[-1]
        env.update(zip(block.arguments, args, strict=True))
        plan = self.lifted.plans.get(block)
        if plan is None:
            plan = self.lifted.plans[block] = expansions.plan(block)
        for op in block.operations:
            name = op.operation.name
            if name in ("func.return", "stablehlo.return"):
                return [env[v] for v in op.operands]
            self.step(op, name, env, plan)
        raise LiftError("a block without a return")

    def step(self, op, name: str, env: dict, plan) -> None:
        """Lift ``op`` into ``env``; an op of an elementwise region of one input
        (`expansions`) is lifted with its region, when its last op is reached."""
        region = plan.by_last.get(op.operation)
        if region is not None:
            results = self.run_expansion(region, env)
        elif op.operation in plan.inside:
            return
        else:
            results = self.run_op(op, name, [env[v] for v in op.operands])
        if len(results) != len(op.results):
            raise LiftError(f"{name}: {len(results)} results for {len(op.results)}")
        for value, result in zip(op.results, results, strict=True):
            env[value] = result
            if self.record is not None and compat.is_tracer(result):
                self.record.append((value, result))

    def run_expansion(self, region, env: dict) -> list:
        """A region identified as a known function: its ops under a
        `jax.custom_jvp` with that function's derivative; else op by op."""
        known = None
        if compat.is_tracer(env[region.x]):
            known = expansions.identify(self, region, env)
        if known is not None:

            def forward(x):
                return expansions.run_ops(self, region.ops, env, {region.x: x})[region.y]

            return [expansions.with_derivative(forward, known)(env[region.x])]
        inner = expansions.level(region.inner)
        for op in region.ops[:-1]:
            self.step(op, op.operation.name, env, inner)
        last = region.ops[-1]
        nearer = inner.by_last.get(last.operation)  # the same output, from a nearer input
        if nearer is not None:
            return self.run_expansion(nearer, env)
        return self.run_op(last, last.operation.name, [env[v] for v in last.operands])

    def run_op(self, op, name: str, operands: list) -> list:
        if name == "func.call":
            ir = compat.ir_module()
            callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
            return self.call(callee, operands)
        rule = ops.RULES.get(name)
        if ops.foldable(op, name, operands):
            # Constants only: evaluated on the host now, never staged into the
            # trace around the lift (a traced sqrt(8.0) could not be read back).
            folded = ops.fold(self, op, name, operands)
            if folded is not None:
                return folded
        if rule is not None:
            self.lifted.op_locations.append(str(op.location))
            scope = f"{OP_SCOPE}{len(self.lifted.op_locations) - 1}"
            try:
                with jax.named_scope(scope):  # the report finds the op's loc by it
                    return rule(self, op, operands)
            except ops.NoRule:
                pass  # a variant of the op the table does not cover: an island
        if name.startswith("sdy."):  # a sharding op run alone would lose its meaning
            raise LiftError(f"{name} is not lifted (its sharding would not be kept)")
        return self.island(op, name, operands)

    def island(self, op, name: str, operands: list) -> list:
        if any(isinstance(x, Splat) for x in operands):
            operands = [ops.materialize(x) for x in operands]
        captured = []
        if len(op.regions):
            env = self.envs[-1]
            for value in islands.captured_values(op):
                if value not in env:
                    raise LiftError(f"{name}: a value its regions read is not lifted")
                captured.append((value, ops.materialize(env[value])))
        outs = islands.call_island(op, operands, self.platforms, self.funcs, captured)
        location = str(op.location)
        known = self.lifted.islands.get(name)
        count = 1 if known is None else known.count + 1
        self.lifted.islands[name] = Island(
            name, location if known is None else known.location, count
        )
        return outs
