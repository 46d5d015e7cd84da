"""Logit soft-capping ``c * tanh(s / c)`` (Gemma 2, Grok).

The chain reads it as scale(1/c), tanh, scale(c); `fold_softcap` turns that
triple into one `Softcap(c)` op.  A ``tanh`` in any other position is a miss.
"""

from __future__ import annotations

from .chain import Step, rule


@rule("tanh")
def _tanh(scope, node, out):
    return [Step(node, "tanh", node.ins[0])]


def fold_softcap(ops: list, tanh_marker) -> list | str:
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
