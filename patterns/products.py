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

from .common import ESCAPE_HINT, Miss, where

Role = object
_ROLE_NAMES = {"T": "query", "S": "key"}


@dataclasses.dataclass
class ScoreProduct:
    node: Node
    q: object
    k: object
    q_perm: tuple[int, ...]  # q axes in canonical order [b..., T, D]
    k_perm: tuple[int, ...]  # k axes in canonical order [b..., S, D]
    roles: list  # role of each output axis
    n_batch: int
    batch_shape: tuple[int, ...]


@dataclasses.dataclass
class OutputProduct:
    node: Node
    v: object
    v_perm: tuple[int, ...]  # v axes in canonical order [b..., S, Dv]
    roles: list  # role of each output axis
    p_dtype: object
    casts: set  # converts between the probabilities and the product


def _free_axes(rank: int, contract, batch) -> list[int]:
    used = set(contract) | set(batch)
    return [a for a in range(rank) if a not in used]


def score_product(scope: Scope, dot: Node, key_out_axis: int) -> ScoreProduct | Miss:
    """Assign roles to the score ``dot_general`` given which output axis is the
    softmax (key) axis."""
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
    if len(qfree) != 1:
        return Miss(
            f"query operand of the score product has {len(qfree)} free axes "
            f"(grouped-query layouts are not supported yet){where(dot)}",
            dot,
        )
    roles: list = [("b", i) for i in range(nb)]
    free_roles = ["S", "T"] if k_is_lhs else ["T", "S"]
    roles += free_roles
    batch_shape = tuple(scope.shape(lhs)[a] for a in lb)
    return ScoreProduct(
        node=dot,
        q=q,
        k=k,
        q_perm=(*qb, qfree[0], qc[0]),
        k_perm=(*kb, kfree[0], kc[0]),
        roles=roles,
        n_batch=nb,
        batch_shape=batch_shape,
    )


def output_product(scope: Scope, p, p_roles: list) -> OutputProduct | Miss:
    """Find and check ``P·V`` fed by the probabilities ``p`` (whose axes have ``p_roles``)."""
    casts: set = set()
    atom = p
    while True:
        users = scope.consumers(atom)
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
            casts.add(node)
            atom = node.out
            continue
        break
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
    prank, vrank = len(p_roles), len(scope.shape(v))
    if len(pc) != 1 or p_roles[pc[0]] != "S":
        got = [_ROLE_NAMES.get(p_roles[a], "batch") for a in pc]
        return Miss(
            f"P·V contracts the {'/'.join(got)} axis of the probabilities, a different axis "
            f"than the softmax normalises (the key axis){where(node)}",
            node,
        )
    batch_roles = [p_roles[a] for a in pb]
    want = sorted(r for r in p_roles if isinstance(r, tuple))
    if sorted(batch_roles, key=str) != sorted(want, key=str):
        return Miss(
            f"P·V batches over {batch_roles}, expected the score product's batch axes "
            f"{want}{where(node)}",
            node,
        )
    pfree = _free_axes(prank, pc, pb)
    vfree = _free_axes(vrank, vc, vb)
    if [p_roles[a] for a in pfree] != ["T"]:
        return Miss(f"P·V keeps probability axes other than the query axis{where(node)}", node)
    if len(vfree) != 1:
        return Miss(f"value operand has {len(vfree)} free axes, expected one{where(node)}", node)
    # v's batch axis paired with p's batch axis of role ("b", i) is v's ("b", i).
    v_batch = sorted(zip(batch_roles, vb, strict=True), key=lambda rv: rv[0][1])
    v_perm = (*[a for _, a in v_batch], vc[0], vfree[0])
    out_free = ["T", "Dv"] if pos == 0 else ["Dv", "T"]
    roles = [*batch_roles, *out_free]
    return OutputProduct(node, v, v_perm, roles, scope.dtype(atom), casts)
