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
reduced, and its gradient adds the one-hot targets before any product), one
no product reads, and an elementwise activation written with ``exp``.
Attention weights are ``exp(s)`` scaled only by factors that do not depend on
the same element's own input: a normaliser reduced from the exp's output,
masks, dropout's keep-mask, constants.  An exp multiplied, divided or
selected on its way to the product by another elementwise function of its
own input (`own_values`) is an activation: the erf expansion of an exact
GELU in a lifted `jax.export` artifact (``exp(-x*x)`` times a rational
function of ``x``), SiLU written as ``x * exp(x) / (1 + exp(x))``.  A
select's predicate counts as a mask even when it compares the scores
(``where(s > t, exp(s), 0)`` is still softmax-like).
"""

from __future__ import annotations

import jax.numpy as jnp

from flashpass import compat
from flashpass.graph import Const, Node, Scope

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

#: Equations whose every output element is a function of the same element of
#: each operand (of the same shape; scalar constants aside).  `own_values`
#: walks back through them only: a reduction or a broadcast mixes elements.
_ELEMENTWISE = frozenset(
    {
        *("neg", "abs", "sign", "exp", "exp2", "expm1", "log", "log1p", "logistic"),
        *("tanh", "sqrt", "rsqrt", "cbrt", "square", "integer_pow", "pow", "erf", "erfc"),
        *("sin", "cos", "tan", "floor", "ceil", "round", "atan2", "rem", "clamp"),
        *("add", "sub", "mul", "div", "max", "min", "select_n"),
        *("convert_element_type", "copy", "copy_p", *compat.VALUE_IDENTITY_PRIMITIVES),
    }
)

#: How many values `own_values` collects before giving up (an erf expansion
#: is some 60 equations).
_MAX_VALUES = 256


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
    """The first ``dot_general`` the exp's values reach as they are, if any:
    not through a combination with another function of the exp's own input
    (`combines_own`), where they are an activation's."""
    own: set | None = None  # the exp's input's own values, when first needed
    stack, seen = [exp.out], set()
    while stack and len(seen) < _MAX_STEPS:
        for node, pos in scope.consumers(stack.pop()):
            if node in seen:
                continue
            seen.add(node)
            if node.prim == "dot_general":
                return node
            if node.prim not in _CARRY:
                continue
            if node.prim in ("mul", "div", "select_n"):
                own = own_values(scope, exp.ins[0]) if own is None else own
                if combines_own(scope, node, pos, own):
                    continue
            stack += [o for o in node.outs if o is not None]
    return None


def own_values(scope: Scope, atom) -> set:
    """The values ``atom`` is an elementwise function of, ``atom`` included.

    Followed back through `_ELEMENTWISE` equations of its shape, not past a
    broadcast or a reduction.  Only float values count: a select's predicate
    is a mask, and a float cast of an integer or boolean an indicator (a
    mask, a position), no element's input value.  A broadcast value is left
    out: it is shared along an axis (a row's max or sum, a bias)."""
    shape = scope.shape(atom)
    found, stack = set(), [scope.resolve(atom)]
    while stack and len(found) < _MAX_VALUES:
        key = stack.pop()
        if isinstance(key, Const) or key in found or not _is_float(scope, key):
            continue
        node = scope.producer(key)
        ins = [] if node is None else [a for a in node.ins if not isinstance(a, Const)]
        if node is not None and node.prim == "broadcast_in_dim":
            continue
        if node is not None and node.prim == "convert_element_type":
            if not all(_is_float(scope, a) for a in ins):
                continue
        found.add(key)
        if node is not None and node.prim in _ELEMENTWISE:
            stack += [a for a in ins if scope.shape(a) == shape]
    return found


def combines_own(scope: Scope, node: Node, pos: int, own: set) -> bool:
    """Whether ``node`` (a mul, div or select), reached by an exp's values at
    operand ``pos``, combines them with another elementwise function of the
    exp's input (``own``: `own_values` of that input)."""
    others = [a for i, a in enumerate(node.ins) if i != pos and not isinstance(a, Const)]
    return any(not own.isdisjoint(own_values(scope, a)) for a in others)


def _is_float(scope: Scope, atom) -> bool:
    return jnp.issubdtype(scope.dtype(atom), jnp.floating)


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
