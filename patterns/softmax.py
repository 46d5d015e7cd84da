"""Softmax spellings.

Recognised (all normalise over exactly one axis, the key axis):

* ``jax.nn.softmax(s, axis)`` — in JAX 0.10 it traces to
  ``e = exp(s - stop_gradient(max(-inf, reduce_max(s)))); e / reduce_sum(e)``
  (Flax, Haiku, Equinox, Keras and Hugging Face Flax all call it).
* Hand-written ``e = exp(s - s.max(axis, keepdims=True)); e / e.sum(axis, keepdims=True)``
  (nanoGPT-style code), with or without the max subtraction, with the divisor
  broadcast via ``broadcast_in_dim``/``reshape`` or implicit size-1 broadcasting.
* Normalisation written as ``e * (1 / sum)``, over any axis.
* Low precision: a bfloat16 ``exp`` summed in float32 (and the sum cast back,
  ``exp(log_softmax)`` too), a weak-typed ``exp`` cast to a strong type before use.
* ``exp(s - bias)`` with a ``bias`` that varies along the axis: no shift, the
  subtraction is left to the score chain (a negated bias).

Semantics, not spelling: the shift ``c`` in ``exp(s - c)`` may be anything that
is constant along the normalised axis (softmax is invariant to it, value and
gradient), but the normaliser must be the sum of the same ``exp`` over the same
axis.  Anything else is a near miss with a reason.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flashpass.graph import Node, Scope

from .common import Miss, Profile, profile, scalar_value, where


@dataclasses.dataclass
class Softmax:
    exp: Node
    axis: int  # the normalised (key) axis, in the layout of ``s_in``
    s_in: object  # the softmax input (scores after all score ops)
    out: object  # normalised probabilities (unnormalised ``exp`` when deferred)
    nodes: set  # equations that belong to the softmax itself
    dtype: object  # dtype the softmax is computed in
    deferred: object = None  # the sum to divide P·V by, when normalisation is deferred
    shifts: tuple = ()  # the row constants ``c`` subtracted before the exp: ``exp(s - c)``


def match_softmax(scope: Scope, exp: Node) -> Softmax | Miss:
    """Recognise the softmax around ``exp`` (an ``exp`` equation)."""
    e = exp.out
    rank = len(scope.shape(e))
    nodes = {exp}

    # The normaliser: a reduce_sum of this very exp over one axis (possibly of
    # the exp widened first: jnp.sum of bfloat16 accumulates in float32).
    sums = _sums_of(scope, e)
    if not sums:
        return Miss("exp is not normalised by a sum", exp, relevant=False)
    if len(sums) > 1:
        return Miss("exp is summed more than once", exp, relevant=False)
    total, widen = sums[0]
    axes = tuple(total.params["axes"])
    if len(axes) != 1:
        return Miss(f"softmax normalises over several axes {axes}{where(exp)}", exp)
    axis = axes[0] % rank
    nodes.add(total)
    if widen is not None:
        nodes.add(widen)

    deferred = None
    norm = _find_normalisation(scope, e, total, axis)
    if not norm:
        if not _feeds_a_product(scope, e, {total, widen}):
            # logsumexp / log_softmax (cross-entropy losses) sum exps too: not attention
            norm.relevant = False
            return norm
        # Deferred normalisation: (exp @ v) / sum, checked with the P·V product.
        out, deferred = e, total.out
    else:
        norm_node, norm_nodes = norm
        nodes |= norm_nodes
        out = norm_node.out

    # The input: exp(s - c) with c constant along the axis, or exp(s).
    x = exp.ins[0]
    shift = None
    sub = scope.producer(x)
    s_in = x
    if sub is not None and sub.prim == "sub":
        c = sub.ins[1]
        prof = profile(scope, c, scope.shape(x))
        # A ``c`` that varies along the axis is no shift: ``exp(s - bias)`` of an
        # unstabilised softmax, left to the score chain (a negated bias).
        if prof.axes[axis] is None:
            shift, s_in = c, sub.ins[0]
            nodes.add(sub)
        elif scope.producer(sub.ins[0]) in scope.backward_cone([c]):
            return Miss(f"exp(s - c) where c varies along the softmax axis {axis}{where(sub)}", sub)
    shifts = () if shift is None else (shift,)
    # More row constants subtracted right before (code that stabilises the
    # logits itself, then calls jax.nn.softmax): the same invariance.
    while shift is not None:
        sub = scope.producer(s_in)
        if sub is None or sub.prim != "sub":
            break
        c = sub.ins[1]
        if profile(scope, c, scope.shape(s_in)).axes[axis] is not None:
            break
        shifts, s_in = (*shifts, c), sub.ins[0]
        nodes.add(sub)
    return Softmax(exp, axis, s_in, out, nodes, scope.dtype(e), deferred, shifts)


def _sums_of(scope: Scope, e) -> list:
    """``(reduce_sum, widening convert or None)`` for each sum of ``e``."""
    found = []
    for node, _ in scope.consumers(e):
        if node.prim == "reduce_sum":
            found.append((node, None))
        elif node.prim == "convert_element_type" and _widens(scope, e, node.out):
            users = scope.consumers(node.out)
            if len(users) == 1 and users[0][0].prim == "reduce_sum":
                found.append((users[0][0], node))
    return found


def _widens(scope: Scope, src, dst) -> bool:
    """A float-to-float conversion that loses nothing (bfloat16 -> float32...)."""
    a, b = scope.dtype(src), scope.dtype(dst)
    if not (_is_float(a) and _is_float(b)):
        return False
    fa, fb = jnp.finfo(a), jnp.finfo(b)
    return a == b or (fb.bits > fa.bits and fb.nmant >= fa.nmant)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _find_normalisation(scope: Scope, e, total: Node, axis: int):
    """The equation computing ``e / sum`` (or ``e * (1/sum)``) and its helpers."""
    z = scope.resolve(total.out)
    shape = scope.shape(e)
    log_form = _log_normalisation(scope, e, z, axis)
    if log_form is not None:
        return log_form
    for node, pos, view in _uses_through_casts(scope, e):
        if node.prim == "div" and pos == 0:
            prof = profile(scope, node.ins[1], shape)
            helpers = _keepdims_of(scope, prof, z, axis)
            if helpers is not None:
                peeled = _peeled_nodes(scope, node.ins[1], prof.base)
                return node, {node, *view, *helpers, *peeled}
        if node.prim == "mul":
            other = node.ins[1 - pos]
            prof = profile(scope, other, shape)
            recip = scope.producer(prof.base)
            if recip is None or not _is_reciprocal(scope, recip):
                continue
            inner = recip.ins[-1]  # div(1, x) or integer_pow(x, -1)
            inner_prof = profile(scope, inner, scope.shape(inner))
            # The reciprocal's operand, profiled against e: compose the two profiles.
            axes = tuple(None if a is None else inner_prof.axes[a] for a in prof.axes)
            helpers = _keepdims_of(scope, Profile(inner_prof.base, axes, prof.target), z, axis)
            if helpers is not None:
                peeled = _peeled_nodes(scope, other, prof.base)
                peeled |= _peeled_nodes(scope, inner, inner_prof.base)
                return node, {node, recip, *view, *helpers, *peeled}
    return Miss(f"exp is summed over axis {axis} but not divided by that sum{where(total)}", total)


def _uses_through_casts(scope: Scope, e):
    """``(node, operand position, casts)`` for each use of ``e`` and of its
    lossless float casts (a weak-typed exp is cast to a strong type before use)."""
    for node, pos in scope.consumers(e):
        if node.prim == "convert_element_type" and _widens(scope, e, node.out):
            for user, upos in scope.consumers(node.out):
                yield user, upos, (node,)
        else:
            yield node, pos, ()


def _log_normalisation(scope: Scope, e, z, axis: int):
    """``exp(h - log(sum(exp(h))))``: ``jnp.exp(jax.nn.log_softmax(s))``."""
    h = scope.producer(e).ins[0]
    shape = scope.shape(e)
    atom, helpers, saw_log = z, set(), False
    while True:
        # One way on; other readers (autodiff's backward) are checked as escapes.
        users = [
            n
            for n, _ in scope.consumers(atom)
            if n.prim in (*_KEEPDIMS_PRIMS, "sub") or (n.prim == "log" and not saw_log)
        ]
        if len(users) != 1:
            return None
        node = users[0]
        if node.prim in _KEEPDIMS_PRIMS or (node.prim == "log" and not saw_log):
            if node.prim == "convert_element_type" and not _is_float(scope.dtype(node.out)):
                return None
            saw_log = saw_log or node.prim == "log"
            helpers.add(node)
            atom = node.out
            continue
        break
    if not saw_log or node.prim != "sub" or scope.resolve(node.ins[0]) != scope.resolve(h):
        return None
    if profile(scope, node.ins[1], shape).axes[axis] is not None:
        return None
    finals = [n for n, _ in scope.consumers(node.out) if n.prim == "exp"]
    if len(finals) != 1:
        return None
    return finals[0], {node, finals[0], *helpers}


def _feeds_a_product(scope: Scope, e, sum_nodes: set) -> bool:
    """Whether ``e`` (or a cast of it) is read by a product: only a relevance
    test (the P·V product is checked later); in a differentiated program the
    backward reads ``e`` too."""
    stack = [e]
    while stack:
        for node, _ in scope.consumers(stack.pop()):
            if node in sum_nodes:
                continue
            # Layout only: a slice (attention sinks), a cast, a transpose or a
            # reshape (GQA heads merged for the softmax and split back for P·V).
            if node.prim in _LAYOUT_PRIMS:
                stack.append(node.out)
            elif node.prim == "dot_general":
                return True
    return False


#: What may sit between the exp and its product, for `_feeds_a_product`.
_LAYOUT_PRIMS = ("convert_element_type", "slice", "reshape", "transpose", "squeeze")


def _is_reciprocal(scope: Scope, node: Node) -> bool:
    if node.prim == "integer_pow" and node.params.get("y") == -1:
        return True
    return node.prim == "div" and scalar_value(scope, node.ins[0]) == 1.0


#: Between the sum and the divisor: keepdims spellings, and the cast of a sum
#: accumulated in a wider float back to the exp's dtype.
_KEEPDIMS_PRIMS = ("reshape", "broadcast_in_dim", "convert_element_type")


def _keepdims_of(scope: Scope, prof, z, axis: int) -> set | None:
    """Nodes between ``z`` and ``prof.base`` if the profile is ``z`` broadcast back
    along ``axis`` (its other axes in order), else None."""
    if prof.axes[axis] is not None:
        return None
    helpers: set = set()
    base = scope.resolve(prof.base)
    base_rank = len(scope.shape(base))
    # keepdims spelled as a unit reshape of z: follow it back.
    node = scope.producer(base)
    while base != z and node is not None and node.prim in _KEEPDIMS_PRIMS:
        if node.prim == "reshape" and node.params.get("dimensions") is not None:
            return None
        if node.prim == "convert_element_type" and not _is_float(scope.dtype(node.out)):
            return None
        helpers.add(node)
        base = scope.resolve(node.ins[0])
        node = scope.producer(base)
    if base != z:
        return None
    rank = len(prof.axes)
    others = [a for t, a in enumerate(prof.axes) if t != axis]
    if base_rank == rank:  # keepdims layout: axis t of the profile base is axis t
        z_shape = scope.shape(z)
        kept = scope.shape(prof.base)
        if len(z_shape) == rank - 1 and kept != (*z_shape[:axis], 1, *z_shape[axis:]):
            return None
        expect = [t for t in range(rank) if t != axis]
    else:
        expect = list(range(rank - 1))
    return helpers if others == expect else None


def _peeled_nodes(scope: Scope, atom, base) -> set:
    """The broadcast/reshape nodes between ``atom`` and its profile base."""
    out = set()
    base = scope.resolve(base)
    atom = scope.resolve(atom)
    while atom != base:
        node = scope.producer(atom)
        if node is None:
            break
        out.add(node)
        atom = scope.resolve(node.ins[0])
    return out


# --------------------------------------------------------------------------- safe softmax

#: Ops a value keeps its identity through on the way to the guard.
_CASTS = ("convert_element_type", "copy", "copy_p")


def safe_softmax_guard(scope: Scope, node: Node, pos: int) -> set | Miss:
    """Whether ``node`` is PyTorch's safe-softmax guard on the probabilities.

    ``where(all(s == -inf, axis, keepdims), 0, softmax(s, axis))`` (PyTorch's
    ``_safe_softmax``, what ``scaled_dot_product_attention`` lowers to) zeroes
    the rows whose scores are all ``-inf``.  Proven here: ``node`` is a
    ``select_n`` whose probabilities operand (at ``pos``) is exactly the
    normalised softmax of ``s``, whose other operand is 0, and whose predicate
    is ``reduce_and(s == -inf)`` over the softmax axis of that same ``s``,
    broadcast back along that axis only.  Returns the guard's equations (the
    predicate's), or an empty set: not this guard.  Which rows the guard
    zeroes in terms of the score ops is decided by the caller.
    """
    no: set = set()
    if node.prim != "select_n" or len(node.ins) != 3 or pos == 0:
        return no
    pred, *cases = node.ins
    shape = scope.shape(node.out)
    zero = profile(scope, cases[2 - pos], shape)
    if not zero.is_scalar or scalar_value(scope, zero.base) != 0.0:
        return no
    softmax = _softmax_of(scope, cases[pos - 1])
    if softmax is None:
        return no
    found = _row_reduction(scope, pred, shape)
    if found is None:
        return no
    reduce_node, when, axes, nodes = found
    eq = scope.producer(reduce_node.ins[0])
    if reduce_node.prim == "reduce_or":  # not(any(not(s == -inf))), De Morgan's all
        if eq is None or eq.prim != "not":
            return no
        nodes.add(eq)
        eq, when = scope.producer(eq.ins[0]), not when
    if when != (pos == 1):  # the guard's true branch must be the zero
        return no
    if tuple(reduce_node.params["axes"]) != (softmax.axis,):
        return no
    # Broadcast back along the key axis only, the other axes in order.
    for t, a in enumerate(axes):
        expected = None if t == softmax.axis else (t if t < softmax.axis else t - 1)
        if a != expected and not (a is None and shape[t] == 1):
            return no
    if eq is None or eq.prim != "eq":
        return no
    for i in (0, 1):
        other = profile(scope, eq.ins[1 - i], scope.shape(eq.out))
        if (
            scope.resolve(eq.ins[i]) == scope.resolve(softmax.s_in)
            and other.is_scalar
            and scalar_value(scope, other.base) == float("-inf")
        ):
            return {eq, reduce_node, *nodes}
    return Miss(
        f"a guard on the probabilities tests other scores than the softmax's{where(node)}", node
    )


def _row_reduction(scope: Scope, pred, shape):
    """``(reduce_and/or node, polarity, axes, nodes)``: ``pred`` is that
    reduction (polarity True) or its negation, broadcast to ``shape`` with
    ``axes`` (target axis -> reduction output axis), through ``nodes``."""
    nodes: set = set()
    polarity = True
    prof = profile(scope, pred, shape)
    nodes |= _peeled_nodes(scope, pred, prof.base)
    axes = prof.axes
    while (node := scope.producer(prof.base)) is not None and node.prim == "not":
        nodes.add(node)
        polarity = not polarity
        inner = profile(scope, node.ins[0], scope.shape(node.out))
        nodes |= _peeled_nodes(scope, node.ins[0], inner.base)
        axes = tuple(None if a is None else inner.axes[a] for a in axes)
        prof = inner
    if node is None or node.prim not in ("reduce_and", "reduce_or"):
        return None
    return node, polarity, axes, nodes


def _softmax_of(scope: Scope, p) -> Softmax | None:
    """The softmax whose normalised output ``p`` is (through casts), else None."""
    atom = scope.resolve(p)
    while (node := scope.producer(atom)) is not None and node.prim in _CASTS:
        atom = scope.resolve(node.ins[0])
    if node is None or node.prim not in ("div", "mul"):
        return None
    e = scope.resolve(node.ins[0])
    while (exp := scope.producer(e)) is not None and exp.prim in _CASTS:
        e = scope.resolve(exp.ins[0])
    if exp is None or exp.prim != "exp":
        return None
    found = match_softmax(scope, exp)
    if isinstance(found, Miss) or found.deferred is not None:
        return None
    return found if scope.resolve(found.out) == atom else None
