"""Constant folding on the host, in NumPy, for the equations masks are made of.

Folding an equation by binding its primitive eagerly compiles an XLA program
for it, and JAX keeps that program in a process-wide cache of thousands of
entries keyed by the primitive's parameters, shape included: a served model
folding its causal or kv-length mask at every new sequence length would leave
one or two compiled programs (a few MB each on CPU) per length behind,
whatever the optimized function's ``cache_size``.  The shape, index and
integer/boolean equations such masks are built from are evaluated here in
NumPy instead, where NumPy computes exactly what XLA computes (integer
arithmetic wraps, comparisons and selections are exact, casts from integers
and booleans round the same way); anything else returns None and is bound
as before.  `evaluate` checks each result's shape and dtype against the
equation's output.
"""

from __future__ import annotations

import numpy as np

_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}  # fmt: skip
_INTEGER_ARITHMETIC = {"add": np.add, "sub": np.subtract, "mul": np.multiply}
_BITWISE = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}


def _exact_int(dtype) -> bool:
    return np.issubdtype(dtype, np.integer) or dtype == np.bool_


def _iota(params, _):
    shape, dim = tuple(params["shape"]), params["dimension"]
    line = np.arange(shape[dim], dtype=params["dtype"])
    line = line.reshape([-1 if i == dim else 1 for i in range(len(shape))])
    return np.array(np.broadcast_to(line, shape))


def _broadcast_in_dim(params, args):
    (x,) = args
    shape = tuple(params["shape"])
    expanded = [1] * len(shape)
    for src, dst in enumerate(params["broadcast_dimensions"]):
        expanded[dst] = x.shape[src]
    return np.array(np.broadcast_to(x.reshape(expanded), shape))


def _reshape(params, args):
    if params.get("dimensions") is not None:
        return None
    return args[0].reshape(tuple(params["new_sizes"]))


def _convert(params, args):
    (x,) = args
    new = np.dtype(params["new_dtype"])
    # Booleans and integers convert exactly (or round to nearest even, to
    # f32/f64), in NumPy as in XLA; floats to integers differ (XLA saturates).
    if not _exact_int(x.dtype) or not (_exact_int(new) or new in (np.float32, np.float64)):
        return None
    if new == np.bool_:
        return x != 0
    return x.astype(new)


def _select_n(_, args):
    which, *cases = args
    if which.dtype == np.bool_:
        return np.where(which, cases[1], cases[0]) if len(cases) == 2 else None
    return np.choose(which, cases)


def _fold(name, params, args):
    if params.get("sharding") is not None:
        return None
    if name == "iota":
        return _iota(params, args)
    if name == "broadcast_in_dim":
        return _broadcast_in_dim(params, args)
    if name == "reshape":
        return _reshape(params, args)
    if name == "squeeze":
        return np.squeeze(args[0], axis=tuple(params["dimensions"]))
    if name == "transpose":
        return np.transpose(args[0], tuple(params["permutation"]))
    if name == "convert_element_type":
        return _convert(params, args)
    if name == "select_n":
        return _select_n(params, args)
    if name in _COMPARE:
        return _COMPARE[name](*args)
    integers = all(_exact_int(a.dtype) for a in args)
    if name in _BITWISE and integers:
        return _BITWISE[name](*args)
    if name == "not" and integers:
        return np.invert(args[0])
    if name in _INTEGER_ARITHMETIC and integers and all(a.dtype != np.bool_ for a in args):
        return _INTEGER_ARITHMETIC[name](*args)
    return None


def evaluate(eqn, invals) -> list | None:
    """``eqn``'s outputs computed in NumPy, or None where it is not one of the
    equations above (or the result would not have the equation's type)."""
    if eqn.primitive.multiple_results or len(eqn.outvars) != 1:
        return None
    try:
        args = [np.asarray(x, dtype=v.aval.dtype) for x, v in zip(invals, eqn.invars, strict=True)]
        if any(a.shape != tuple(v.aval.shape) for a, v in zip(args, eqn.invars, strict=True)):
            return None
        with np.errstate(all="ignore"):  # integer arithmetic wraps, as in XLA
            out = _fold(eqn.primitive.name, eqn.params, args)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if out is None:
        return None
    out = np.asarray(out)
    aval = eqn.outvars[0].aval
    if out.shape != tuple(aval.shape) or out.dtype != aval.dtype:
        return None
    return [out]
