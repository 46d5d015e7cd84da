"""The score chain: everything between ``Q·Kᵀ`` and the softmax.

Walking back from the softmax input, each equation must be recognised by a
rule registered here by one of the piece modules (`scale`, `bias`, `masks`,
`softcap`, `layout`, `sinks`...).  A rule returns the possible readings of the equation as
`Step`s (which operand carries the scores, what the other operand means); the
walk tries them in order until one reaches the score ``dot_general``.  An
equation no rule knows ends the match with a reason: nothing is skipped.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
from collections.abc import Callable

from flashpass.graph import Node, Scope

from .common import Miss, where


@dataclasses.dataclass
class Step:
    """One recognised equation of the score chain (a typed piece).

    Each piece module defines its own subclasses with typed fields (a scale
    value, a side-operand `Profile`, a fill...).  ``chain_in`` is the operand
    carrying the scores.  The site builder (patterns/builder.py) is a loop:
    it calls every step's `apply`, which adds the step's score ops, extras or
    axis permutation to the site being built, or returns a `Miss`.
    """

    node: Node
    chain_in: object

    @property
    def side(self) -> list:
        """Side operands (must not depend on the scores)."""
        return [a for a in self.node.ins if a is not self.chain_in]

    @property
    def interior(self) -> tuple:
        """Other equations of the site this step reads through (their outputs
        may depend on the scores and are used only inside the site)."""
        return ()

    def permutation(self) -> tuple | None:
        """The axis permutation this step applies to the scores, if any: for each
        output axis the input axis it is, or None (an axis a regrouping made)."""
        return None

    def apply(self, build) -> Miss | None:
        """Add this step to ``build`` (a `builder.SiteBuilder`)."""
        return None


Rule = Callable[[Scope, Node, object], "list[Step] | Miss"]
RULES: dict[str, Rule] = {}

#: Longest chain walked; real code has a handful of steps.
MAX_STEPS = 64


def rule(*prims: str):
    """Register a chain rule for the given primitive names."""

    def register(fn: Rule) -> Rule:
        for prim in prims:
            if prim in RULES:
                raise ValueError(f"two chain rules for {prim!r}")
            RULES[prim] = fn
        return fn

    return register


@dataclasses.dataclass
class Chain:
    dot: Node
    steps: list  # forward order: from the dot towards the softmax


def walk_chain(scope: Scope, s_in) -> Chain | Miss:
    """From the softmax input back to the score ``dot_general``."""
    return _walk(scope, s_in, [])


def _walk(scope: Scope, atom, steps: list) -> Chain | Miss:
    node = scope.producer(atom)
    if node is None:
        return Miss("the softmax input is not computed from a dot_general (it is an input)")
    if node.prim == "dot_general":
        return Chain(node, list(reversed(steps)))
    if len(steps) >= MAX_STEPS:
        return Miss(
            f"more than {MAX_STEPS} operations between scores and softmax{where(node)}", node
        )
    fn = RULES.get(node.prim)
    if fn is None:
        return Miss(
            f"`{node.prim}` between the score product and the softmax is not a recognised "
            f"score operation{where(node)}",
            node,
        )
    readings = fn(scope, node, atom)
    if isinstance(readings, Miss):
        return readings
    first_miss = None
    for step in readings:
        found = _walk(scope, step.chain_in, [*steps, step])
        if found:
            return found
        if first_miss is None:
            first_miss = found
    if first_miss is not None:
        return first_miss
    return Miss(f"`{node.prim}` could not be read as a score operation{where(node)}", node)


def ensure_loaded() -> None:
    """Import every module of the package so their rules and recognisers are
    registered: a new spelling is a module, listed nowhere else.

    The order of these imports decides nothing: a primitive has one chain rule
    (`rule` refuses a second), and each mask and bias recogniser declares its
    rank (`masks.mask_recogniser`).
    """
    package = __name__.rpartition(".")[0]
    for info in pkgutil.iter_modules(sys.modules[package].__path__):
        importlib.import_module(f"{package}.{info.name}")
