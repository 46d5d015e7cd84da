"""A NumPy interpreter for the jaxprs the fuzz tests produce.

Why: on a 2-core CPU every XLA compilation costs 40 ms or more (a traced
attention program about 0.5 s), so compiling both the original and the
rewritten program of every generated example would take ~1 s per example.
Interpreting both jaxprs with NumPy takes milliseconds, which is what makes
hundreds of examples per CI run affordable.  It checks what the pass is about:
that the rewritten jaxpr computes what the original jaxpr computes.  A sample
of examples is also run compiled (``opt(*args)`` against ``fn(*args)``) so the
real execution path is covered too.

Semantics follow XLA's per-operation rounding: every operation on
bfloat16/float16 values is computed in float32 and rounded to the result
dtype (from the equation's output aval); dot products accumulate in float32.
Call-like primitives (``jit``, ``checkpoint``/``remat``, ``custom_jvp_call``,
``custom_vjp_call``) evaluate their body; ``while`` and ``scan`` loop in
Python.  An unknown primitive raises `Unsupported`, naming it, so a new
spelling that needs one fails loudly rather than silently.
"""

from __future__ import annotations

import numpy as np

from flashpass import compat

_LOW = {np.dtype("float16")}
try:  # bfloat16 lives in ml_dtypes (a JAX dependency)
    import ml_dtypes

    _LOW.add(np.dtype(ml_dtypes.bfloat16))
except ImportError:  # pragma: no cover
    pass


class Unsupported(NotImplementedError):
    """The interpreter has no rule for a primitive."""


def evaluate(closed, *args) -> list:
    """The outputs of ``closed`` (a ClosedJaxpr) on ``args``, as NumPy arrays."""
    args = [np.asarray(a) for a in args]
    consts = [np.asarray(c) for c in closed.consts]
    return _run(closed.jaxpr, consts, args)


def _wide(x):
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype in _LOW else x


def _run(jaxpr, consts, args) -> list:
    env: dict = {}

    def read(atom):
        if compat.is_literal(atom):
            return np.asarray(compat.literal_value(atom), dtype=atom.aval.dtype)
        return env[atom]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = np.asarray(value)
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        outs = _apply(eqn, invals)
        for var, value in zip(eqn.outvars, outs, strict=True):
            if not compat.is_drop_var(var):
                env[var] = np.asarray(value).astype(var.aval.dtype, copy=False)
    return [read(v) for v in jaxpr.outvars]


def _body(params, *names):
    for name in names:
        body = params.get(name)
        if body is not None:
            jaxpr, consts = compat.closed_parts(body)
            return jaxpr, [np.asarray(c) for c in consts]
    raise Unsupported(f"no body among {names}")


_UNARY = {
    "exp": np.exp,
    "exp2": np.exp2,
    "log": np.log,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "tanh": np.tanh,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "abs": np.abs,
    "neg": np.negative,
    "sign": np.sign,
    "floor": np.floor,
    "ceil": np.ceil,
    "logistic": lambda x: 1 / (1 + np.exp(-x)),
    "stop_gradient": lambda x: x,
    "copy": lambda x: x,
    "copy_p": lambda x: x,
    "real": lambda x: x,
}

_BINARY = {
    "add": np.add,
    "add_any": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": None,  # integer division truncates (lax semantics)
    "max": np.maximum,
    "min": np.minimum,
    "pow": np.power,
    "atan2": np.arctan2,
    "rem": np.fmod,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
}


def _apply(eqn, invals) -> list:  # noqa: C901 - one branch per primitive
    name = eqn.primitive.name
    p = eqn.params
    out_aval = eqn.outvars[0].aval if eqn.outvars else None
    with np.errstate(all="ignore"):
        if name in ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat2", "remat"):
            jaxpr, consts = _body(p, "jaxpr", "call_jaxpr")
            return _run(jaxpr, consts, invals)
        if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
            jaxpr, consts = _body(p, "call_jaxpr", "fun_jaxpr")
            return _run(jaxpr, consts, invals)
        if name in _UNARY:
            return [_UNARY[name](_wide(invals[0]))]
        if name == "div":
            a, b = (_wide(x) for x in invals)
            if np.issubdtype(a.dtype, np.integer):
                return [np.trunc(a / b)]
            return [a / b]
        if name in _BINARY:
            a, b = (_wide(x) for x in invals)
            return [_BINARY[name](a, b)]
        if name == "not":
            x = invals[0]
            return [np.logical_not(x) if x.dtype == np.bool_ else np.invert(x)]
        if name == "integer_pow":
            return [_wide(invals[0]) ** p["y"]]
        if name == "square":
            return [_wide(invals[0]) ** 2]
        if name == "convert_element_type":
            return [invals[0].astype(p["new_dtype"])]
        if name == "select_n":
            which, *cases = invals
            if which.dtype == np.bool_:
                which = which.astype(np.int32)
            cases = np.broadcast_arrays(*cases)
            return [np.choose(np.broadcast_to(which, cases[0].shape), cases)]
        if name == "clamp":
            lo, x, hi = (_wide(v) for v in invals)
            return [np.clip(x, lo, hi)]
        if name == "dot_general":
            return [_dot_general(invals[0], invals[1], p["dimension_numbers"])]
        if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod"):
            fn = {"reduce_sum": np.sum, "reduce_max": np.max, "reduce_min": np.min}.get(
                name, np.prod
            )
            return [fn(_wide(invals[0]), axis=tuple(p["axes"]))]
        if name in ("reduce_or", "reduce_and"):  # the empty-row pass (kernels/empty_rows.py)
            fn = np.any if name == "reduce_or" else np.all
            return [fn(invals[0], axis=tuple(p["axes"]))]
        if name in ("argmax", "argmin"):
            fn = np.argmax if name == "argmax" else np.argmin
            return [fn(invals[0], axis=p["axes"][0])]
        if name == "cumsum":
            x = _wide(invals[0])
            ax = p["axis"]
            if p["reverse"]:
                return [np.flip(np.cumsum(np.flip(x, ax), axis=ax), ax)]
            return [np.cumsum(x, axis=ax)]
        if name == "broadcast_in_dim":
            x = invals[0]
            shape = tuple(p["shape"])
            dims = p["broadcast_dimensions"]
            expanded = [1] * len(shape)
            for i, d in enumerate(dims):
                expanded[d] = x.shape[i]
            return [np.broadcast_to(x.reshape(expanded), shape)]
        if name == "reshape":
            return [invals[0].reshape(tuple(p["new_sizes"]))]
        if name == "squeeze":
            return [np.squeeze(invals[0], axis=tuple(p["dimensions"]))]
        if name == "expand_dims":
            return [np.expand_dims(invals[0], tuple(p["dimensions"]))]
        if name == "transpose":
            return [np.transpose(invals[0], tuple(p["permutation"]))]
        if name == "rev":
            return [np.flip(invals[0], tuple(p["dimensions"]))]
        if name == "iota":
            shape, dim = tuple(p["shape"]), p["dimension"]
            ar = np.arange(shape[dim], dtype=p["dtype"])
            view = [1] * len(shape)
            view[dim] = shape[dim]
            return [np.broadcast_to(ar.reshape(view), shape)]
        if name == "concatenate":
            return [np.concatenate(invals, axis=p["dimension"])]
        if name == "tile":
            return [np.tile(invals[0], tuple(p["reps"]))]
        if name == "slice":
            strides = p["strides"] or (1,) * len(p["start_indices"])
            idx = tuple(
                slice(s, e, st)
                for s, e, st in zip(p["start_indices"], p["limit_indices"], strides, strict=True)
            )
            return [invals[0][idx]]
        if name == "pad":
            return [_pad(invals[0], invals[1], p["padding_config"])]
        if name == "dynamic_slice":
            x, *starts = invals
            sizes = p["slice_sizes"]
            idx = _clamped(starts, x.shape, sizes)
            return [x[tuple(slice(s, s + n) for s, n in zip(idx, sizes, strict=True))]]
        if name == "dynamic_update_slice":
            x, upd, *starts = invals
            idx = _clamped(starts, x.shape, upd.shape)
            out = np.array(x, copy=True)
            out[tuple(slice(s, s + n) for s, n in zip(idx, upd.shape, strict=True))] = upd
            return [out]
        if name == "while":
            return _while(p, invals)
        if name == "scan":
            return _scan(p, invals)
        if name == "cond":
            index, *ops = invals
            branches = p["branches"]
            i = int(np.clip(int(index), 0, len(branches) - 1))
            return _run(*compat.closed_parts(branches[i]), ops)
    raise Unsupported(
        f"numpy_eval has no rule for `{name}` (out {out_aval}); add one to tests/fuzz/numpy_eval.py"
    )


def _dot_general(a, b, dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    la = [None] * a.ndim
    lb_ = [None] * b.ndim
    for i, j in zip(lb, rb, strict=True):
        la[i] = lb_[j] = next(letters)
    for i, j in zip(lc, rc, strict=True):
        la[i] = lb_[j] = next(letters)
    for i in range(a.ndim):
        if la[i] is None:
            la[i] = next(letters)
    for j in range(b.ndim):
        if lb_[j] is None:
            lb_[j] = next(letters)
    out = [la[i] for i in lb]
    out += [la[i] for i in range(a.ndim) if i not in lb and i not in lc]
    out += [lb_[j] for j in range(b.ndim) if j not in rb and j not in rc]
    spec = f"{''.join(la)},{''.join(lb_)}->{''.join(out)}"
    wide = np.float64 if np.result_type(a, b) == np.float64 else np.float32
    if np.issubdtype(np.result_type(a.dtype, b.dtype), np.integer):
        wide = np.int64
    return np.einsum(spec, a.astype(wide), b.astype(wide))


def _pad(x, value, config):
    out = x
    for axis, (lo, hi, interior) in enumerate(config):
        if interior:
            n = out.shape[axis]
            shape = list(out.shape)
            shape[axis] = n + (n - 1) * interior if n else 0
            grown = np.full(shape, value, dtype=out.dtype)
            idx = [slice(None)] * out.ndim
            idx[axis] = slice(None, None, interior + 1)
            grown[tuple(idx)] = out
            out = grown
        if lo < 0:
            out = np.take(out, range(-lo, out.shape[axis]), axis=axis)
            lo = 0
        if hi < 0:
            out = np.take(out, range(0, out.shape[axis] + hi), axis=axis)
            hi = 0
        widths = [(0, 0)] * out.ndim
        widths[axis] = (lo, hi)
        out = np.pad(out, widths, constant_values=value)
    return out


def _clamped(starts, shape, sizes):
    return [
        int(np.clip(int(s), 0, dim - n)) for s, dim, n in zip(starts, shape, sizes, strict=True)
    ]


def _while(p, invals):
    (cond, cond_consts), (body, body_consts) = map(
        compat.closed_parts, (p["cond_jaxpr"], p["body_jaxpr"])
    )
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = invals[:nc], invals[nc : nc + nb], list(invals[nc + nb :])
    while bool(_run(cond, cond_consts, [*cconsts, *carry])[0]):
        carry = _run(body, body_consts, [*bconsts, *carry])
        carry = [
            np.asarray(c).astype(v.aval.dtype, copy=False)
            for c, v in zip(carry, body.outvars, strict=True)
        ]
    return carry


def _scan(p, invals):
    body, body_consts = compat.closed_parts(p["jaxpr"])
    (n_consts, n_carry), length = compat.scan_counts(p), p["length"]
    consts = invals[:n_consts]
    carry = list(invals[n_consts : n_consts + n_carry])
    xs = invals[n_consts + n_carry :]
    ys: list = []
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for i in order:
        outs = _run(body, body_consts, [*consts, *carry, *(x[i] for x in xs)])
        carry, y = outs[:n_carry], outs[n_carry:]
        ys.append(y)
    if p["reverse"]:
        ys.reverse()
    n_ys = len(body.outvars) - n_carry
    if length == 0:
        stacked = [np.zeros((0, *v.aval.shape), v.aval.dtype) for v in body.outvars[n_carry:]]
    else:
        stacked = [np.stack([y[j] for y in ys]) for j in range(n_ys)]
    return [*carry, *stacked]
