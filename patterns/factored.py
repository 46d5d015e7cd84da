"""Additive terms applied while the scores' query and key axes are split into factors.

SAM's and ViTDet's decomposed relative positions (segment-anything,
detectron2, keras-hub) view the ``[B·H, T, S]`` scores as ``[B·H, qh, qw,
kh, kw]`` (query and key positions as 2-D grids), add ``rel_h[..., None]``
and ``rel_w[..., None, :]``, and view the sum back as ``[B·H, T, S]`` before
the softmax.  A row-major reshape and its inverse put every element back in
its place, so

    reshape(reshape(s, split) + t1 + t2, merged) == s + reshape(t1) + reshape(t2)

(each term broadcast to the split shape, then merged): every term is a bias
of the merged shape, added in program order.  The merged term is truly
``T x S`` information (it varies with both grids); it is read as an
`Unsplit` extra, which broadcasts and reshapes the term's own array as the
kernel reads it, so a gradient reaches the term through that transform.

The reading applies to a reshape that merges the scores back exactly (its
input is the inverse reshape of a score value, through ``add``/``sub`` only),
when that split regroups a query or key axis of the score product, which
`patterns.regroup` rejects.  A split of batch axes alone (PyTorch's ``[B·H,
T, S]`` viewed as ``[B, H, T, S]`` around a mask) stays `regroup`'s, whose
masks keep their structure.  Anything else between the two reshapes (a
transpose of the factors, a mask, a product) is no such term: the regrouping
reading then says why the site is kept.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from flashpass.spec import Bias
from flashpass.terms import Unsplit

from .chain import Step
from .common import Miss, Profile, profile, where

#: The equations between the two reshapes: the terms' additions.
ADDS = ("add", "add_any", "sub")

#: Longest run of additions read between the two reshapes.
MAX_TERMS = 16


@dataclasses.dataclass
class SplitTerms(Step):
    """``reshape(reshape(s, split) ± terms, merged)``: each term a `Bias`."""

    terms: tuple  # ((Profile over the split shape, sign), ...), in program order
    nodes: tuple  # the additions and the splitting reshape
    groups: tuple  # the merging reshape's runs: ((split axes, merged axes), ...)
    split: tuple
    merged: tuple

    @property
    def interior(self) -> tuple:
        return self.nodes

    def permutation(self) -> tuple:
        return tuple(range(len(self.merged)))  # every element back in its place

    def apply(self, build) -> Miss | None:
        for prof, sign in self.terms:
            transform = Unsplit(prof.axes, self.split, self.groups, self.merged, sign < 0)
            miss = add_term_bias(build, prof.base, transform, self.merged, self.node)
            if miss is not None:
                return miss
        return None


def add_term_bias(build, base, transform, shape: tuple, node) -> Miss | None:
    """A `Bias` of the term ``base`` read through ``transform`` (`Unsplit`,
    `Padded`: it changes the term's axes to ``shape``, the scores'), added to
    ``build``; nothing for a term that is zero by value (it changes neither
    the scores nor a gradient); a miss for a term that is not floating."""
    scope = build.scope
    value = scope.fold(base)
    if value is not None and not np.any(np.asarray(value)):
        return None
    dtype = scope.dtype(base)
    if not jnp.issubdtype(dtype, jnp.floating):
        return Miss(f"scores biased by a {dtype} tensor{where(node)}", node)
    axes = tuple(j if c else None for j, c in enumerate(transform.carried()))
    index, shape4 = build.add_extra(Profile(base, axes, shape), transform, dtype)
    build.ops.append(Bias(index, shape4, dtype))
    return None


@dataclasses.dataclass(frozen=True)
class MergedTerms:
    """``reshape(reshape(src, split) ± terms, merged)``, read by `merged_terms`."""

    splitting: object  # the reshape of ``src`` to ``split``
    src: object
    terms: tuple  # ((Profile over the split shape, sign), ...), in program order
    nodes: tuple  # the splitting reshape and the additions
    groups: tuple  # the merging reshape's runs: ((split axes, merged axes), ...)
    split: tuple
    merged: tuple

    def unsplit(self, prof, negate: bool = False) -> Unsplit:
        """The `Unsplit` transform reading the term ``prof`` in the merged layout."""
        return Unsplit(prof.axes, self.split, self.groups, self.merged, negate)


def merged_terms(scope, node, moves) -> MergedTerms | None:
    """The reshape ``node`` read as merging back exactly what a reshape split
    from ``src`` (additions only in between), whatever the axes' roles; else
    None.  ``moves`` is `patterns.regroup.reshape_moves`."""
    if node.prim != "reshape" or len(node.ins) != 1 or node.params.get("dimensions") is not None:
        return None
    split, merged = tuple(scope.shape(node.ins[0])), tuple(scope.shape(node.out))
    found = _back(scope, node.ins[0], split, merged, MAX_TERMS)
    if found is None:
        return None
    first, terms, nodes = found
    merging = moves(node, split, merged)
    if isinstance(merging, str):
        return None
    kept, segments = merging
    groups = tuple(((i,), (j,)) for j, i in enumerate(kept) if i is not None)
    groups += tuple((tuple(ins), tuple(outs)) for ins, outs in segments)
    profiles = tuple((profile(scope, side, split), sign) for side, sign in terms)
    return MergedTerms(first, first.ins[0], profiles, tuple(nodes), groups, split, merged)


def split_readings(scope, node, moves, product_axes) -> list:
    """The `SplitTerms` reading of the reshape ``node`` (merging the scores
    back), or none.  ``moves(node, in_shape, out_shape)`` and
    ``product_axes(scope, atom)`` are `patterns.regroup`'s."""
    found = merged_terms(scope, node, moves)
    if found is None:
        return []
    inner = product_axes(scope, found.src)
    splitting = moves(found.splitting, found.merged, found.split)
    if inner is None or isinstance(splitting, str):
        return []
    _, n_batch, origins = inner
    # Only a split of a query or key axis (a free axis of the product): one of
    # batch axes alone is a role-preserving regrouping.
    if not any(
        origins[i] is not None and origins[i] >= n_batch for ins, _ in splitting[1] for i in ins
    ):
        return []
    return [
        SplitTerms(
            node,
            found.src,
            found.terms,
            found.nodes,
            found.groups,
            found.split,
            found.merged,
        )
    ]


def _back(scope, atom, split: tuple, merged: tuple, budget: int):
    """``(splitting reshape, [(term, sign), ...], nodes)`` from ``atom`` back
    through additions to the reshape of a ``merged``-shaped value to ``split``."""
    node = scope.producer(atom)
    if node is None or budget < 0:
        return None
    if (
        node.prim == "reshape"
        and len(node.ins) == 1
        and node.params.get("dimensions") is None
        and tuple(scope.shape(node.ins[0])) == merged
        and tuple(scope.shape(node.out)) == split
    ):
        return node, [], [node]
    if node.prim not in ADDS:
        return None
    a, b = node.ins
    options = [(a, b, -1)] if node.prim == "sub" else [(a, b, 1), (b, a, 1)]
    for chain, side, sign in options:
        if tuple(scope.shape(chain)) != split:
            continue
        found = _back(scope, chain, split, merged, budget - 1)
        if found is not None:
            first, terms, nodes = found
            return first, [*terms, (side, sign)], [*nodes, node]
    return None
