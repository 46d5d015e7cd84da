"""`Scale` and `Softcap`: elementwise maps of every score."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .base import ScoreOp


@dataclasses.dataclass(frozen=True)
class Scale(ScoreOp):
    """``s = s * value`` (a division by ``c`` is recorded as ``1 / c``)."""

    value: float

    uniform = True
    keeps_first_key = True

    @property
    def multiplier(self) -> float:
        return self.value

    def final_score(self, value):
        return value * self.value

    def apply(self, s, extras, at):
        return s * jnp.asarray(self.value, s.dtype)


@dataclasses.dataclass(frozen=True)
class Softcap(ScoreOp):
    """``s = cap * tanh(s / cap)`` (logit soft-capping)."""

    cap: float

    uniform = True
    keeps_first_key = True
    descriptors_doc = {"softcap": "logit soft-cap"}

    def final_score(self, value):
        return self.cap * np.tanh(value / self.cap)

    def apply(self, s, extras, at):
        cap = jnp.asarray(self.cap, s.dtype)
        return cap * jnp.tanh(s / cap)
