"""The lifting rules' registry and what the rules share.

`RULES` maps a StableHLO op name to its rule (`flashpass.export.ops` says what
a rule is); the rules register themselves with `_rule`, by group:
elementwise ops and shapes in `flashpass.export.ops`, contractions and
reductions in `flashpass.export.ops_reduce`, control flow and annotations in
`flashpass.export.ops_flow`.  `fold` evaluates a rule on constants on the host.
"""

from __future__ import annotations

import numpy as np
from jax import lax

from flashpass import compat

from .values import LiftError, Splat, tensor_aval


class NoRule(Exception):
    """This rule does not cover this form of the op."""


def _aval(op, i: int = 0):
    return tensor_aval(op.results[i].type)


def _attr(op, name: str):
    return op.attributes[name] if name in op.attributes else None


def _i64s(attr) -> tuple[int, ...]:
    if attr is None:
        return ()
    ir = compat.ir_module()
    try:
        return tuple(ir.DenseI64ArrayAttr(attr))
    except (ValueError, TypeError):
        return tuple(int(x) for x in np.array(ir.DenseIntElementsAttr(attr)).reshape(-1))


def _int(attr) -> int:
    return compat.ir_module().IntegerAttr(attr).value


def _fold(result):
    """A concrete result (all operands were constants) back to numpy."""
    return result if compat.is_tracer(result) else np.asarray(result)


#: Results with more elements than this are not folded: a large constant
#: computation stays staged, as it was in the program the module came from.
FOLD_LIMIT = 1 << 16

#: Ops with regions whose constant operands are folded (their body is pure).
_FOLDABLE_REGIONS = ("stablehlo.reduce", "stablehlo.reduce_window")


def _is_constant(x) -> bool:
    return isinstance(x, Splat | np.ndarray | np.generic)


def foldable(op, name: str, operands: list) -> bool:
    """Whether ``op`` reads only constants and is folded on the host."""
    if not operands or not all(_is_constant(x) for x in operands):
        return False
    if name not in RULES or name.startswith("sdy.") or name == "stablehlo.custom_call":
        return False
    if len(op.regions) and name not in _FOLDABLE_REGIONS:
        return False
    if all(isinstance(x, Splat) for x in operands) and not len(op.regions):
        return True  # an elementwise or shape op of splats is a splat again
    sizes = [int(np.prod(tensor_aval(r.type).shape)) for r in op.results]
    return sum(sizes) <= FOLD_LIMIT


def fold(interp, op, name: str, operands: list) -> list | None:
    """``op`` evaluated on constant ``operands`` on the host: numpy arrays or
    `Splat`s; None where its rule does not cover this form (an island then)."""
    with compat.compile_time_eval():
        try:
            results = RULES[name](interp, op, operands)
        except NoRule:
            return None
        out = []
        for r in results:
            if isinstance(r, Splat):
                out.append(r)
                continue
            if compat.is_tracer(r):
                raise LiftError(f"{name}: its constant operands did not fold (a lifting bug)")
            out.append(np.asarray(r))
    return out


def as_output(x, aval):
    """A lifted value as an output of the function (constants materialised)."""
    if isinstance(x, Splat):
        return x.array()
    return x


def _index_vector_last(indices, vector: int):
    """``indices`` with StableHLO's index vector axis moved last (added when it
    is the implicit trailing one), the layout lax.gather and lax.scatter take."""
    rank = len(indices.shape)
    if vector == rank:
        return lax.expand_dims(indices, (rank,))
    if vector != rank - 1:
        return lax.transpose(indices, [a for a in range(rank) if a != vector] + [vector])
    return indices


#: Op name -> rule ``(interpreter, op, operands) -> results``.
RULES: dict = {}


def _rule(name):
    def register(fn):
        RULES[name] = fn
        return fn

    return register
