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

Not softmax-like either: a softmax over the columns of a *projection* whose
output also gives the values it weighs (`normalised_projection`).  CoaT's
factorised attention (timm's ``FactorAttnConvRelPosEnc``) computes
``qkv = x·W``, ``softmax(k, axis=tokens)ᵀ·v`` and then ``q·(that)``: its
``exp`` is as big as a score matrix (tokens × channels) and reaches a
product, but what it normalises is a slice of the layer's own ``x·W``, the
same product whose other slices are the queries and the values.  A score
matrix is a product *of* queries and keys and never holds values, so no
queries·keys matrix exists there to be rewritten (the flash kernels'
``softmax(q·kᵀ)·v`` is a different function from ``q·(softmax(k)ᵀ·v)``).
Attention with a learned query (a latent or class token that is a
parameter: Perceiver, timm's attention pooling, CaiT's class attention) is
unaffected: its scores are a product of that query with the keys, and its
values come from another product.
"""

from __future__ import annotations

import jax.numpy as jnp

from flashpass import compat
from flashpass.graph import Const, Node, Scope

from .common import Miss, profile, where

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
    return next(reached_products(scope, exp), None)


def reached_products(scope: Scope, exp: Node):
    """Each ``dot_general`` the exp's values reach as they are, first found
    first (`reached_product`; a training step's backward reads them too)."""
    own: set | None = None  # the exp's input's own values, when first needed
    stack, seen = [exp.out], set()
    while stack and len(seen) < _MAX_STEPS:
        for node, pos in scope.consumers(stack.pop()):
            if node in seen:
                continue
            seen.add(node)
            if node.prim == "dot_general":
                yield node
                continue
            if node.prim not in _CARRY:
                continue
            if node.prim in ("mul", "div", "select_n"):
                own = own_values(scope, exp.ins[0]) if own is None else own
                if combines_own(scope, node, pos, own):
                    continue
            stack += [o for o in node.outs if o is not None]


#: Equations `source_product` reads back through: layout, slices of a
#: product's output (``split`` into q, k, v; ``slice``), casts and copies.
_LAID_OUT = frozenset(
    {
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "slice",
        "split",
        "convert_element_type",
        "copy",
        "copy_p",
        "reshard",
        "sharding_constraint",
        *compat.VALUE_IDENTITY_PRIMITIVES,
    }
)


def source_product(scope: Scope, atom) -> Node | None:
    """The ``dot_general`` whose output ``atom`` is, laid out or sliced, and
    shifted or scaled by terms shared along an axis (a bias, a row max, a
    constant: operands smaller than the value), if any."""
    for _ in range(_MAX_STEPS):
        node = scope.producer(atom)
        if node is None:
            return None
        if node.prim == "dot_general":
            return node
        if node.prim in _LAID_OUT:
            atom = node.ins[0]
            continue
        if node.prim not in ("add", "sub", "mul", "div"):
            return None
        full = [a for a in node.ins if not _shared(scope, a, scope.shape(node.outs[0]))]
        if len(full) != 1:  # two full-size operands: no term shared along an axis
            return None
        atom = full[0]
    return None


def _shared(scope: Scope, atom, shape) -> bool:
    """Whether ``atom`` is shared along an axis of ``shape`` (a constant, or
    broadcast along one: a bias, a row max), explicitly broadcast or not."""
    if isinstance(atom, Const):
        return True
    try:
        return None in profile(scope, atom, shape).axes
    except ValueError:  # does not broadcast to the shape
        return False


def normalised_projection(scope: Scope, exp: Node) -> Node | None:
    """The product whose output ``exp`` normalises when that same product also
    gives the values that a product the exp's values reach weighs with them,
    else None.

    Then the softmax normalises the columns of a projection (``qkv = x·W``:
    the exp reads its ``k`` slice, ``softmax(k)ᵀ·v`` its ``v`` slice), not a
    score matrix: a product of queries and keys holds no values."""
    source = source_product(scope, exp.ins[0])
    if source is None:
        return None
    for product in reached_products(scope, exp):
        if any(source_product(scope, a) is source for a in product.ins):
            return source
    return None


def is_softmax_like(scope: Scope, exp: Node) -> Node | None:
    """The product a softmax-like ``exp`` reaches, or None where the exp is
    not softmax-like: smaller than a score matrix, not a float, reaching no
    product, or normalising a projection that gives its values too."""
    if exp.prim != "exp" or not is_big(scope.shape(exp.out)):
        return None
    if not _is_float(scope, exp.out):
        return None
    product = reached_product(scope, exp)
    if product is None or normalised_projection(scope, exp) is not None:
        return None
    return product


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
    product = is_softmax_like(scope, exp)
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
