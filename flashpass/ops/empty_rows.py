"""`EmptyRows`: the rows an additive mask with a finite fill may empty.

``s + where(keep, 0, fill)`` with ``fill = -1e9`` (or ``finfo.min``...) and
``where(keep, s, fill)`` agree in every query row that keeps a key: an
excluded key's weight underflows to exactly zero either way.  In a row that
keeps *no* key they differ: the additive row is ``softmax(s + fill)``, which
still depends on ``s`` (``s - 1e9`` rounds per key), the ``where`` row is
uniform.  Where a key mask comes from data (padding, lengths, segment ids
from two arrays), the matcher cannot prove every row keeps a key, so it
states the additive mask as its descriptors (each `KeepOp` with the fill)
followed by this op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .base import ScoreOp


@dataclasses.dataclass(frozen=True)
class EmptyRows(ScoreOp):
    """The ``count`` key-excluding score ops before ``score_ops[stop]`` are one
    additive mask ``s + where(all keep, 0, added)``, the bias in ``dtype``.  In
    a query row they leave no key, the scores are the scores before them plus
    ``added`` (every key), as the original computes; in every other row
    nothing changes.

    ``grad`` is the derivative of an empty row's scores in the scores before
    the mask: 1, or, under a floor ``max(s + added, c)`` that ties the
    constant scores there, JAX's ``max``'s, 1/2 (`patterns.clamp`; it is 0
    where the floor lifts them, and then ``added`` is the floor).

    A combinator, not a score op: the spec holds it apart (``spec.empty_rows``),
    and `flashpass.kernels.empty_rows` (its ``combinator``, which
    `flashpass.kernels.combine` runs) runs a spec holding it as two kernel
    calls (the mask's descriptors, and, only when some row is empty, the mask's
    fill added to every score), selected per row.  ``stop`` is set where the
    spec sorts its ops into stages (`flashpass.spec`), from the op's place in
    the matcher's sequence.
    """

    count: int
    added: float
    dtype: Any
    #: Reported only when it is not 1 (`flashpass.spec`'s ``describe``).
    grad: float = dataclasses.field(default=1.0, metadata={"reported": "unless default"})
    #: How many score ops right after the mask's are a term added to its fill
    #: before the scores (``s + (where(keep, 0, added) + a)``) that the fill
    #: absorbs: ``added + a`` rounds to ``added`` for every value ``a`` can
    #: take (`patterns.absorbed`).  An empty row is then ``s + added``, as the
    #: original computes it, so the filled call leaves them out too.
    absorbed: int = dataclasses.field(default=0, metadata={"reported": "unless default"})
    #: Where the mask's ops end in ``score_ops`` (-1: not yet in a spec).
    stop: int = dataclasses.field(default=-1, metadata={"reported": "never"})

    stage = "rows"
    combinator = "empty_rows"

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    def at_offset(self, d, t, s):
        return "rows an additive mask may leave with no key are not run in ring steps"
