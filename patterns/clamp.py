"""A floor on the scores: ``max(s, c)`` with a constant scalar ``c``.

fairseq ports (XGLM...) clamp the masked scores, ``torch.max(s + mask,
tensor(finfo.min))``, so that ``finfo.min + finfo.min`` cannot overflow to
``-inf``.  Such a floor is read into the ops before it (it adds no op) when
the kernels' semantics then give what the original computes, value and
gradient, in every row:

* every kept score stays above it: ``c <= -KEPT_BOUND``, the bound on real
  scores the fills already assume (`masks.SWALLOWING_FILL`); ``c = -inf``
  is no floor at all.  A floor above it may clip a real score (a ReLU is
  ``max(s, 0)``): the site is kept;
* a key a ``where`` mask excludes with fill ``f`` ends at ``max(f, c)``: the
  fill is unchanged when ``f`` (after the ops between) ends at or above
  ``c``, and is lifted to ``c`` when it ends below (``-inf``: PyTorch's
  boolean mask made additive, whose ``s + -inf`` is ``-inf`` too) and the
  ops between leave ``c`` as it is (other masks: a scale would not); the
  gradient of such a key is zero either way;
* an additive mask with a finite fill ``f`` (`additive`): in a row that
  keeps a key its excluded keys have weight 0 either way.  In a row it may
  leave with no key (`EmptyRows`) the original's scores are ``max(s + f,
  c)``: unchanged when ``f - KEPT_BOUND > c`` (the floor never binds);
  for a fill that swallows every score (``s + f == f``) the constant
  ``max(f, c)``, whose derivative in ``s`` is JAX's ``max``'s at ``(f,
  c)``: 1 above the floor, 1/2 at a tie (XGLM: ``finfo.min`` both), 0
  below.  That derivative is recorded on the `EmptyRows` op and reproduced
  by `flashpass.kernels.empty_rows`; the op must be the last before the
  floor;
* no dense `Bias` is left on the site (a kernel adds it unclamped:
  `flashpass.builder.SiteBuilder.build_ops` checks after the additive masks
  settle).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flashpass.ops import EmptyRows
from flashpass.spec import excludes, fill_after

from .chain import Step, rule
from .common import Miss, profile, scalar_value, where
from .masks import SWALLOWING_FILL
from .softcap import TANH

#: Real scores are assumed to lie in ``(-KEPT_BOUND, KEPT_BOUND)``, the bound
#: under which ``s + SWALLOWING_FILL == SWALLOWING_FILL`` (`masks`).
KEPT_BOUND = 1e30


@dataclasses.dataclass
class FloorStep(Step):
    """``max(s, floor)`` with a constant scalar ``floor``."""

    floor: float

    def apply(self, build) -> Miss | None:
        c = self.floor
        at = where(self.node)
        if c == float("-inf"):
            return None  # the identity on every score
        if c > -KEPT_BOUND:
            return Miss(
                f"a floor max(scores, {c:g}) may clip a kept score (only one at or below "
                f"{-KEPT_BOUND:g}, under every real score, is read){at}",
                self.node,
            )
        if any(op is TANH for op in build.ops):
            return Miss(f"a floor max(scores, c) inside a soft-cap{at}", self.node)
        grouped = [
            g
            for g in build.additive
            if any(g.holds(op) for op in build.ops)
            and not any(g.holds(op) and _minus_inf_rows(op) for op in build.ops)
        ]
        for i, op in enumerate(build.ops):
            if not hasattr(op, "fill") or any(g.holds(op) for g in grouped):
                continue
            later = build.ops[i + 1 :]
            if fill_after(op.fill, later) >= c:
                continue
            if fill_after(c, later) != c:
                return Miss(
                    f"a floor max(scores, c) lifts the fill {op.fill:g} of a mask that later "
                    f"score operations change{at}",
                    self.node,
                )
            _replace(build, op, dataclasses.replace(op, fill=c))
        # An additive -inf mask's empty rows are now ``max(s - inf, c) == c``
        # at every key, derivative 0: the lifted fills' uniform rows, exactly.
        build.ops = [op for op in build.ops if not _minus_inf_rows(op)]
        for group in grouped:
            why = _floor_group(build, group, c)
            if why:
                return Miss(why + at, self.node)
        build.floors.append(self.node)
        return None


def _floor_group(build, group, c: float) -> str | None:
    """Read the floor into an additive mask's ops (see the module doc); why
    not, or None."""
    marks = [op for op in build.ops if group.holds(op) and isinstance(op, EmptyRows)]
    if not marks:
        return None  # every row keeps a key: its excluded keys stay excluded
    op = marks[0]
    f = float(op.added)
    if f - KEPT_BOUND > c:
        return None  # s + f stays above the floor
    if build.ops[-1] is not op:
        return "a floor max(scores, c) after an additive mask and later score operations"
    dtype = np.dtype(op.dtype)
    fd, cd = np.asarray(f, dtype), np.asarray(c, dtype)
    value = float(max(fd, cd))
    if f > SWALLOWING_FILL or value > SWALLOWING_FILL or not excludes(value):
        return (
            f"a floor max(scores, c) clips the scores s + {f:g} of the rows an additive mask "
            "may leave with no key (only a fill that swallows every score is read with a floor)"
        )
    factor = 1.0 if fd > cd else 0.5 if fd == cd else 0.0
    if factor == 1.0:
        return None
    _replace(build, op, dataclasses.replace(op, added=value, grad=op.grad * factor))
    return None


def _minus_inf_rows(op) -> bool:
    return isinstance(op, EmptyRows) and op.added == float("-inf")


def _replace(build, old, new) -> None:
    """Put ``new`` where the op ``old`` is (by identity), in the ops and in
    the records that name it (causal sources, additive groups)."""
    build.ops = [new if op is old else op for op in build.ops]
    build._causal = [(new if op is old else op, src) for op, src in build._causal]
    build.additive = [
        dataclasses.replace(g, ops=tuple(new if op is old else op for op in g.ops))
        for g in build.additive
    ]


@rule("max")
def _max(scope, node, out):
    readings = []
    shape = scope.shape(node.out)
    for chain, side in ((node.ins[0], node.ins[1]), (node.ins[1], node.ins[0])):
        prof = profile(scope, side, shape)
        value = scalar_value(scope, prof.base) if prof.is_scalar else None
        if value is not None and value == value:
            readings.append(FloorStep(node, chain, value))
    if not readings:
        return Miss(f"scores clamped by a traced value or a tensor (max){where(node)}", node)
    return readings
