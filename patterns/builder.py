"""The site builder: from a matched score chain to canonical score ops.

`match.match_site` walks the score chain into typed steps (one dataclass per
piece, defined in its pattern module) and reads the score product's axis
roles.  `SiteBuilder.build_ops` is then a loop: every step's ``apply`` adds
its score ops (`Scale`, `Bias`, `Mask`, `Causal`...), the side arrays they
read (extras, kept un-broadcast), multipliers folded into q, or an axis
permutation.  Adding a spelling of the score chain (before the softmax) is
a step class and a rule in one pattern module; this loop stays as it is.
"""

from __future__ import annotations

from flashpass.graph import Scope
from flashpass.roles import UNIT
from flashpass.site import ExtraSource, Layout, present_roles
from flashpass.spec import Bias, Causal, excludes, fill_after

from .additive import settle as settle_additive
from .common import Miss, where
from .masks import CausalSource, MaskStep
from .probabilities import ScoreMasks
from .softcap import fold_softcap

#: The report's note for a causal mask passed as the array it was written as.
CAUSAL_LITERAL = (
    "a causal mask is passed as the T x S array it was written as: a later score "
    "operation undoes its fill's exclusion"
)


class SiteBuilder:
    """Score ops, extras and q scales of one site, built step by step."""

    def __init__(self, scope: Scope, roles: list, layout: Layout):
        self.scope = scope
        self.roles = list(roles)  # role of each score axis, after the steps so far
        self.layout = layout
        self.ops: list = []  # score ops in program order
        self.extras: list = []  # ExtraSource per Bias/Mask index
        self.q_scales: list = []  # QScale: multipliers of the scores folded into q
        self._causal: list = []  # (Causal op, CausalSource) in program order
        self.mask_steps: list = []  # MaskSteps, to prove a re-mask of the probabilities
        self.other_exclusions = False  # a key-excluding op not from a MaskStep
        self.sink: str | None = None  # "end"/"start": a sink column concatenated there
        self.problem: Miss | None = None  # set by a step's side array the layout can't take
        self.dense_notes: list = []  # why a mask-like operand stays a dense array
        self.additive: list = []  # AdditiveGroups: additive masks read as descriptors
        self.floors: list = []  # nodes of `max(s, c)` floors read into the ops before

    # ------------------------------------------------------------------ for steps

    def permute(self, perm: tuple) -> None:
        self.roles = [self.roles[p] for p in perm]

    def add_extra(self, prof, transform, dtype) -> tuple[int, tuple]:
        """Record a side array read by a Bias/Mask op: ``(index, 4-D shape)``."""
        # Unit axes carry nothing (the base axis there has size 1); an axis merged
        # from several roles (patterns/regroup.py) is split back when the extra is
        # read (`AttentionSite._extra`).
        axes = {r: a for r, a in zip(self.roles, prof.axes, strict=True) if r != UNIT}
        self.extras.append(ExtraSource(prof.base, axes, transform, dtype))
        shape4 = self.layout.extra_shape(present_roles(axes))
        return len(self.extras) - 1, shape4

    def add_causal(self, op: Causal, source: CausalSource) -> None:
        self.ops.append(op)
        self._causal.append((op, source))

    def add_descriptor(self, op, factor, keep_when: bool, fill) -> bool:
        """Add a structured mask op (a window, chunks, segments...) proven equal
        to the mask ``factor``, as a causal op is added: if a later op undoes
        its fill's exclusion, the literal dense mask is put back.  True (a mask
        recogniser's answer)."""
        self.add_causal(op, CausalSource("mask", factor, keep_when, fill, roles=tuple(self.roles)))
        return True

    # ------------------------------------------------------------------ the loop

    def build_ops(self, steps) -> Miss | None:
        """Apply every step, then fold soft-caps and settle causal ops."""
        for step in steps:
            before, sink = len(self.ops), self.sink
            problem = step.apply(self)  # a Miss is falsy: test for None
            if problem is None and sink is not None and len(self.ops) > before:
                problem = Miss(
                    "a score operation after the sink column is concatenated (it would "
                    "change the sink too)"
                )
            problem = self.problem if problem is None else problem
            if problem is not None:
                if problem.node is None:
                    problem = Miss(problem.reason + where(step.node), step.node)
                return problem
            if isinstance(step, MaskStep):
                self.mask_steps.append((step, tuple(self.roles)))
            elif any(hasattr(op, "fill") for op in self.ops[before:]):
                self.other_exclusions = True
        ops = fold_softcap(self.ops)
        if isinstance(ops, str):
            node = steps[-1].node if steps else None
            return Miss(ops + where(node), node)
        self.ops = ops
        # A causal op may be skipped by kernels only if its fill still excludes
        # keys after the ops that follow it (a later scale or soft-cap can undo
        # that); otherwise it runs as the literal mask or bias it was written as.
        settle_additive(self)
        kept = []
        for op, source in self._causal:
            i = next(j for j, o in enumerate(self.ops) if o is op)
            if excludes(fill_after(op.fill, self.ops[i + 1 :])):
                kept.append((op, source))
            else:
                literal = source.literal(self)  # None: one op of a group, dropped
                self.ops[i] = literal
                if literal is not None and literal.shape[2] != 1 and literal.shape[3] != 1:
                    self.dense_notes.append(CAUSAL_LITERAL)
        self.ops = [op for op in self.ops if op is not None]
        self._causal = kept
        if self.floors and any(isinstance(op, Bias) for op in self.ops):
            node = self.floors[0]
            return Miss(
                "a floor max(scores, c) on a site with a bias that stays an array (the kernel "
                f"adds it without the floor){where(node)}",
                node,
            )
        return None

    def score_masks(self):
        """What `patterns.probabilities` needs to prove a re-mask of the
        probabilities equal to the scores' masks (see `ScoreMasks`)."""
        final = tuple(
            fill_after(op.fill, self.ops[i + 1 :])
            for i, op in enumerate(self.ops)
            if hasattr(op, "fill")
        )
        exact = all(excludes(f) for f in final) and not self.other_exclusions
        return ScoreMasks(
            tuple(self.mask_steps),
            exact=exact,
            sink=self.sink,
            final_fills=final,
            dense_bias=any(isinstance(op, Bias) for op in self.ops),
        )
