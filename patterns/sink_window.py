"""Sink tokens plus a causal sliding window (StreamingLLM), as `SinkWindow`.

``(j < n) | ((j <= i) & (j > i - W))`` on the query and key positions, in
either operand order and any comparison spelling `halfspaces` reads
(``i - j < W``, ``~(j > i)``...): one operand is the single half-space
``j < n`` in the key alone, the other exactly the causal edge ``j <= i`` and
the window's lower edge ``j > i - W``.  Proved symbolically; anything else
(a shifted causal edge, a sink bound on the query) is left to the other
readings, or a dense `Mask`.
"""

from __future__ import annotations

from flashpass.ops.sink_window import SinkWindow

from .common import query_key_axes, score_sizes
from .masks import halfspaces, mask_recogniser


@mask_recogniser(rank=70)
def recognise_sink_window(build, factor, keep_when, fill) -> bool:
    """``(j < n) | ((j <= i) & (j > i - W))`` with static ``n`` and ``W``."""
    axes = query_key_axes(build, factor, fill)
    if axes is None or not keep_when:
        return False
    found = _sinks_and_window(build.scope, factor.base, axes["T"], axes["S"])
    if found is None:
        return False
    sinks, window = found
    _, s_len = score_sizes(build)
    if not (1 <= sinks < s_len and window >= 1):
        return False  # no sink key, or every key one: other readings take it
    return build.add_descriptor(SinkWindow(sinks, window, fill), factor, keep_when, fill)


def _sinks_and_window(scope, base, t, s):
    node = scope.producer(base)
    if node is None or node.prim != "or" or len(node.ins) != 2:
        return None
    sinks = window = None
    for operand in node.ins:
        halves = halfspaces(scope, operand)
        if halves is None:
            return None
        # Each half-space keeps coef . idx + const >= 0; only the query and key axes vary.
        terms = [({a: c for a, c in enumerate(coef) if c}, const) for coef, const in halves]
        if len(terms) == 1 and terms[0][0] == {s: -1}:
            sinks = terms[0][1] + 1  # const - j >= 0: j < const + 1
        elif len(terms) == 2 and ({t: 1, s: -1}, 0) in terms:  # i - j >= 0: j <= i
            lower = [const for coef, const in terms if coef == {t: -1, s: 1}]
            if not lower:
                return None
            window = lower[0] + 1  # j - i + const >= 0: j > i - (const + 1)
        else:
            return None
    return None if sinks is None or window is None else (sinks, window)
