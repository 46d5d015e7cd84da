"""`Bias` and `Mask`: score ops that read a dense extra array."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from .base import KeepOp, ScoreOp, with_shape


@dataclasses.dataclass(frozen=True)
class Bias(ScoreOp):
    """``s = s + extras[index]``; ``shape`` is 4-D and broadcastable to the scores."""

    index: int
    shape: tuple[int, ...]
    dtype: Any

    descriptors_doc = {"bias": "additive bias"}

    def extras_read(self):
        return (self.index,)

    def grad_extras(self):
        return (self.index,)

    def apply(self, s, extras, at):
        return s + extras[self.index].astype(s.dtype)

    def at_offset(self, d, t, s):
        return with_shape(self, lambda shape: step_shape(shape, t, s))

    def localized(self, shape4):
        return with_shape(self, shape4)


@dataclasses.dataclass(frozen=True)
class Mask(KeepOp):
    """``s = where(extras[index], s, fill)``: ``True`` keeps the score."""

    index: int
    shape: tuple[int, ...]
    fill: float

    descriptors_doc = {
        "mask": "boolean mask varying over queries",
        "key_mask": "key (padding) mask `[B|1, H|1, 1, S]`",
    }
    word = "dense"

    def descriptor(self, spec):
        return "key_mask" if self._rows_cols(spec)[0] == 1 else "mask"

    def _rows_cols(self, spec) -> tuple[int, int]:
        known = 0 <= self.index < len(spec.extras)
        shape = tuple(spec.extras[self.index].shape) if known else tuple(self.shape)
        return (shape[-2], shape[-1]) if len(shape) >= 2 else (1, 1)

    def report_word(self, spec) -> str:
        """What the kernel receives: ``key mask`` for an O(B·S) ``[.., 1, S]``
        operand, ``query mask`` for ``[.., T, 1]``, ``dense`` only for a real
        ``[.., T, S]`` one."""
        rows, cols = self._rows_cols(spec)
        if rows == 1:
            return "key mask"
        return "query mask" if cols == 1 else "dense"

    def extras_read(self):
        return (self.index,)

    def keep(self, qi, kj, extras, kv_len=None):
        return extras[self.index]

    def row_keys(self):
        return "maybe none"

    def apply(self, s, extras, at):  # (no positions needed)
        return jnp.where(extras[self.index], s, jnp.asarray(self.fill, s.dtype))

    def at_offset(self, d, t, s):
        return with_shape(self, lambda shape: step_shape(shape, t, s))

    def localized(self, shape4):
        return with_shape(self, shape4)


def step_shape(shape, t: int, s: int) -> tuple:
    """An extra's shape on a ring step of ``t`` queries and ``s`` keys."""
    b, h, rows, cols = shape
    return (b, h, t if rows > 1 else 1, s if cols > 1 else 1)
