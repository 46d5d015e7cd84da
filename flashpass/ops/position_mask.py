"""`PositionMask`: a comparison of query and key positions read from inputs."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import KeepOp

_CMP = {"lt": jnp.less, "le": jnp.less_equal, "gt": jnp.greater, "ge": jnp.greater_equal}


@dataclasses.dataclass(frozen=True)
class PositionMask(KeepOp):
    """``s = where(cmp(kv_pos + kv_add, q_pos + q_add), s, fill)``.

    ``q_pos = extras[q_index]`` (``[B|1, H|1, T, 1]``) and ``kv_pos =
    extras[kv_index]`` (``[B|1, H|1, 1, S]``) are the program's own integer
    position arrays (gemma's ``positions``, the same array on both sides in
    self-attention): O(T), never ``T x S``.  ``cmp`` is ``lt``, ``le``,
    ``gt`` or ``ge``, and the constants are added in the positions' dtype,
    exactly as the program adds them (so wrap-around matches too): gemma's
    sliding mask ``kv_pos > q_pos - W`` is ``cmp="gt", q_add=-W``, its causal
    mask ``kv_pos <= q_pos`` is ``cmp="le"``.
    """

    q_index: int
    kv_index: int
    cmp: str
    fill: float
    kv_add: int = 0
    q_add: int = 0

    descriptors_doc = {
        "positions": "comparison of query and key positions from inputs (`kv_pos > q_pos - W`)"
    }
    word = "positions"
    reason_words = "a mask on query and key positions from inputs"

    def extras_read(self):
        return (self.q_index, self.kv_index)

    def keep(self, qi, kj, extras, kv_len=None):
        q, k = extras[self.q_index], extras[self.kv_index]
        return _CMP[self.cmp](
            k + jnp.asarray(self.kv_add, k.dtype), q + jnp.asarray(self.q_add, q.dtype)
        )

    def at_offset(self, d, t, s):
        return self  # (the positions travel with their blocks, as segment ids do)
