"""A mask built outside the body it is used in: a ``scan``'s loop-invariant
constant or a ``remat`` operand read where it is built (`read_outside`), its
small pieces threaded into the body by the rewriter (`masks.add_mask`
calls it first for every mask factor)."""

from __future__ import annotations

import dataclasses

import numpy as np

from .common import Profile
from .indicators import compose
from .masks import add_mask


def read_outside(build, factor: Profile, keep_when: bool, fill: float, at: str = "") -> bool:
    """Read a mask ``factor`` that is a body's input where it is built: a mask
    computed outside a ``scan`` (a loop-invariant constant) or a ``remat`` and
    passed in (`Scope.outside`) is read in the enclosing scope, as `add_mask`
    reads it there.  Kept only when that reading passes no ``T x S`` array and
    no floating one (a descriptor, a causal op, a ``[B, 1, 1, S]`` key mask):
    the ops' extras are then the enclosing scope's values, which the rewriter
    threads into the body as new operands.  Otherwise the builder is left as
    it was and the factor is read in the body (a dense mask).  True when read."""
    scope = build.scope
    if scope.fold(factor.base) is not None:
        return False  # a constant: read by value where it is
    found = scope.outside(factor.base)
    if found is None:
        return False
    parent, atom = found
    saved = {
        name: (len(value) if isinstance(value, list) else value)
        for name, value in vars(build).items()
    }
    outer = compose(parent, dataclasses.replace(factor, base=atom), atom)
    build.scope = parent
    try:
        add_mask(build, outer, keep_when, fill, at)
    finally:
        build.scope = scope
    ops = build.ops[saved["ops"] :]
    extras = build.extras[saved["extras"] :]
    kept = (
        build.problem is saved["problem"]
        and len(build.dense_notes) == saved["dense_notes"]
        and not any(_dense(op) for op in ops)
        and not any(np.issubdtype(np.dtype(e.dtype), np.floating) for e in extras)
    )
    if not kept:
        for name, value in saved.items():
            current = getattr(build, name)
            if isinstance(current, list):
                del current[value:]
            else:
                setattr(build, name, value)
    return kept


def _dense(op) -> bool:
    """Whether a score op reads an array that varies over queries and keys."""
    shape = getattr(op, "shape", None)
    return isinstance(shape, tuple) and len(shape) == 4 and shape[2] != 1 and shape[3] != 1
