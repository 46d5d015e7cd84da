"""Logit soft-capping ``c * tanh(s / c)`` (Gemma 2, Grok).

The chain reads it as scale(1/c), tanh, scale(c); `fold_softcap` turns that
triple into one `Softcap(c)` op.  A ``tanh`` in any other position is a miss.
"""

from __future__ import annotations

import dataclasses

from .chain import Step, rule

#: Placeholder score op for a ``tanh`` until `fold_softcap` pairs it with its scales.
TANH = object()


@dataclasses.dataclass
class Tanh(Step):
    """``tanh(s)``: the middle of a soft-cap ``c * tanh(s / c)``."""

    def apply(self, build) -> None:
        build.ops.append(TANH)


@rule("tanh")
def _tanh(scope, node, out):
    return [Tanh(node, node.ins[0])]


def fold_softcap(ops: list, tanh_marker=TANH) -> list | str:
    """Replace ``[Scale(1/c), tanh, Scale(c)]`` by ``Softcap(c)``; a reason on failure."""
    from flashpass.spec import Scale, Softcap

    out = []
    i = 0
    while i < len(ops):
        op = ops[i]
        if op is tanh_marker:
            before = out[-1] if out else None
            after = ops[i + 1] if i + 1 < len(ops) else None
            if (
                isinstance(before, Scale)
                and isinstance(after, Scale)
                and abs(before.value * after.value - 1.0) < 1e-6
            ):
                out[-1] = Softcap(after.value)
                i += 2
                continue
            return "tanh on the scores is not a soft-cap c * tanh(s / c)"
        out.append(op)
        i += 1
    return out
