"""Softmax-like computations: no attention is missed silently.

Most ``exp`` equations are not attention (a GELU's, a loss's ``logsumexp``),
so the matcher keeps quiet about those whose softmax it cannot read.  But an
``exp`` that is as big as a score matrix (two axes of at least `MIN_LEN`) and
whose values reach a ``dot_general`` as they are (moved, cast, scaled, masked,
normalised: never summed, logged or added to) is what attention looks like.
When the matcher does not take such an exp as a candidate, it is reported in
its own section, with the first equation that broke the chain, instead of
being left out of the report.

Not softmax-like: an ``exp`` below the size (a softmax over 8 classes, a short
sequence), one summed into a loss (cross-entropy: its ``logsumexp`` is only
reduced, and its gradient adds the one-hot targets before any product), and
one no product reads.
"""

from __future__ import annotations

import jax.numpy as jnp

from flashpass import compat
from flashpass.graph import Node, Scope

from .common import Miss, where

#: Two axes at least this long make an exp as big as a score matrix: the
#: shortest sequence the forced kernels are tested at (tests/spellings.py).
MIN_LEN = 16

#: Equations through which the exp's values reach a product as they are: layout
#: (what P goes through on its way to ``P·V``), casts and copies, and the
#: elementwise operations a softmax, a mask or dropout applies to them.
_CARRY = frozenset(
    {
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "concatenate",
        "pad",
        "convert_element_type",
        "copy",
        "copy_p",
        "reshard",
        "sharding_constraint",
        "mul",
        "div",
        "select_n",
        *compat.VALUE_IDENTITY_PRIMITIVES,
    }
)

#: How far the walk goes before giving up (a softmax is a few equations).
_MAX_STEPS = 64


class SoftmaxLike(Miss):
    """A softmax-like ``exp`` the matcher did not take as attention.

    ``node`` is the exp; ``broke`` the first equation that broke the chain
    (where the matcher stopped), ``product`` the ``dot_general`` it reaches."""

    __slots__ = ("broke", "product")

    def __init__(self, reason: str, exp: Node, broke: Node, product: Node):
        super().__init__(reason, exp)
        self.broke = broke
        self.product = product


def is_big(shape) -> bool:
    """Two axes of at least `MIN_LEN`: as big as a score matrix."""
    return sum(int(d) >= MIN_LEN for d in shape) >= 2


def reached_product(scope: Scope, exp: Node) -> Node | None:
    """The first ``dot_general`` the exp's values reach as they are, if any."""
    stack, seen = [exp.out], set()
    while stack and len(seen) < _MAX_STEPS:
        for node, _ in scope.consumers(stack.pop()):
            if node in seen:
                continue
            seen.add(node)
            if node.prim == "dot_general":
                return node
            if node.prim in _CARRY:
                stack += [o for o in node.outs if o is not None]
    return None


def softmax_like(scope: Scope, exp: Node, miss: Miss) -> SoftmaxLike | None:
    """``miss`` (the matcher's silent reason for ``exp``) as a `SoftmaxLike`
    when the exp is softmax-like, else None."""
    shape = scope.shape(exp.out)
    if not is_big(shape) or not jnp.issubdtype(scope.dtype(exp.out), jnp.floating):
        return None
    product = reached_product(scope, exp)
    if product is None:
        return None
    broke = miss.node if miss.node is not None else exp
    reason = (
        f"`exp` of {list(shape)}{where(exp)} reaches a `dot_general`{where(product)}, but "
        f"the chain broke at `{broke.prim}`{where(broke)}: {_plain(miss.reason)}"
    )
    return SoftmaxLike(reason, exp, broke, product)


def _plain(reason: str) -> str:
    """The matcher's reason without its trailing location (said above)."""
    at = reason.rfind(" at ")
    return reason[:at] if at > 0 and ".py:" in reason[at:] else reason
