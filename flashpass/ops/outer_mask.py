"""`OuterMask`: a mask combining a per-query and a per-key array, by value."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import KeepOp

#: The element-wise combinations an `OuterMask` reads, as the program computes them.
COMBINE = {
    "mul": jnp.multiply,
    "add": jnp.add,
    "sub": jnp.subtract,
    "min": jnp.minimum,
    "max": jnp.maximum,
    "and": jnp.bitwise_and,
    "or": jnp.bitwise_or,
}
#: The comparisons with its scalar (a cast to bool is ``!= 0``).
COMPARE = {
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
    "lt": jnp.less,
    "le": jnp.less_equal,
}


@dataclasses.dataclass(frozen=True)
class OuterMask(KeepOp):
    """``keep = compare(combine(q_side[i], kv_side[j]), value) == keeps``: the
    program's own per-query array ``extras[q_index]`` (``[B|1, H|1, T, 1]``)
    and per-key array ``extras[kv_index]`` (``[B|1, H|1, 1, S]``), combined
    in their own dtype exactly as the program does (an int product wraps as
    it does), so the mask is O(T) data, never ``T x S``: DeBERTa's padding
    mask ``m[i] * m[j]`` read as bool.  ``q_first``: the query side is the
    combination's first operand (``sub`` is not symmetric)."""

    q_index: int
    kv_index: int
    combine: str
    compare: str
    value: float | int | bool
    fill: float
    q_first: bool = True
    keeps: bool = True

    descriptors_doc = {
        "outer_mask": "a mask from a per-query and a per-key array (`m[i] * m[j] != 0`)"
    }
    word = "outer mask"
    reason_words = "a mask combining a per-query and a per-key array"
    structured = True

    def extras_read(self):
        return (self.q_index, self.kv_index)

    def keep(self, qi, kj, extras, kv_len=None):
        a, b = extras[self.q_index], extras[self.kv_index]
        combined = COMBINE[self.combine](*((a, b) if self.q_first else (b, a)))
        kept = COMPARE[self.compare](combined, jnp.asarray(self.value, combined.dtype))
        return kept if self.keeps else ~kept

    def row_keys(self):
        return "maybe none"

    def meets_block(self, r0, r1, c0, c1, extras, kv_len):
        return jnp.any(self.keep(None, None, extras))
