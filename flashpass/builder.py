"""The site builder: from a matched score chain to canonical score ops.

`match.match_site` walks the score chain into typed steps (one dataclass per
piece, defined in its pattern module) and reads the score product's axis
roles.  `SiteBuilder.build_ops` is then a loop: every step's ``apply`` adds
its score ops (`Scale`, `Bias`, `Mask`, `Causal`...), the side arrays they
read (extras, kept un-broadcast), traced scalars folded into q, or an axis
permutation.  Adding a spelling is a step class and a rule in one pattern
module; this file does not change.
"""

from __future__ import annotations

from flashpass.patterns.common import Miss, where
from flashpass.patterns.masks import CausalSource
from flashpass.patterns.probabilities import KnownMask
from flashpass.patterns.softcap import fold_softcap

from .graph import Scope
from .site import ExtraSource, Layout
from .spec import Causal, Mask, excludes, fill_after


class SiteBuilder:
    """Score ops, extras and q scales of one site, built step by step."""

    def __init__(self, scope: Scope, roles: list, layout: Layout):
        self.scope = scope
        self.roles = list(roles)  # role of each score axis, after the steps so far
        self.layout = layout
        self.ops: list = []  # score ops in program order
        self.extras: list = []  # ExtraSource per Bias/Mask index
        self.q_scales: list = []  # traced scalars folded into q: (atom, invert)
        self._causal: list = []  # (Causal op, CausalSource) in program order

    # ------------------------------------------------------------------ for steps

    def permute(self, perm: tuple) -> None:
        self.roles = [self.roles[p] for p in perm]

    def add_extra(self, prof, transform, dtype) -> tuple[int, tuple]:
        """Record a side array read by a Bias/Mask op: ``(index, 4-D shape)``."""
        axes = {self.roles[t]: prof.axes[t] for t in range(len(self.roles))}
        self.extras.append(ExtraSource(prof.base, axes, transform, dtype))
        shape4 = self.layout.extra_shape({r: a is not None for r, a in axes.items()})
        return len(self.extras) - 1, shape4

    def add_causal(self, op: Causal, source: CausalSource) -> None:
        self.ops.append(op)
        self._causal.append((op, source))

    # ------------------------------------------------------------------ the loop

    def build_ops(self, steps) -> Miss | None:
        """Apply every step, then fold soft-caps and settle causal ops."""
        for step in steps:
            problem = step.apply(self)
            if problem is not None:
                return problem
        ops = fold_softcap(self.ops)
        if isinstance(ops, str):
            node = steps[-1].node if steps else None
            return Miss(ops + where(node), node)
        self.ops = ops
        # A causal op may be skipped by kernels only if its fill still excludes
        # keys after the ops that follow it (a later scale or soft-cap can undo
        # that); otherwise it runs as the literal mask or bias it was written as.
        kept = []
        for op, source in self._causal:
            i = next(j for j, o in enumerate(self.ops) if o is op)
            if excludes(fill_after(op.fill, self.ops[i + 1 :])):
                kept.append((op, source))
            else:
                self.ops[i] = source.literal(self)
        self._causal = kept
        return None

    def known_masks(self) -> list:
        """Masks applied to the scores, to recognise them again on the probabilities."""
        known = []
        for op in self.ops:
            if isinstance(op, Mask):
                src = self.extras[op.index]
                axes = tuple(
                    sorted(((r, a) for r, a in src.axes.items() if a is not None), key=str)
                )
                resolved = self.scope.resolve(src.atom)
                known.append(KnownMask(resolved, axes, src.transform != "not", op.index))
        for _, source in self._causal:
            if source.kind == "mask":
                prof, roles = source.profile, source.roles
                pairs = ((roles[t], a) for t, a in enumerate(prof.axes) if a is not None)
                axes = tuple(sorted(pairs, key=str))
                resolved = self.scope.resolve(prof.base)
                known.append(KnownMask(resolved, axes, source.keep_when, None))
        return known
