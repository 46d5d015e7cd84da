"""The lifting rules of control flow (``while`` as a scan when it counts,
``case``, ``if``) and of annotations that change no value (sharding custom
calls and constraints) (`flashpass.export.ops`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass import compat

from . import sharded
from .rules import NoRule, _attr, _int, _rule
from .values import LiftError, Splat, constant_value, dense_constant, materialize, tensor_aval

# --------------------------------------------------------------------------- control flow


@_rule("stablehlo.while")
def _while(interp, op, operands):
    cond_region, body_region = op.regions
    trips = _counted_loop(interp, op, operands)
    if trips is not None:
        # A loop counting one carry up by 1 to a constant bound (what `lax.scan`
        # and a static `fori_loop` lower to) is a scan again: reverse-differentiable,
        # where a `while_loop` is not.
        def step(carry, _):
            out = interp.run_region(body_region, list(carry))
            return tuple(materialize(x) for x in out), None

        init = tuple(materialize(x) for x in operands)
        out, _ = lax.scan(step, init, None, length=trips)
        return list(out)

    def cond(carry):
        return interp.run_region(cond_region, list(carry))[0].reshape(())

    def body(carry):
        return tuple(materialize(x) for x in interp.run_region(body_region, list(carry)))

    return list(lax.while_loop(cond, body, tuple(materialize(x) for x in operands)))


def _static_value(interp, value):
    """The constant behind ``value`` (a constant op, or a constant of the
    enclosing function), else None."""
    owner = value.owner
    if hasattr(owner, "operation") and owner.operation.name == "stablehlo.constant":
        return constant_value(dense_constant(owner.attributes["value"], tensor_aval(value.type)))
    env = interp.envs[-1] if interp.envs else {}
    return constant_value(env[value]) if value in env else None


def _counted_loop(interp, op, operands) -> int | None:
    """The trip count of a ``while`` whose condition is ``carry[i] < N`` (N a
    constant), whose body returns ``carry[i] + 1`` and whose ``carry[i]`` starts
    at a constant; else None."""
    cond_region, body_region = op.regions
    if len(list(cond_region.blocks)) != 1 or len(list(body_region.blocks)) != 1:
        return None
    cond = cond_region.blocks[0]
    body_ops = list(cond.operations)
    if len(body_ops) != 2 or body_ops[0].operation.name != "stablehlo.compare":
        return None
    compare, ret = body_ops
    if list(ret.operands) != [compare.results[0]]:
        return None
    sh = compat.stablehlo_dialect()
    if sh.ComparisonDirectionAttr(compare.attributes["comparison_direction"]).value != "LT":
        return None
    counter, limit = compare.operands
    args = list(cond.arguments)
    if counter not in args:
        return None
    i = args.index(counter)
    if not jnp.issubdtype(tensor_aval(counter.type).dtype, jnp.integer):
        return None
    bound, start = _static_value(interp, limit), constant_value(operands[i])
    if bound is None or start is None or bound.size != 1 or start.size != 1:
        return None
    block = body_region.blocks[0]
    returned = list(block.operations)[-1].operands[i]
    step_op = returned.owner
    if not hasattr(step_op, "operation") or step_op.operation.name != "stablehlo.add":
        return None
    lhs, rhs = step_op.operation.operands
    own = list(block.arguments)[i]
    other = rhs if lhs == own else lhs if rhs == own else None
    if other is None:
        return None
    one = _static_value(interp, other)
    if one is None or one.size != 1 or int(one.reshape(())) != 1:
        return None
    return max(int(bound.reshape(())) - int(start.reshape(())), 0)


@_rule("stablehlo.case")
def _case(interp, op, operands):
    index = constant_value(operands[0])
    regions = list(op.regions)
    if index is not None:  # e.g. the platform index: resolved while lifting
        i = int(np.clip(index.reshape(()), 0, len(regions) - 1))
        return interp.run_region(regions[i], [])
    branches = [_branch(interp, r) for r in regions]
    return list(lax.switch(operands[0].reshape(()), branches))


def _branch(interp, region):
    return lambda: tuple(materialize(x) for x in interp.run_region(region, []))


@_rule("stablehlo.if")
def _if(interp, op, operands):
    pred = constant_value(operands[0])
    on_true, on_false = op.regions
    if pred is not None:
        return interp.run_region(on_true if bool(pred.reshape(())) else on_false, [])

    branches = (_branch(interp, on_true), _branch(interp, on_false))
    return list(lax.cond(operands[0].reshape(()), *branches))


# Annotations a single-device program may carry; they do not change values.
_IDENTITY_CUSTOM_CALLS = ("Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape")


@_rule("stablehlo.custom_call")
def _custom_call(interp, op, operands):
    ir = compat.ir_module()
    target = ir.StringAttr(op.attributes["call_target_name"]).value
    if target in _IDENTITY_CUSTOM_CALLS and len(operands) == 1 and len(op.results) == 1:
        if interp.lifted.meshes:
            raise LiftError(f"custom_call @{target} in a multi-device artifact is not reproduced")
        return operands
    raise NoRule


@_rule("sdy.sharding_constraint")
def _sharding_constraint(interp, op, operands):
    (x,) = operands
    if not interp.lifted.meshes or isinstance(x, Splat):  # one device, or a splat constant:
        return operands  # the constraint changes no value
    return [sharded.constrain(materialize(x), str(op.attributes["sharding"]), interp.lifted.meshes)]


# --------------------------------------------------------------------------- composites

#: The composites JAX lowers elementwise functions to (``jax.export`` of
#: ``lax.erf``, ``jnp.sinh``, ``jnp.arcsin``, on JAX 0.12 ``lax.erfc``, ...): the
#: `lax` function again, which exports to the same composite and differentiates
#: as the function.
_COMPOSITES = {
    "chlo.erf": lax.erf,
    "chlo.erfc": lax.erfc,  # JAX 0.12 (0.10 expands it)
    "chlo.sinh": lax.sinh,
    "chlo.cosh": lax.cosh,
    "chlo.asin": lax.asin,
    "chlo.acos": lax.acos,
    "chlo.atan": lax.atan,
    "chlo.asinh": lax.asinh,
    "chlo.acosh": lax.acosh,
    "chlo.atanh": lax.atanh,
    "chlo.tan": lax.tan,
}


@_rule("stablehlo.composite")
def _composite(interp, op, operands):
    """A composite (how JAX lowers ``lax.top_k`` and, on some versions, erf,
    sinh, ...; how libraries wrap an op with a portable definition): the lax
    function its name stands for where lax has it, else its ``decomposition``
    function, which is its meaning."""
    ir = compat.ir_module()
    name = ir.StringAttr(op.attributes["name"]).value
    fn = _COMPOSITES.get(name)
    attrs = _attr(op, "composite_attributes")
    if fn is not None and len(operands) == len(op.results) == 1 and not attrs:
        (x,) = operands
        if isinstance(x, Splat):
            with compat.compile_time_eval():
                return [Splat(np.asarray(fn(x.value), x.dtype), x.shape)]
        return [fn(x)]
    attrs = ir.DictAttr(attrs) if attrs is not None else {}
    if name == "chlo.top_k" and len(operands) == 1 and len(op.results) == 2 and "k" in attrs:
        values, indices = lax.top_k(materialize(operands[0]), _int(attrs["k"]))
        want = [tensor_aval(r.type) for r in op.results]
        if [(x.shape, x.dtype) for x in (values, indices)] == [(a.shape, a.dtype) for a in want]:
            return [values, indices]
    # Any other composite is its decomposition, a function of the module.
    return interp.call(ir.FlatSymbolRefAttr(op.attributes["decomposition"]).value, operands)
