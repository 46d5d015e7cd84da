"""A float64 evaluation of a closed jaxpr: the zoo's numerical truth.

The zoo compares the rewritten program with the original float32 one, so a
model whose original is itself far off in float32 (a long training step, a
large-magnitude softmax) reads as a flashpass error.  `evaluate` runs the
*same* jaxpr with every float32/bfloat16/float16 value promoted to float64,
params that name those dtypes re-typed, and sub-jaxprs (pjit, custom_jvp/vjp,
remat, scan, while, cond) interpreted the same way.  Integer, boolean and key
values are never touched.

A few primitives must see their original dtypes to mean the same thing (a
bitcast from random bits to float32 reads 32 bits): they run on their original
dtypes and only their outputs are promoted (`_EXACT`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from flashpass.compat import x64_scope

#: Primitives that run on their original dtypes (outputs promoted afterwards).
_EXACT = {"bitcast_convert_type", "nextafter"}

#: Call-like primitives whose result is their inner jaxpr's on the same
#: operands (custom rules only matter to transformations, which already ran).
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALLS = {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "remat",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "custom_lin",
}


class Unsupported(Exception):
    """A primitive the interpreter cannot evaluate in float64."""


def _low_float(dtype) -> bool:
    # Extended dtypes (PRNG keys) are not numpy dtypes: never floats here.
    if not isinstance(dtype, np.dtype):
        return False
    return jnp.issubdtype(dtype, jnp.floating) and dtype != np.float64


def _promote(x):
    dtype = getattr(x, "dtype", None)
    if dtype is not None and _low_float(dtype):
        return lax.convert_element_type(x, np.float64)
    return x


def _retype(value):
    """A param value with every low-precision float dtype made float64."""
    if type(value) is tuple:  # not a NamedTuple param (a PRNG impl)
        return tuple(_retype(v) for v in value)
    if isinstance(value, type) and issubclass(value, np.generic):
        value = np.dtype(value)
    if isinstance(value, np.dtype) and _low_float(value):
        return np.dtype(np.float64)
    return value


def _closed(j):
    """``(jaxpr, consts)`` of a Jaxpr or ClosedJaxpr."""
    if isinstance(j, jcore.ClosedJaxpr):
        return j.jaxpr, j.consts
    return j, ()


def _eval(jaxpr, consts, *args):
    env = {}

    def read(v):
        if isinstance(v, jcore.Literal):
            return _promote(jnp.asarray(v.val, v.aval.dtype))
        return env[v]

    def write(v, x):
        env[v] = _promote(x)

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        write(v, jnp.asarray(x))
    for v, x in zip(jaxpr.invars, args, strict=True):
        write(v, x)
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _apply(eqn, ins)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            write(v, x)
    return [read(v) for v in jaxpr.outvars]


def _run(j, *args):
    jaxpr, consts = _closed(j)
    return _eval(jaxpr, consts, *args)


def _apply(eqn, ins):
    name, params = eqn.primitive.name, eqn.params
    if name in _EXACT:
        # Back to the operands' original dtypes: the bits mean what they meant.
        ins = [
            lax.convert_element_type(x, v.aval.dtype) for x, v in zip(ins, eqn.invars, strict=True)
        ]
        return eqn.primitive.bind(*ins, **params)
    if name == "reduce_precision":
        dtype = eqn.invars[0].aval.dtype
        info = jnp.finfo(dtype)
        if (params["exponent_bits"], params["mantissa_bits"]) == (info.nexp, info.nmant):
            return ins[0]  # a no-op on the original dtype: float64 keeps its digits
        return eqn.primitive.bind(*ins, **params)
    if name in _CALLS:
        inner = next((params[k] for k in _CALL_PARAMS if k in params), None)
        if inner is None:
            raise Unsupported(f"{name}: no inner jaxpr among {sorted(params)}")
        return _run(inner, *ins)
    if name == "scan":
        return _scan(params, ins)
    if name == "while":
        return _while(params, ins)
    if name == "cond":
        branches = [partial(_run, b) for b in params["branches"]]
        return lax.switch(ins[0], branches, *ins[1:])
    inner = [k for k, p in params.items() if k != "update_jaxpr" and _has_jaxpr(p)]
    if inner:
        raise Unsupported(f"higher-order primitive {name} ({', '.join(inner)})")
    params = {k: _retype(p) for k, p in params.items()}
    if isinstance(params.get("update_jaxpr"), jcore.Jaxpr):  # scatter's combiner
        params |= _combiner(params["update_jaxpr"], params["update_consts"])
    return eqn.primitive.bind(*ins, **params)


def _combiner(jaxpr, consts) -> dict:
    """A scatter's scalar combiner traced again on float64 scalars (its
    lowering reads the jaxpr's own avals)."""
    avals = [
        jax.ShapeDtypeStruct((), np.float64 if _low_float(v.aval.dtype) else v.aval.dtype)
        for v in jaxpr.invars
    ]
    new = jax.make_jaxpr(lambda *a: _eval(jaxpr, consts, *a))(*avals)
    return {"update_jaxpr": new.jaxpr, "update_consts": tuple(new.consts)}


def _has_jaxpr(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_has_jaxpr(v) for v in value)
    return isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr))


def _scan(params, ins):
    nc, ncarry = params["num_consts"], params["num_carry"]
    consts, carry, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]

    def body(c, x):
        out = _run(params["jaxpr"], *consts, *c, *x)
        return out[:ncarry], out[ncarry:]

    carry, ys = lax.scan(
        body,
        carry,
        xs,
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


def _while(params, ins):
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cconsts, bconsts, init = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
    return lax.while_loop(
        lambda c: _run(params["cond_jaxpr"], *cconsts, *c)[0],
        lambda c: _run(params["body_jaxpr"], *bconsts, *c),
        list(init),
    )


def evaluate(closed, *args):
    """The outputs of ``closed`` (a ClosedJaxpr) on ``args`` (flat, matching
    its invars), every float computed and returned in float64 (numpy arrays;
    integer and boolean outputs keep their dtypes).  Raises `Unsupported`
    for a higher-order primitive it does not know."""
    args = jax.tree_util.tree_leaves(args)
    with x64_scope():
        # Each operand at its traced dtype (x64 would widen integers), then promoted.
        args = [
            _promote(jnp.asarray(a, v.aval.dtype))
            for a, v in zip(args, closed.jaxpr.invars, strict=True)
        ]
        out = jax.jit(lambda *a: _run(closed, *a))(*args)
        return [np.asarray(x) for x in out]


def evaluate_like(closed, out_tree_of, *args):
    """`evaluate`, its flat outputs unflattened as ``out_tree_of`` (a pytree
    with the original function's output structure)."""
    flat = evaluate(closed, *args)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_tree_of), flat)
