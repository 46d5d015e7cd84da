"""Elementwise functions a lowering expanded, identified so that their
derivative is the function's own.

A module holds what the exporter lowered, not the primitives: ``lax.erfc``
(exact GELU) arrives as a rational approximation with branches, whose untaken
``select`` side divides by x²; ``erf_inv``, ``lgamma``, ``digamma`` and the
Bessel functions as polynomials behind guards; another frontend's sigmoid as
``1 / (1 + exp(-x))``.  Lifted op by op, the program differentiates those
ops: NaN where an untaken branch's derivative is infinite (0 · inf), and not
quite the function's derivative elsewhere.

`plan` finds, statically, each closed elementwise subgraph of one input in a
block: the ops between a value ``x`` and a value ``y`` (every path from ``y``
back to a non-constant value passes through ``x``), reading only ``x``,
constants and each other, none of their results but ``y`` read outside.  When
the lifter reaches ``y``, `identify` evaluates the subgraph on probe points
and compares it with each function of `KNOWN` (float64 values from
`scipy.special`; to 64 float32 ulps, 4 ulps of a 16-bit dtype, on every probe
where the function is finite).  An identified subgraph is lifted
under `jax.custom_jvp`: its forward is the subgraph's own ops, lifted as
before (values bit for bit the artifact's), its tangent the identified
function's (JAX's own JVP rule of the `lax` function, what the original
program differentiated).  A subgraph that is none of them is lifted op by op,
as before (the subgraphs inside it get their own chance).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass import compat

from .ops import _BINARY, _UNARY
from .rules import NoRule, _attr
from .values import LiftError, Splat, tensor_aval

#: Ops that act elementwise: a subgraph of them is one function of its input.
ELEMENTWISE = frozenset(
    [
        f"stablehlo.{n}"
        for n in (*_UNARY, *_BINARY, "compare", "convert", "bitcast_convert", "select", "clamp")
    ]
    + ["chlo.erf"]
)
#: A subgraph of fewer ops is left alone (one op's lifted derivative is its own).
MIN_OPS = 3
#: Bounds on the search: the nearest inputs of an op tried, the ops of a subgraph
#: (erfc's expansion has 64, the Bessel functions' about 150).
MAX_INPUTS = 8
MAX_OPS = 512

_REAL = np.concatenate(
    [
        np.linspace(-6.0, 6.0, 97),
        [0.0, 1e-6, -1e-6, 1e-3, -1e-3, 0.1, -0.1, 0.3, -0.7, 9.5, -9.5, 20.0, -20.0, 60.0],
    ]
)
_UNIT = np.concatenate([np.linspace(-0.999, 0.999, 97), [0.0, 1e-6, -1e-6, 1e-3, -1e-3]])
_GAMMA = np.concatenate(
    [np.linspace(0.05, 12.0, 80), -np.arange(0, 4) - 0.5, -np.arange(0, 4) - 0.25, [30.0]]
)
_LOG1P = np.concatenate([np.linspace(-0.99, 6.0, 97), [0.0, 1e-6, -1e-6, 1e-3, 30.0]])


@dataclasses.dataclass(frozen=True, eq=False)
class Known:
    """A function an expansion may be: ``fn``, the `lax` function (its JVP
    rule is the derivative), ``exact``, its float64 values on the host
    (`scipy.special`, a dependency of JAX), and the points it is probed at."""

    name: str
    fn: object
    exact: object
    probes: np.ndarray


def _special(name):
    def exact(x):
        import scipy.special  # noqa: PLC0415 - JAX depends on it; only needed here

        return getattr(scipy.special, name)(x)

    return exact


KNOWN = (
    Known("erf", lax.erf, _special("erf"), _REAL),
    Known("erfc", lax.erfc, _special("erfc"), _REAL),
    Known("erf_inv", lax.erf_inv, _special("erfinv"), _UNIT),
    Known("tanh", lax.tanh, np.tanh, _REAL),
    Known("logistic", lax.logistic, _special("expit"), _REAL),
    Known("softplus", jax.nn.softplus, lambda x: np.logaddexp(x, 0.0), _REAL),
    Known("log1p", lax.log1p, np.log1p, _LOG1P),
    Known("expm1", lax.expm1, np.expm1, _REAL),
    Known("lgamma", lax.lgamma, _special("gammaln"), _GAMMA),
    Known("digamma", lax.digamma, _special("digamma"), _GAMMA),
    Known("bessel_i0e", lax.bessel_i0e, _special("i0e"), _REAL),
    Known("bessel_i1e", lax.bessel_i1e, _special("i1e"), _REAL),
)
#: Probes at which a function is finite: fewer and the comparison proves too little.
_MIN_FINITE = 32
#: The tolerance relative to max(1, |f|), by the dtype's size: JAX's own float32
#: ``lgamma`` is 15 ulps off; a 16-bit expansion computes in float32 and rounds.
_TOLERANCE = {8: 2.0**-40, 4: 64 * 2.0**-23}
_ULPS_NARROW = 4


@dataclasses.dataclass(eq=False)
class Region:
    """A closed elementwise subgraph: ``ops`` (in block order) compute ``y``
    from ``x`` and constants.  ``inner`` are the regions nested in it."""

    x: object
    y: object
    ops: list
    inner: list = dataclasses.field(default_factory=list)
    known: Known | None = None
    probed: bool = False


@dataclasses.dataclass
class Plan:
    """The outermost regions of a block: by the op computing their ``y``, and
    the ops inside them (lifted when their ``y`` is reached)."""

    by_last: dict
    inside: set


def _aval(value):
    """The value's aval, None for a type the lifter has none for (``i4``, tokens:
    lifting fails at that op, with its reason, not here)."""
    try:
        return tensor_aval(value.type)
    except LiftError:
        return None


def _float_type(value):
    aval = _aval(value)
    return aval if aval is not None and jnp.issubdtype(aval.dtype, jnp.floating) else None


def plan(block) -> Plan:
    """The closed elementwise subgraphs of one input in ``block``, nested."""
    const: set = set()
    dom: dict = {}  # value -> the values every path back to a non-constant passes through
    producer: dict = {}
    found = []
    index: dict = {}  # op -> its place in the block
    for op in block.operations:
        index[op.operation] = len(index)
        name = op.operation.name
        operands = list(op.operands)
        for r in op.results:
            producer[r] = op
        if name == "stablehlo.constant" or (
            operands and all(v in const for v in operands) and not len(op.regions)
        ):
            const.update(op.results)
            continue
        if name not in ELEMENTWISE or len(op.results) != 1:
            continue
        y = op.results[0]
        doms = None
        for v in operands:
            if v in const:
                continue
            through = [v, *dom.get(v, ())]
            doms = through if doms is None else [d for d in doms if d in through]
        dom[y] = (doms or [])[:MAX_INPUTS]
        if _float_type(y) is None:
            continue
        for x in dom[y]:  # nearest first; each farther one's region holds the nearer's
            region = _region(x, y, producer, const, index)
            if region is not None:
                found.append(region)
    return _nest(found)


def _region(x, y, producer, const, index) -> Region | None:
    if _aval(x) is None or _aval(x) != _aval(y):
        return None
    ops, seen, stack = {}, set(), [y]
    while stack:
        v = stack.pop()
        if v in seen or v == x or v in const:
            continue
        seen.add(v)
        op = producer.get(v)
        if op is None or op.operation.name not in ELEMENTWISE:
            return None  # (cannot happen where x dominates y)
        ops[op.operation] = op
        if len(ops) > MAX_OPS:
            return None
        stack.extend(op.operands)
    if len(ops) < MIN_OPS:
        return None
    for op in ops.values():
        for r in op.results:
            if r != y and any(u.owner.operation not in ops for u in r.uses):
                return None  # an inner value read outside: not one function of x
    return Region(x, y, sorted(ops.values(), key=lambda op: index[op.operation]))


def _nest(found: list) -> Plan:
    """Each region goes under the smallest one holding it; the outermost make the plan."""
    found = sorted(found, key=lambda r: len(r.ops))
    holding: dict = {}  # op -> the regions holding it, smallest first
    for r in found:
        for op in r.ops:
            holding.setdefault(op.operation, []).append(r)
    top = []
    for r in found:
        ops = _ops(r)
        for outer in holding[r.ops[-1].operation]:
            if len(outer.ops) > len(r.ops) and ops <= _ops(outer):
                outer.inner.append(r)
                break
        else:
            top.append(r)
    return level(top)


def _ops(region: Region) -> set:
    return {op.operation for op in region.ops}


def level(regions: list) -> Plan:
    """The plan of regions side by side: the largest first, one overlapping
    another already taken left out (closed regions are nested or disjoint)."""
    taken, inside = {}, set()
    for r in sorted(regions, key=lambda r: -len(r.ops)):
        ops = _ops(r)
        if not ops & inside:
            taken[r.ops[-1].operation] = r
            inside |= ops
    return Plan(taken, inside)


def identify(interp, region: Region, env) -> Known | None:
    """The function of `KNOWN` the region computes, probed once per region."""
    if region.probed:
        return region.known
    region.probed = True
    aval = tensor_aval(region.x.type)
    outputs = {}  # id(probes) -> the region's values there
    for known in KNOWN:
        try:
            if id(known.probes) not in outputs:
                outputs[id(known.probes)] = _evaluate(interp, region, env, known.probes, aval)
            if _agrees(outputs[id(known.probes)], known, aval):
                region.known = known
                break
        except (NoRule, LiftError, TypeError, ValueError, ArithmeticError):
            return None
    return region.known


def _agrees(got, known: Known, aval) -> bool:
    dtype = np.dtype(aval.dtype)
    want = _exact(known, dtype)
    finite = np.isfinite(want)
    if finite.sum() < _MIN_FINITE:
        return False
    rel = _TOLERANCE.get(dtype.itemsize, _ULPS_NARROW * float(jnp.finfo(dtype).eps))
    tol = rel * np.maximum(1.0, np.abs(want[finite]))
    return bool(np.all(np.abs(got[finite] - want[finite]) <= tol))


@functools.cache
def _exact(known: Known, dtype) -> np.ndarray:
    """``known``'s float64 values at its probes rounded to ``dtype``."""
    with np.errstate(all="ignore"):
        return np.asarray(known.exact(known.probes.astype(dtype).astype(np.float64)), np.float64)


def _evaluate(interp, region, env, probes, aval) -> np.ndarray:
    """The region's values at ``probes``, on the host in numpy, in x's dtype:
    its ops applied to a vector of the probes (elementwise, so x's own shape
    does not matter, and nothing is compiled)."""
    x = probes.astype(aval.dtype)
    with np.errstate(all="ignore"):
        out = run_ops(interp, region.ops, env, {region.x: x}, probing=True)[region.y]
    return np.asarray(out, np.float64)


def _round_afz(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5).astype(x.dtype)


def _clz(x):
    bits = x.dtype.itemsize * 8
    u = x.view(np.dtype(f"u{x.dtype.itemsize}")).astype(np.float64)
    length = np.where(u > 0, np.floor(np.log2(np.maximum(u, 1.0))) + 1, 0)
    return (bits - length).astype(x.dtype)


def _shift_right_logical(x, n):
    unsigned = np.dtype(f"u{x.dtype.itemsize}")
    return np.right_shift(x.view(unsigned), n.astype(unsigned)).view(x.dtype)


def _erf(x):
    return _special("erf")(x.astype(np.float64)).astype(x.dtype)


#: numpy's functions for the ops of a region, in the probes' dtype.
_NUMPY = {
    "abs": np.abs,
    "ceil": np.ceil,
    "cosine": np.cos,
    "count_leading_zeros": _clz,
    "exponential": np.exp,
    "exponential_minus_one": np.expm1,
    "floor": np.floor,
    "is_finite": np.isfinite,
    "log": np.log,
    "log_plus_one": np.log1p,
    "logistic": lambda x: (1 / (1 + np.exp(-x))).astype(x.dtype),
    "negate": np.negative,
    "not": np.invert,
    "round_nearest_even": np.rint,
    "round_nearest_afz": _round_afz,
    "rsqrt": lambda x: (1 / np.sqrt(x)).astype(x.dtype),
    "sign": np.sign,
    "sine": np.sin,
    "sqrt": np.sqrt,
    "cbrt": np.cbrt,
    "tan": np.tan,
    "tanh": np.tanh,
    "add": np.add,
    "and": np.bitwise_and,
    "atan2": np.arctan2,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "multiply": np.multiply,
    "or": np.bitwise_or,
    "power": np.power,
    "remainder": np.fmod,
    "subtract": np.subtract,
    "xor": np.bitwise_xor,
    "shift_left": np.left_shift,
    "shift_right_arithmetic": np.right_shift,
    "shift_right_logical": _shift_right_logical,
    "select": np.where,
    "clamp": lambda low, x, high: np.minimum(np.maximum(x, low), high),
    "erf": _erf,
}
_NUMPY_COMPARE = {
    "EQ": np.equal,
    "NE": np.not_equal,
    "LT": np.less,
    "LE": np.less_equal,
    "GT": np.greater,
    "GE": np.greater_equal,
}


def _probe_op(op, name: str, operands: list):
    """``op`` on vectors of probes, in numpy (`NoRule` for an op it does not cover)."""
    short = name.split(".", 1)[1]
    if short == "compare":
        if "TOTALORDER" in str(_attr(op, "compare_type")):
            raise NoRule
        sh = compat.stablehlo_dialect()
        fn = _NUMPY_COMPARE[sh.ComparisonDirectionAttr(op.attributes["comparison_direction"]).value]
    elif short == "convert":
        return np.asarray(operands[0]).astype(tensor_aval(op.results[0].type).dtype)
    elif short == "bitcast_convert":
        return np.asarray(operands[0]).view(tensor_aval(op.results[0].type).dtype)
    elif short == "divide" and not np.issubdtype(np.asarray(operands[0]).dtype, np.inexact):
        raise NoRule  # lax's integer division rounds toward zero
    else:
        fn = _NUMPY.get(short)
        if fn is None:
            raise NoRule
    out = np.asarray(fn(*operands))
    dtype = tensor_aval(op.results[0].type).dtype
    return out if out.dtype == dtype else out.astype(dtype)


def run_ops(interp, ops, env, local: dict, probing: bool = False) -> dict:
    """``ops`` run on ``local`` (the region's input and what it computes) and
    the constants of ``env``; probing, on vectors of probes (`_probe_op`)."""
    for op in ops:
        operands = []
        for v in op.operands:
            if v in local:
                operands.append(local[v])
                continue
            value = env[v]
            if probing and not isinstance(value, Splat):
                raise NoRule  # not one value everywhere: no function of x alone
            if not isinstance(value, Splat | np.ndarray | np.generic):
                raise LiftError("a region read a value that is not a constant")
            operands.append(np.asarray(value.value) if probing else value)
        name = op.operation.name
        if probing:
            results = [_probe_op(op, name, operands)]
        else:
            results = interp.run_op(op, name, operands)
        local.update(zip(op.results, results, strict=True))
    return local


def with_derivative(forward, known: Known):
    """``forward`` with the tangent of ``known``'s function (JAX's JVP rule)."""

    @jax.custom_jvp
    def fn(x):
        return forward(x)

    @fn.defjvp
    def _jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return forward(x), jax.jvp(known.fn, (x,), (t,))[1]

    return fn
