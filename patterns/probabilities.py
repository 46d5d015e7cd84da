"""Between the softmax and ``P·V``: casts, transposes, head masks, dropout.

* ``p.astype(v.dtype)`` (mixed precision) and transposes are layout only.
* ``p * m`` or ``p / m`` where ``m`` is constant along the key axis (Hugging
  Face's ``layer_head_mask``, a per-head or per-query scale): since
  ``(m * P) V == m * (P V)``, it is applied to the kernel output.
* Dropout on the probabilities (``where(bernoulli(...), p / keep, 0)``) is
  recognised and reported, never rewritten: a kernel would draw a different
  random stream.  Run the model deterministically (``deterministic=True``,
  ``dropout_rate=0``) for the rewrite.
"""

from __future__ import annotations

import dataclasses

from flashpass.graph import Scope

from .common import ESCAPE_HINT, Miss, profile, scalar_value, where

#: Primitives whose presence marks a value as random (dropout masks).
RANDOM_PRIMS = frozenset(
    {
        "random_bits",
        "random_wrap",
        "random_seed",
        "threefry2x32",
        "rng_bit_generator",
        "rng_uniform",
        "random_fold_in",
    }
)


@dataclasses.dataclass
class ProbabilityPath:
    atom: object  # the value that enters P·V
    roles: list  # its axis roles
    nodes: set  # recognised equations on the way
    post: list  # output ops: ("scale", atom, {role: axis}, invert) | ("row_any", mask ref)
    consumer: tuple  # (node, operand position) of the P·V candidate


@dataclasses.dataclass(frozen=True)
class KnownMask:
    """A mask already applied to the scores (so re-applying it to ``p`` is known)."""

    base: object  # resolved atom of the mask
    axes: tuple  # sorted (role, axis) pairs
    keep_when: bool
    ref: object  # None for a causal mask (every row keeps a key), else the Mask op index


def walk_probabilities(
    scope: Scope, p, roles: list, ignore=frozenset(), known_masks=()
) -> ProbabilityPath | Miss:
    """Follow the probabilities ``p`` forward to the equation that consumes them.

    ``where(mask, p, 0)`` with a mask that already masked the scores (Keras'
    masked softmax) changes only fully masked rows, to zero: a causal mask has
    none (dropped), a mask array becomes "zero the rows with no kept key".
    """
    nodes: set = set()
    post: list = []
    atom = p
    roles = list(roles)
    while True:
        users = [u for u in scope.consumers(atom) if u[0] not in ignore]
        if scope.is_output(atom) or len(users) != 1:
            node = scope.producer(atom)
            what = (
                "returned by the function"
                if scope.is_output(atom)
                else f"used {len(users)} times, expected only by the P·V product"
            )
            return Miss(f"the attention probabilities{where(node)} are {what}{ESCAPE_HINT}", node)
        node, pos = users[0]
        if node.prim == "convert_element_type":
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "transpose":
            roles = [roles[i] for i in node.params["permutation"]]
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "select_n" and not _is_random(scope, node.ins[0]):
            remask = _remask(scope, node, pos, roles, known_masks)
            if isinstance(remask, Miss):
                return remask
            if remask != "noop":
                post.append(("row_any", remask))
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "dot_general" and _is_batch_scale(scope, node, pos, roles):
            other, m_axes, roles = _batch_scale(scope, node, pos, roles)
            post.append(("scale", other, m_axes, False))
            nodes.add(node)
            atom = node.out
            continue
        if node.prim == "select_n" and _is_random(scope, node.ins[0]):
            return Miss(
                f"dropout on the attention probabilities{where(node)}: not rewritten, a kernel "
                "would draw a different random stream; run deterministically (e.g. "
                "deterministic=True or dropout_rate=0) to rewrite this site",
                node,
            )
        if node.prim in ("mul", "div") and (node.prim == "mul" or pos == 0):
            other = node.ins[1 - pos]
            if _is_random(scope, other):
                return Miss(f"dropout on the attention probabilities{where(node)}", node)
            prof = profile(scope, other, scope.shape(node.out))
            if prof.axes[roles.index("S")] is not None:
                return Miss(
                    f"the probabilities are scaled by a tensor that varies along the key "
                    f"axis{where(node)}",
                    node,
                )
            axes = {roles[t]: prof.axes[t] for t in range(len(roles))}
            post.append(("scale", prof.base, axes, node.prim == "div"))
            nodes.add(node)
            atom = node.out
            continue
        return ProbabilityPath(atom, roles, nodes, post, (node, pos))


def _is_random(scope: Scope, atom) -> bool:
    """Whether ``atom`` depends on a random-number primitive (memoised per scope)."""
    memo = scope.__dict__.setdefault("_random_memo", {})
    stack, order = [scope.resolve(atom)], []
    while stack:  # iterative DFS; results are filled in post-order below
        key = stack.pop()
        node = scope.producer(key)
        if node is None or node in memo:
            continue
        memo[node] = None  # in progress
        order.append(node)
        stack.extend(a for a in node.ins if scope.producer(a) is not None)
    for node in reversed(order):
        memo[node] = node.prim in RANDOM_PRIMS or any(
            memo.get(scope.producer(a)) for a in node.ins if scope.producer(a) is not None
        )
    node = scope.producer(atom)
    return bool(node is not None and memo.get(node))


def _remask(scope: Scope, node, pos: int, roles: list, known_masks):
    """ "noop", a Mask index for "zero fully masked rows", or a Miss."""
    pred, *cases = node.ins
    if len(cases) != 2 or pos == 0:
        return Miss(f"`select_n` on the attention probabilities{where(node)}", node)
    shape = scope.shape(node.out)
    other = profile(scope, cases[2 - pos], shape)
    if not other.is_scalar or scalar_value(scope, other.base) != 0.0:
        return Miss(f"the probabilities are replaced by a non-zero value{where(node)}", node)
    keep_when = pos == 2  # select_n picks cases[pred]; p is case pos-1
    prof = profile(scope, pred, shape)
    axes = tuple(sorted(((roles[t], a) for t, a in enumerate(prof.axes) if a is not None), key=str))
    for known in known_masks:
        if (
            known.base == scope.resolve(prof.base)
            and known.axes == axes
            and known.keep_when == keep_when
        ):
            return "noop" if known.ref is None else known.ref
    return Miss(
        f"the probabilities are masked by a mask that did not mask the scores{where(node)}", node
    )


def _is_batch_scale(scope: Scope, node, pos: int, roles: list) -> bool:
    """A ``dot_general`` contracting nothing whose other operand only has batch
    axes paired with non-key axes of ``p`` (BERT's ``einsum("...hqk,h->...hqk")``)."""
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    if lc or rc:
        return False
    pb, ob = (lb, rb) if pos == 0 else (rb, lb)
    other = node.ins[1 - pos]
    if len(ob) != len(scope.shape(other)):
        return False
    return all(roles[a] != "S" for a in pb)


def _batch_scale(scope: Scope, node, pos: int, roles: list):
    (_, _), (lb, rb) = node.params["dimension_numbers"]
    pb, ob = (lb, rb) if pos == 0 else (rb, lb)
    other = node.ins[1 - pos]
    m_axes = {roles[a]: o for a, o in zip(pb, ob, strict=True)}
    free = [a for a in range(len(roles)) if a not in pb]
    new_roles = [roles[a] for a in pb] + [roles[a] for a in free]
    return other, m_axes, new_roles
