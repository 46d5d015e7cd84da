"""Additive terms on the scores: biases and additive masks.

``s + bias`` where the bias broadcasts against the scores (ALiBi, T5 relative
bias, Flax ``bias=``, Hugging Face's ``lax.select(mask > 0, 0, finfo.min)``
attention bias), and ``s - x``.  The side operand is recorded by its broadcast
`Profile`, so a ``[B, 1, 1, S]`` padding bias is never materialised as ``T x S``.
Whether a constant additive mask is causal is decided later, by value
(see `masks.causal_offset`).
"""

from __future__ import annotations

from .chain import rule
from .common import profile
from .masks import BiasStep


def _bias_readings(scope, node, pairs, sign):
    shape = scope.shape(node.out)
    readings = []
    for chain, side in pairs:
        if tuple(scope.shape(chain)) != tuple(shape):
            continue
        prof = profile(scope, side, shape)
        # Prefer the reading whose side operand broadcasts (is "smaller").
        rank = 0 if any(a is None for a in prof.axes) or scope.fold(prof.base) is not None else 1
        readings.append((rank, BiasStep(node, chain, prof, sign)))
    return [s for _, s in sorted(readings, key=lambda r: r[0])]


@rule("add", "add_any")
def _add(scope, node, out):
    a, b = node.ins
    return _bias_readings(scope, node, ((a, b), (b, a)), +1)


@rule("sub")
def _sub(scope, node, out):
    return _bias_readings(scope, node, ((node.ins[0], node.ins[1]),), -1)
