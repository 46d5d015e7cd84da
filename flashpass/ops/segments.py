"""`Segments`: packed documents, a key is seen where its segment id is the row's."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import KeepOp


@dataclasses.dataclass(frozen=True)
class Segments(KeepOp):
    """``s = where(extras[q_index] == extras[kv_index], s, fill)``: packed
    documents.  The extras are the program's own integer segment ids, 4-D
    ``[B|1, H|1, T, 1]`` (queries) and ``[B|1, H|1, 1, S]`` (keys): O(T), never
    ``T x S``.  ``same``: the matcher proved the two are one array read at the
    query and at the key position (``ids[i] == ids[j]``, ``T == S``), which a
    kernel with one shared id array needs."""

    q_index: int
    kv_index: int
    fill: float
    same: bool = False

    descriptors_doc = {"segments": "segment ids (packed documents) `q_ids == kv_ids`"}
    word = "segments"
    reason_words = "segment ids (packed documents)"
    structured = True

    def extras_read(self):
        return (self.q_index, self.kv_index)

    def keep(self, qi, kj, extras, kv_len=None):
        return extras[self.q_index] == extras[self.kv_index]

    def row_keys(self):
        return "own id" if self.same else "maybe none"

    def meets_block(self, r0, r1, c0, c1, extras, kv_len):
        # Some query id among the block's key ids.
        return jnp.any(self.keep(None, None, extras))

    def at_offset(self, d, t, s):
        return dataclasses.replace(self, same=self.same and d == 0)
