"""Reshapes of the scores and probabilities that only regroup axis roles.

``jnp.matmul`` squeezes a unit batch axis before its ``dot_general`` and
broadcasts it back after (batch-1 inference, a single head), and DeepMind's
``gemma`` computes grouped-query scores as ``[B, T, Hkv, G, S]`` and reshapes them
to ``[B, T, Hkv*G, S]`` for the softmax, splitting them back before ``P·V``.
Both are a ``reshape`` / ``squeeze`` / ``broadcast_in_dim`` on the score chain (and
its mirror on the probabilities).  One is accepted only when every score axis provably
maps to a role-preserving axis:

* a size-1 axis is added (role `UNIT`) or removed (a `UNIT`, or a batch or group
  role of size 1: its single index carries no information; `resolve_units` gives
  it back to a unit axis at ``P·V``);
* a query or key axis of size 1 (one query: a decode step, a class token) that a
  reshape moves keeps its role on a size-1 axis the reshape makes (the one at the
  same flattened offset); a query axis of size 1 a reshape or squeeze removes is
  given back at ``P·V`` like a batch role; the key axis is never removed;
* non-unit axes are regrouped only within runs of batch / group roles, merged in
  canonical order (batch axes in the score product's order, then the group):
  the merged axis is a `Merged` role that must later be split back exactly;
* the query (T) and key (S) axes stay axes of their own, with their size.

Anything else (mixing query and key, a merge out of canonical order, a split
that does not follow the merged roles, a real broadcast of the scores) is a
near miss with the reason.  No dimension is ever a wildcard.
"""

from __future__ import annotations

import dataclasses
import math

from flashpass.roles import UNIT, Merged, flat
from flashpass.roles import role_name as _name

from .chain import Step, rule, walk_chain
from .common import Miss, where
from .factored import split_readings

#: Primitives read here, on the score chain and on the probabilities.
PRIMS = ("reshape", "squeeze", "broadcast_in_dim")


def _order(role) -> float:
    # Canonical merge order: the score product's batch axes in order, then G.
    return role[1] if isinstance(role, tuple) else math.inf


def _droppable(role) -> bool:
    return role == UNIT or role == "G" or isinstance(role, tuple)


def _segments(in_shape, out_shape):
    """Non-unit axes of a reshape as ``(in axes, out axes)`` runs of equal size."""
    ins = [i for i, d in enumerate(in_shape) if d != 1]
    outs = [j for j, d in enumerate(out_shape) if d != 1]
    segs, i, j = [], 0, 0
    while i < len(ins):
        seg_in, seg_out = [ins[i]], [outs[j]]
        pin, pout = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while pin != pout:
            if pin < pout:
                seg_in.append(ins[i])
                pin *= in_shape[ins[i]]
                i += 1
            else:
                seg_out.append(outs[j])
                pout *= out_shape[outs[j]]
                j += 1
        segs.append((seg_in, seg_out))
    return segs


def reshape_moves(node, in_shape, out_shape):
    """``(kept, segments)``: ``kept[j]`` is the input axis output axis ``j`` is
    (same size), else None; ``segments`` the multi-axis regroupings, or a reason."""
    kept: list = [None] * len(out_shape)
    if node.prim == "squeeze":
        dims = set(node.params["dimensions"])
        rest = [i for i in range(len(in_shape)) if i not in dims]
        for j, i in enumerate(rest):
            kept[j] = i
        return kept, []
    if node.prim == "broadcast_in_dim":
        for i, j in enumerate(node.params["broadcast_dimensions"]):
            if in_shape[i] != out_shape[j]:
                return f"broadcasts the scores along an axis from 1 to {out_shape[j]}"
            kept[j] = i
        new = [j for j in range(len(out_shape)) if kept[j] is None and out_shape[j] != 1]
        if new:
            return f"broadcasts the scores along a new axis of size {out_shape[new[0]]}"
        return kept, []
    if node.params.get("dimensions") is not None:
        return "a reshape that transposes first (`dimensions`)"
    segs = []
    for seg_in, seg_out in _segments(in_shape, out_shape):
        if len(seg_in) == 1 and len(seg_out) == 1:
            kept[seg_out[0]] = seg_in[0]
        else:
            segs.append((seg_in, seg_out))
    return kept, segs


def batch_splits(steps, n_batch: int) -> dict:
    """``batch axis -> sizes``: where the score chain (``steps``, from the score
    product on) splits one batch axis of the score product into several axes,
    the sizes it splits it into (PyTorch's ``bmm`` scores ``[B·H, T, S]`` viewed
    as ``[B, H, T, S]``).  Only a proposal: reading the axis as merged roles of
    these sizes is checked by `regroup` at every step, like any other merge."""
    src = list(range(n_batch + 2))  # score axis -> score product axis (None: made)
    out: dict = {}
    for step in steps:
        if isinstance(step, Regroup) and step.node.prim == "reshape":
            moves = reshape_moves(step.node, step.in_shape, step.out_shape)
            for seg_in, seg_out in [] if isinstance(moves, str) else moves[1]:
                axis = src[seg_in[0]] if len(seg_in) == 1 else None
                if len(seg_out) > 1 and axis is not None and axis < n_batch:
                    out.setdefault(axis, tuple(step.out_shape[j] for j in seg_out))
        perm = step.permutation()
        if perm is not None:
            src = [None if p is None or p >= len(src) else src[p] for p in perm]
    return out


def axis_sources(node, in_shape, out_shape) -> tuple:
    """For each output axis, the input axis it is (unchanged), else None."""
    if node.prim == "broadcast_in_dim":  # a real broadcast is reported by `regroup`
        kept = dict(zip(node.params["broadcast_dimensions"], range(len(in_shape)), strict=True))
        return tuple(kept.get(j) for j in range(len(out_shape)))
    moves = reshape_moves(node, in_shape, out_shape)
    return tuple(moves[0]) if not isinstance(moves, str) else (None,) * len(out_shape)


def axis_origins(node, in_shape, out_shape) -> tuple:
    """For each output axis, the input axis it is or is a factor of (a split of
    one axis), else None (a merge of several, or a new axis)."""
    moves = reshape_moves(node, in_shape, out_shape)
    if isinstance(moves, str):
        return axis_sources(node, in_shape, out_shape)
    out = list(moves[0])
    for seg_in, seg_out in moves[1]:
        if len(seg_in) == 1:
            for j in seg_out:
                out[j] = seg_in[0]
    return tuple(out)


def regroup(node, roles: list, in_shape, out_shape) -> list | str:
    """The roles of ``node``'s output axes, or why it does not preserve them."""
    moves = reshape_moves(node, in_shape, out_shape)
    if isinstance(moves, str):
        return moves
    kept, segs = moves
    out: list = [UNIT if out_shape[j] == 1 else None for j in range(len(out_shape))]
    used = set()
    for j, i in enumerate(kept):
        if i is not None:
            out[j] = roles[i]
            used.add(i)
    for seg_in, seg_out in segs:
        parts = []
        for i in seg_in:
            used.add(i)
            role = roles[i]
            if role in ("T", "S"):
                return f"regroups the {_name(role)} axis with other axes"
            parts += list(role.parts) if isinstance(role, Merged) else [(role, in_shape[i])]
        order = [_order(r) for r, _ in parts]
        if any(a >= b for a, b in zip(order, order[1:], strict=False)):
            return f"merges {Merged(tuple(parts))} out of the score product's axis order"
        k = 0
        for j in seg_out:
            group, size = [], 1
            while size < out_shape[j] and k < len(parts):
                group.append(parts[k])
                size *= parts[k][1]
                k += 1
            if size != out_shape[j]:
                return f"splits {Merged(tuple(parts))} into sizes that are not its roles"
            out[j] = group[0][0] if len(group) == 1 else Merged(tuple(group))
    lost = [i for i in range(len(in_shape)) if i not in used]
    free = [j for j in range(len(out_shape)) if kept[j] is None and out[j] == UNIT]
    homeless = [i for i in lost if roles[i] in ("T", "S")]  # each of size 1
    for i, j in _reinstated(lost, homeless, free, in_shape, out_shape).items():
        out[j] = roles[i]  # the size-1 query or key axis, moved by the reshape
        used.add(i)
    for i in lost:
        if i not in used and not _droppable(roles[i]) and roles[i] != "T":
            return f"removes the {_name(roles[i])} axis"
    return out


def _reinstated(lost: list, homeless: list, free: list, in_shape, out_shape) -> dict:
    """``input axis -> output axis`` for the ``homeless`` among the size-1 input
    axes a reshape does not carry (``lost``), onto the size-1 output axes it
    makes (``free``).

    A size-1 axis holds no data: wherever a row-major reshape puts it, every
    value keeps its place.  Its natural place is the one at the same offset in
    the flattened layout (the product of the sizes before it): the k-th lost
    axis of an offset pairs with the k-th free axis there; a homeless axis left
    over takes a free axis left over, in order."""

    def offset(shape, i):
        return math.prod(shape[:i])

    pairs: dict = {}
    rest = list(free)
    for at in dict.fromkeys(offset(in_shape, i) for i in lost):
        ins = [i for i in lost if offset(in_shape, i) == at]
        outs = [j for j in free if offset(out_shape, j) == at]
        for i, j in zip(ins, outs, strict=False):
            if i in homeless:
                pairs[i] = j
                rest.remove(j)
    for i, j in zip([i for i in homeless if i not in pairs], rest, strict=False):
        pairs[i] = j
    return pairs


def resolve_units(roles: list, want: list, batch_axes) -> list | str:
    """Give the roles in ``want`` missing from ``roles`` (all of size 1, removed by
    a regrouping) back to ``roles``' unit axes: batch roles to the unit axes P·V
    batches over (``batch_axes``), the group to a free one.  Every size is 1, so the
    assignment changes no value; the counts must match exactly."""
    merged = [r for r in roles if isinstance(r, Merged) and "G" in flat([r])]
    if merged:
        return f"the probabilities reach P·V with {merged[0]} merged into one axis"
    present = flat(roles)
    missing = [r for r in flat(want) if r not in present]
    out = list(roles)
    for in_batch in (True, False):
        units = [t for t, r in enumerate(roles) if r == UNIT and (t in batch_axes) == in_batch]
        lost = sorted((r for r in missing if isinstance(r, tuple) == in_batch), key=_order)
        # Unit batch axes and lost batch roles need not pair up one to one (G6):
        # a unit axis the score product never had (jnp.matmul squeezed it for
        # Q·Kᵀ, an einsum keeps it for P·V) stays UNIT, a size-1 batch axis v
        # and the output carry too; a lost role P·V never gets back (squeezed
        # for P·V only) is absent from v and the output (match.py checks that
        # it has size 1).
        # A lost query axis or group (size 1) P·V has no unit axis for stays absent
        # from P and the output, like a batch role; a unit axis left over is not
        # the scores'.
        if len(units) > len(lost) and not in_batch:
            return "the probabilities reach P·V with unit axes that are not the score product's"
        for t, r in zip(units, lost, strict=False):
            out[t] = r
    return out


@dataclasses.dataclass
class Regroup(Step):
    """A role-preserving reshape / squeeze / broadcast of the scores."""

    in_shape: tuple
    out_shape: tuple

    def permutation(self) -> tuple:
        return axis_sources(self.node, self.in_shape, self.out_shape)

    def apply(self, build) -> Miss | None:
        roles = regroup(self.node, build.roles, self.in_shape, self.out_shape)
        if isinstance(roles, str):
            return Miss(
                f"`{self.node.prim}` between the score product and the softmax {roles}"
                f"{where(self.node)}",
                self.node,
            )
        build.roles = roles
        return None


def product_axes(scope, atom):
    """``(product, n_batch, origins)``: the score product ``atom`` is read
    back to (through the score chain's rules, `patterns.chain`), its number of
    batch axes, and for each axis of ``atom`` the product's output axis it is
    or is a factor of (None: an axis a merge made); None when no reading
    reaches a product."""
    chain = walk_chain(scope, atom)
    if not chain:
        return None
    origins = list(range(len(scope.shape(chain.dot.out))))
    for step in chain.steps:
        perm = step.permutation()
        if isinstance(step, Regroup):
            perm = axis_origins(step.node, step.in_shape, step.out_shape)
        if perm is not None:
            origins = [None if p is None or p >= len(origins) else origins[p] for p in perm]
    if len(origins) != len(scope.shape(atom)):
        return None
    return chain.dot, len(chain.dot.params["dimension_numbers"][1][0]), origins


@rule(*PRIMS)
def _regroup(scope, node, out):
    if node.prim == "reshape" and len(node.ins) != 1:
        return Miss(f"`reshape` of the scores with dynamic shape{where(node)}", node)
    src = node.ins[0]
    # Terms added while a query or key axis is split (patterns/factored.py) first.
    split = split_readings(scope, node, reshape_moves, product_axes)
    return [*split, Regroup(node, src, tuple(scope.shape(src)), tuple(scope.shape(node.out)))]
