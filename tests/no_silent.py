"""The "no silent miss" check shared by the model and fuzz suites.

Every ``exp`` as big as a score matrix whose values reach a ``dot_general``
(patterns/softmax_like.py) is attention's or looks like it: after the pass,
each one left in the program must be accounted for in the report, as a kept
site (a fallback, with its reason), a softmax-like computation not
recognised as attention, or an internal error.  The check reads the program
the pass already traced (nothing is traced again).
"""

from __future__ import annotations

import contextlib

from flashpass import compat
from flashpass.graph import build_scopes
from flashpass.patterns import softmax_like


def softmax_like_exps(closed) -> list:
    """``(scope, exp)`` for each softmax-like exp of ``closed`` (kernel calls
    are opaque: what a kernel computes inside is not the program's)."""
    found = []
    for scope in build_scopes(compat.dce_closed_jaxpr(closed)):
        for node in scope.nodes:
            if softmax_like.is_softmax_like(scope, node) is not None:
                found.append((scope, node))
    return found


def assert_no_silent_miss(opt, report, *args, **kwargs) -> None:
    """No softmax-like exp is left in ``opt``'s rewritten program (for
    ``args``) without a report entry to account for it."""
    left = softmax_like_exps(opt.rewritten_jaxpr(*args, **kwargs))
    entries = len(report.fallbacks) + len(report.unrecognised) + len(report.errors)
    where = [f"{n.prim} {list(s.shape(n.out))} at {n.location}" for s, n in left]
    assert len(left) <= entries, f"softmax-like exps left without a report entry: {where}\n{report}"


@contextlib.contextmanager
def min_len(n: int):
    """The detector's size threshold lowered to ``n`` (the fuzz programs'
    sequences are 3 to 5 long): the guarantee holds at any threshold."""
    saved = softmax_like.MIN_LEN
    softmax_like.MIN_LEN = n
    try:
        yield
    finally:
        softmax_like.MIN_LEN = saved


def assert_kept(fn, args, reason: str) -> None:
    """``fn`` optimized (the blockwise kernel named) and first called under
    ``jax.jit``: nothing rewritten, a site kept with ``reason`` among its
    words, and the original's values."""
    import jax
    import numpy as np

    import flashpass

    opt = flashpass.optimize(fn, kernel="blockwise")
    got = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert not report.rewrites, str(report)
    assert any(reason in f.reason for f in report.fallbacks), str(report)
    np.testing.assert_allclose(got, fn(*args), rtol=1e-6, atol=1e-6)
