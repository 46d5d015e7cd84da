"""Score scaling: ``s * c``, ``c * s``, ``s / c`` with a constant scalar ``c``.

Covers ``1 / sqrt(d)`` written as a Python float, ``jnp.sqrt``, ``lax.rsqrt`` or
``d ** -0.5`` (all constant-folded), and Hugging Face's ``/ sqrt(head_dim)``.
A query (or key) scaled before the product needs no rule: it is part of q.
A traced scalar (a learned temperature, ``scale=`` passed as an array) is
folded into q, exactly as ``(q * t) @ kᵀ == t * (q @ kᵀ)``; it must come
before any bias or mask.
"""

from __future__ import annotations

import dataclasses

from flashpass.spec import Scale

from .chain import Step, rule
from .common import Miss, profile, scalar_value, where


@dataclasses.dataclass
class ConstantScale(Step):
    """``s * value`` with a constant ``value``."""

    value: float

    def apply(self, build) -> None:
        build.ops.append(Scale(self.value))


@dataclasses.dataclass
class TracedScale(Step):
    """``s * t`` (or ``s / t``) with a traced scalar ``t``: folded into q."""

    atom: object
    invert: bool

    def apply(self, build) -> Miss | None:
        if any(not isinstance(op, Scale) for op in build.ops):
            return Miss(
                f"scores scaled by a traced value after a bias or mask{where(self.node)}",
                self.node,
            )
        build.q_scales.append((self.atom, self.invert))
        return None


def _scale_reading(scope, node, chain, side, invert):
    prof = profile(scope, side, scope.shape(node.out))
    if not prof.is_scalar:
        return None
    value = scalar_value(scope, prof.base)
    if value is None:  # a traced scalar: folded into q by the site
        return TracedScale(node, chain, prof.base, invert)
    if value == 0.0 or value != value:
        return Miss(f"scores scaled by {value}{where(node)}", node)
    return ConstantScale(node, chain, 1.0 / value if invert else value)


@rule("mul")
def _mul(scope, node, out):
    a, b = node.ins
    readings, miss = [], None
    for chain, side in ((a, b), (b, a)):
        step = _scale_reading(scope, node, chain, side, invert=False)
        if isinstance(step, Miss):
            miss = step
        elif step is not None:
            readings.append(step)
    if readings:
        return readings
    if miss is not None:
        return miss
    return Miss(f"scores multiplied elementwise by a tensor{where(node)}", node)


@rule("div")
def _div(scope, node, out):
    step = _scale_reading(scope, node, node.ins[0], node.ins[1], invert=True)
    if step is None:
        return Miss(f"scores divided elementwise by a tensor{where(node)}", node)
    return step if isinstance(step, Miss) else [step]
