"""The two products of attention: scores ``Q·Kᵀ`` and output ``P·V``.

Both are ``dot_general`` equations, whatever the source spelling
(``jnp.einsum``, ``@``/``jnp.matmul`` with ``swapaxes``/``transpose``,
``lax.dot_general``) and whichever operand order XLA or the user chose.  Every
dimension number is checked and every axis is given a *role*:

* ``("b", i)`` — the i-th batch axis of the score product (batch, heads, ...),
* ``"T"`` query position, ``"S"`` key position, ``"D"``/``"Dv"`` head dims.

Nothing is a wildcard: the score product must contract exactly one axis (D)
and leave exactly one free axis on each side; the output product must contract
exactly the key axis of the probabilities, batch over exactly the score
product's batch axes, and keep exactly the query axis.
"""

from __future__ import annotations

import dataclasses

from flashpass.graph import Node, Scope
from flashpass.roles import flat, score_batch_roles

from .chain import rule
from .common import Miss, where
from .probabilities import ScoreMasks, walk_probabilities
from .regroup import UNIT, resolve_units

Role = object
_ROLE_NAMES = {"T": "query", "S": "key"}


@dataclasses.dataclass
class ScoreProduct:
    node: Node
    q: object
    k: object
    q_axes: dict  # role -> q axis
    k_axes: dict  # role -> k axis
    roles: list  # role of each output axis
    n_batch: int


@dataclasses.dataclass
class OutputProduct:
    node: Node
    v: object
    v_axes: dict  # role -> v axis
    roles: list  # role of each output axis
    p_dtype: object
    casts: set  # recognised equations between the probabilities and the product
    post: list  # output ops from head masks and re-masking (see probabilities.py)


def _free_axes(rank: int, contract, batch) -> list[int]:
    used = set(contract) | set(batch)
    return [a for a in range(rank) if a not in used]


def score_products(
    scope: Scope, dot: Node, key_out_axis: int, splits=None
) -> list[ScoreProduct] | Miss:
    """Role assignments of the score ``dot_general`` given which output axis is
    the softmax (key) axis.

    ``splits`` (batch axis -> sizes) reads a batch axis as several roles merged
    (`roles.batch_roles`): the score chain splits it by those sizes.

    A query operand with two free axes is grouped-query attention written as a
    5-D einsum (``[B, T, Hkv, G, D]``): one free axis is the query position T,
    the other the group G.  Both readings compute the same function; they are
    returned larger-axis-as-T first and the caller picks the one its masks fit.
    """
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    lhs, rhs = dot.ins
    lrank, rrank = len(scope.shape(lhs)), len(scope.shape(rhs))
    lfree, rfree = _free_axes(lrank, lc, lb), _free_axes(rrank, rc, rb)
    nb = len(lb)
    if key_out_axis < nb:
        return Miss(f"softmax is over a batch axis of the score product{where(dot)}", dot)
    if len(lc) != 1:
        return Miss(
            f"score product contracts {len(lc)} axes, expected exactly one head axis{where(dot)}",
            dot,
        )
    k_is_lhs = key_out_axis < nb + len(lfree)
    if k_is_lhs:
        (k, kc, kb, kfree), (q, qc, qb, qfree) = (lhs, lc, lb, lfree), (rhs, rc, rb, rfree)
    else:
        (q, qc, qb, qfree), (k, kc, kb, kfree) = (lhs, lc, lb, lfree), (rhs, rc, rb, rfree)
    if len(kfree) != 1:
        return Miss(
            f"key operand of the score product has {len(kfree)} free axes, "
            f"expected one{where(dot)}",
            dot,
        )
    if len(qfree) not in (1, 2):
        return Miss(
            f"query operand of the score product has {len(qfree)} free axes, "
            f"expected one (or two for grouped-query attention){where(dot)}",
            dot,
        )
    q_shape = scope.shape(q)
    if len(qfree) == 1:
        labelings = [("T",)]
    else:
        big_first = sorted(range(2), key=lambda i: -q_shape[qfree[i]])
        labelings = [tuple("T" if i == t else "G" for i in range(2)) for t in big_first]
    out = []
    b_roles = score_batch_roles(nb, splits or {})
    for labels in labelings:
        batch = dict(zip(b_roles, qb, strict=True))
        q_axes = {**batch, **dict(zip(labels, qfree, strict=True)), "D": qc[0]}
        k_axes = {**dict(zip(b_roles, kb, strict=True)), "S": kfree[0], "D": kc[0]}
        q_roles = list(labels)
        roles: list = list(b_roles)
        roles += ["S", *q_roles] if k_is_lhs else [*q_roles, "S"]
        out.append(ScoreProduct(dot, q, k, q_axes, k_axes, roles, nb))
    return out


DEAD_FORWARD_HINT = (
    "; if the function differentiates the attention, this is autodiff's dV = Pᵀ·dO and "
    "the forward output is not computed here (e.g. the recompute of a jax.checkpoint "
    "around the attention alone): that backward is kept"
)


#: Consumers that select from a softmax's weights rather than average by them.
SELECTIONS = ("top_k", "approx_top_k", "argmax", "argmin", "sort")


@rule(*SELECTIONS)
def _selected_scores(scope: Scope, node, atom):
    """A softmax over values selected from the scores (``softmax(top_k(x @
    w))``: a mixture-of-experts gate; or top-k attention): each row weighs a
    different subset of its keys, which no attention kernel computes.  Not
    reported as a kept site: a gate is no attention site, and a selection as
    big as a score matrix that reaches a product is still reported, as
    softmax-like (`patterns.softmax_like`)."""
    return Miss(
        f"the softmax normalises values `{node.prim}` selected from the scores{where(node)}",
        node,
        relevant=False,
    )


def output_product(
    scope: Scope,
    p,
    p_roles: list,
    ignore=frozenset(),
    masks=None,
    score_roles=None,
    outputs_ok=False,
) -> OutputProduct | Miss:
    """Find and check ``P·V`` fed by the probabilities ``p`` (whose axes have ``p_roles``).

    ``ignore`` lists consumers of ``p`` that belong to the site already (the
    sum of a deferred normalisation).  ``score_roles`` (the score product's) name
    the size-1 roles a regrouping removed (patterns/regroup.py), given back to
    P's unit axes here.
    """
    path = walk_probabilities(scope, p, p_roles, ignore, masks or ScoreMasks(), outputs_ok)
    if not path and path.readers:
        # Read more than once (in a differentiated program, by autodiff's backward):
        # try each reader as the way on to P·V.  The others are then reads from
        # outside the site, which match.py proves to be its backward or rejects.
        readers = list(dict.fromkeys(path.readers))  # p·p reads p twice
        for reader in readers if len(readers) > 1 or not outputs_ok else ():
            others = frozenset(readers) - {reader}
            found = output_product(scope, p, p_roles, ignore | others, masks, score_roles, True)
            if found:
                return found
    if not path:
        return path
    node, pos = path.consumer
    atom, p_roles = path.atom, path.roles
    if node.prim in SELECTIONS:
        # A softmax whose weights only pick (a mixture-of-experts router's
        # top_k): no P·V to rewrite, not an attention site, nothing to report.
        return Miss(f"softmax weights selected by `{node.prim}`{where(node)}", node, False)
    if node.prim != "dot_general":
        return Miss(
            f"the attention probabilities feed `{node.prim}`, not a P·V product{where(node)}",
            node,
        )
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    if pos == 0:
        pc, pb, vc, vb, v = lc, lb, rc, rb, node.ins[1]
    else:
        pc, pb, vc, vb, v = rc, rb, lc, lb, node.ins[0]
    if node.ins[0] is node.ins[1] or scope.resolve(node.ins[0]) == scope.resolve(node.ins[1]):
        return Miss(f"P·V multiplies the probabilities by themselves{where(node)}", node)
    if score_roles is not None and (UNIT in p_roles or set(flat(score_roles)) - set(flat(p_roles))):
        p_roles = resolve_units(p_roles, score_roles, pb)
        if isinstance(p_roles, str):
            return Miss(p_roles + where(node), node)
    prank, vrank = len(p_roles), len(scope.shape(v))
    if len(pc) != 1 or p_roles[pc[0]] != "S":
        got = [_ROLE_NAMES.get(p_roles[a], "batch") for a in pc] or ["no"]
        # In a differentiated program this is autodiff's dV = Pᵀ·dO where the forward
        # output is dead (the recompute of a jax.checkpoint around the attention alone).
        hint = DEAD_FORWARD_HINT if [p_roles[a] for a in pc] == ["T"] else ""
        return Miss(
            f"P·V contracts the {'/'.join(got)} axis of the probabilities, a different axis "
            f"than the softmax normalises (the key axis){where(node)}{hint}",
            node,
        )
    batch_roles = [p_roles[a] for a in pb]
    # A batch axis may hold several batch roles merged (`Merged`: PyTorch's bmm on
    # [B·H, S, D] values), paired with v's axis of the same roles; a merged group
    # ("G") is a free axis of P, never batched with v.
    want = sorted(r for r in flat(p_roles) if isinstance(r, tuple))
    if sorted(flat(r for r in batch_roles if r != UNIT), key=str) != sorted(want, key=str):
        return Miss(
            f"P·V batches over {batch_roles}, expected the score product's batch axes "
            f"{want}{where(node)}",
            node,
        )
    pfree = _free_axes(prank, pc, pb)
    vfree = _free_axes(vrank, vc, vb)
    want_free = sorted(r for r in p_roles if r in ("T", "G"))
    if sorted(p_roles[a] for a in pfree) != want_free:
        return Miss(f"P·V keeps probability axes other than the query axis{where(node)}", node)
    if len(vfree) != 1:
        return Miss(f"value operand has {len(vfree)} free axes, expected one{where(node)}", node)
    # v's batch axis paired with p's batch axis of role ("b", i) is v's ("b", i);
    # one paired with a unit axis the scores never had must be a unit axis too.
    v_shape = scope.shape(v)
    if any(r == UNIT and v_shape[a] != 1 for r, a in zip(batch_roles, vb, strict=True)):
        return Miss(f"P·V batches a unit axis of the probabilities with v's{where(node)}", node)
    v_axes = {role: a for role, a in zip(batch_roles, vb, strict=True) if role != UNIT}
    v_axes.update({"S": vc[0], "Dv": vfree[0]})
    p_free_roles = [p_roles[a] for a in pfree]
    out_free = [*p_free_roles, "Dv"] if pos == 0 else ["Dv", *p_free_roles]
    roles = [*batch_roles, *out_free]
    return OutputProduct(node, v, v_axes, roles, scope.dtype(atom), path.nodes, path.post)
