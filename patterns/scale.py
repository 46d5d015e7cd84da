"""Score scaling: ``s * c``, ``c * s``, ``s / c`` with a constant scalar ``c``.

Covers ``1 / sqrt(d)`` written as a Python float, ``jnp.sqrt``, ``lax.rsqrt`` or
``d ** -0.5`` (all constant-folded), and Hugging Face's ``/ sqrt(head_dim)``.
A query (or key) scaled before the product needs no rule: it is part of q.
A traced scalar (a learned temperature, ``scale=`` passed as an array) is
folded into q, exactly as ``(q * t) @ kᵀ == t * (q @ kᵀ)``; so is a tensor
constant along the keys (XCiT's and Swin V2's per-head temperatures, ``[H, 1,
1]``; a per-query factor), which is one scalar per row of q.  Either must come
before any bias or mask.  A tensor that varies along the keys is no scale of
q and keeps the site.
"""

from __future__ import annotations

import dataclasses

from flashpass.roles import parts
from flashpass.site import ExtraSource, QScale
from flashpass.spec import Scale

from .chain import Step, rule
from .common import Miss, Profile, profile, scalar_value, where


@dataclasses.dataclass
class ConstantScale(Step):
    """``s * value`` with a constant ``value``."""

    value: float

    def apply(self, build) -> None:
        build.ops.append(Scale(self.value))


@dataclasses.dataclass
class TracedScale(Step):
    """``s * t`` (or ``s / t``) with a traced scalar ``t``, or a tensor ``t``
    constant along the keys: folded into q (`QScale`)."""

    prof: Profile
    invert: bool

    def apply(self, build) -> Miss | None:
        if any(not isinstance(op, Scale) for op in build.ops):
            return Miss(
                f"scores scaled by a traced value after a bias or mask{where(self.node)}",
                self.node,
            )
        b, h, hkv = build.layout.groups
        per_row = {*b, *h, *hkv, "T"}  # one value per row of q: constant along the keys
        axes = {}
        for role, axis in zip(build.roles, self.prof.axes, strict=True):
            if axis is None:
                continue
            if not all(p in per_row for p in parts(role)):
                return Miss(
                    "scores multiplied elementwise by a tensor that varies along the keys "
                    f"(only a factor constant along the keys folds into q){where(self.node)}",
                    self.node,
                )
            axes[role] = axis
        dtype = build.scope.dtype(self.prof.base)
        build.q_scales.append(QScale(ExtraSource(self.prof.base, axes, None, dtype), self.invert))
        return None


def _scale_reading(scope, node, chain, side, invert):
    prof = profile(scope, side, scope.shape(node.out))
    if not prof.is_scalar:  # a tensor: a scale only if constant along the keys (`apply`)
        return TracedScale(node, chain, prof, invert)
    value = scalar_value(scope, prof.base)
    if value is None:  # a traced scalar: folded into q by the site
        return TracedScale(node, chain, prof, invert)
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
    return miss


@rule("div")
def _div(scope, node, out):
    step = _scale_reading(scope, node, node.ins[0], node.ins[1], invert=True)
    return step if isinstance(step, Miss) else [step]
