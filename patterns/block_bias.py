"""Additive terms written into one static rectangular block of the scores.

MViTv2 (timm) adds its decomposed relative positions to all but the class
token's row and column, ``attn[:, :, 1:, 1:] = attn[:, :, 1:, 1:] + rel``
(torchax: a ``scatter``); JAX code writes ``s.at[..., 1:, 1:].add(b)``,
``s.at[..., 1:, 1:].set(s[..., 1:, 1:] + b)`` or ``lax.dynamic_update_slice(s,
s[..., 1:, 1:] + b, starts)``.  Writing into a block at constant starts, with
unit strides and the block's axes the scores' own, is exactly

    s + pad(b)        (b zero-padded from the block to the scores' shape)

* ``scatter-add`` (``scatter-sub``) of updates ``b``: ``b`` (``-b``) is the term;
* ``scatter`` / ``dynamic_update_slice`` (a set) whose updates are the block
  of the *same* scores (a ``slice`` proven to read exactly the written block,
  or the scores themselves when the block is all of them) plus additions,
  also through a split and merge-back reshape (`factored.merged_terms`:
  MViTv2's ``view(B, -1, qh, qw, kh, kw) + rel_h + rel_w``): each addend is a term.

Each term becomes a `Bias` read through `flashpass.terms.Padded` (its own
array, as broadcast as it is, padded when the kernel reads it), so a gradient
reaches it through the padding.  Anything else is kept with the reason: a
block set to a constant or to anything but the scores' block plus terms,
start indices computed at run time, several windows (a strided or gathered
index set), a scatter per batch row (``operand_batching_dims``), a block that
drops axes, writes outside the scores, or combines by ``mul``/``min``/``max``.
A term computed from the scores fails later, as any side operand does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flashpass.terms import Padded

from .chain import Step, rule
from .common import Miss, profile, where
from .factored import ADDS, MAX_TERMS, add_term_bias, merged_terms
from .regroup import reshape_moves

#: Scatters whose combiner adds the updates to the block (the sign of the term).
ADDING = {"scatter-add": 1, "scatter-sub": -1}
#: Scatters whose updates replace the block.
SETTING = ("scatter", "dynamic_update_slice")
#: Scatters that combine otherwise: no addition, kept with the reason.
OTHER = ("scatter-mul", "scatter-min", "scatter-max")

#: Scatter modes that agree on a window inside the operand (`_scatter_block`).
_MODES = ("CLIP", "FILL_OR_DROP", "PROMISE_IN_BOUNDS")


@dataclasses.dataclass(frozen=True)
class Term:
    """One addend of a block: ``base`` (through ``inner``, an `Unsplit` or
    None) with ``axes[t]`` its axis feeding block axis ``t`` (None: broadcast)."""

    base: object
    axes: tuple
    inner: object
    sign: int


@dataclasses.dataclass(frozen=True)
class Block:
    """The static block a write covers: its first indices and its shape."""

    scores: object  # the scores written into (resolved)
    start: tuple
    shape: tuple

    def describe(self) -> str:
        spans = (f"{s}:{s + n}" for s, n in zip(self.start, self.shape, strict=True))
        return "[" + ", ".join(spans) + "]"


@dataclasses.dataclass
class BlockBias(Step):
    """``s`` with terms added into one static block: one `Bias` per term."""

    block: Block
    terms: tuple  # Terms, in program order
    nodes: tuple  # the set's slice, additions and reshapes (read through)

    @property
    def side(self) -> list:
        """The terms (a set's updates read the scores: no side operand)."""
        return [t.base for t in self.terms]

    @property
    def interior(self) -> tuple:
        return self.nodes

    def apply(self, build) -> Miss | None:
        shape = _shape(build.scope, self.chain_in)
        for term in self.terms:
            transform = Padded(
                term.axes, self.block.start, self.block.shape, shape, term.inner, term.sign < 0
            )
            miss = add_term_bias(build, term.base, transform, shape, self.node)
            if miss is not None:
                return miss
        return None


def _shape(scope, atom) -> tuple:
    return tuple(scope.shape(atom))


@rule(*ADDING, *SETTING, *OTHER)
def _block_write(scope, node, out):
    def kept(why: str) -> Miss:
        at = where(node)
        why = why[: -len(at)] if at and why.endswith(at) else why  # said once
        return Miss(f"`{node.prim}` into the scores {why}{at}", node)

    if node.prim in OTHER:
        return kept("combines a block with its updates by `" + node.prim[8:] + "`, not an addition")
    if node.prim == "dynamic_update_slice":
        block = _update_slice_block(scope, node)
    else:
        block = _scatter_block(scope, node)
    if isinstance(block, str):
        return kept(block)
    updates = node.ins[1] if node.prim == "dynamic_update_slice" else node.ins[2]
    if node.prim in SETTING:
        found = _terms(scope, updates, block, MAX_TERMS)
        if isinstance(found, str):
            return kept(
                "sets a block to values that are not that block of the scores plus "
                f"additive terms: {found}"
            )
        terms, nodes = found
    else:
        prof = profile(scope, updates, block.shape)
        terms, nodes = [Term(prof.base, prof.axes, None, ADDING[node.prim])], []
    return [BlockBias(node, node.ins[0], block, tuple(terms), tuple(nodes))]


def _scatter_block(scope, node) -> Block | str:
    """The one block a ``scatter`` writes, or why it is no such block (its
    every dimension number checked)."""
    operand, indices, updates = node.ins[:3]
    dn = node.params["dimension_numbers"]
    if node.prim == "scatter" and not _replaces(node.params.get("update_jaxpr")):
        return "applies a function to a block (`.at[...].apply`), not an addition"
    shape, ushape = _shape(scope, operand), _shape(scope, updates)
    if dn.operand_batching_dims or dn.scatter_indices_batching_dims:
        return (
            f"writes per batch row (operand_batching_dims={tuple(dn.operand_batching_dims)}): "
            "each row at its own positions, not one block"
        )
    value = scope.fold(indices)
    if value is None:
        return "at indices computed at run time (not constants)"
    value = np.asarray(value)
    if value.ndim != 1:
        windows = int(np.prod(value.shape[:-1]))
        return (
            f"writes {windows} windows at gathered positions (indices of shape "
            f"{value.shape}), not one rectangular block"
        )
    if dn.inserted_window_dims:
        return (
            f"drops axes {tuple(dn.inserted_window_dims)} of the block it writes "
            "(inserted_window_dims): the updates do not have the scores' axes"
        )
    if tuple(dn.update_window_dims) != tuple(range(len(shape))) or len(ushape) != len(shape):
        return (
            "writes updates whose axes are not the scores' "
            f"(update_window_dims={tuple(dn.update_window_dims)})"
        )
    dims = tuple(dn.scatter_dims_to_operand_dims)
    if len(dims) != value.shape[0] or len(set(dims)) != len(dims):
        return f"indexes the scores' axes {dims} with {value.shape[0]} start indices"
    start = [0] * len(shape)
    for i, d in zip(value.tolist(), dims, strict=True):
        start[d] = int(i)
    mode = getattr(node.params.get("mode"), "name", str(node.params.get("mode")))
    inside = all(0 <= s and s + u <= n for s, u, n in zip(start, ushape, shape, strict=True))
    if mode not in _MODES:
        return f"in scatter mode {mode}"
    if not inside:
        if mode != "CLIP":  # dropped or undefined; CLIP moves the window inside
            return f"writes outside the scores (starts {tuple(start)}, mode {mode})"
        start = [min(max(s, 0), n - u) for s, u, n in zip(start, ushape, shape, strict=True)]
    # One window: `unique_indices` and `indices_are_sorted` cannot be wrong.
    return Block(scope.resolve(operand), tuple(start), tuple(ushape))


def _replaces(update_jaxpr) -> bool:
    """Whether a ``scatter``'s combiner replaces the block by its updates (no
    jaxpr, or one returning its second argument as it is)."""
    if update_jaxpr is None:
        return True
    jaxpr = getattr(update_jaxpr, "jaxpr", update_jaxpr)
    return not jaxpr.eqns and list(jaxpr.outvars) == [jaxpr.invars[1]]


def _update_slice_block(scope, node) -> Block | str:
    """The block a ``dynamic_update_slice`` with constant starts writes."""
    operand, update, *starts = node.ins
    shape, ushape = _shape(scope, operand), _shape(scope, update)
    start = _clamped_starts(scope, starts, shape, ushape)
    if start is None:
        return "at start indices computed at run time (not constants)"
    return Block(scope.resolve(operand), start, ushape)


def _clamped_starts(scope, starts, shape, size) -> tuple | None:
    """Constant start indices as XLA applies them to a dynamic slice or
    update (clamped so the block fits), or None when one is not constant."""
    out = []
    for atom, n, u in zip(starts, shape, size, strict=True):
        value = scope.fold(atom)
        if value is None or np.asarray(value).size != 1:
            return None
        out.append(min(max(int(np.asarray(value).reshape(())), 0), n - u))
    return tuple(out)


def _reads_block(scope, atom, block: Block) -> bool:
    """Whether ``atom`` is exactly the written block of the same scores."""
    atom = scope.resolve(atom)
    if atom == block.scores:
        return tuple(scope.shape(atom)) == block.shape  # the block is all of them
    node = scope.producer(atom)
    if node is None or scope.resolve(node.ins[0]) != block.scores:
        return False
    if node.prim == "slice":
        strides = node.params.get("strides")
        return (
            (strides is None or all(s == 1 for s in strides))
            and tuple(node.params["start_indices"]) == block.start
            and tuple(scope.shape(atom)) == block.shape
        )
    if node.prim == "dynamic_slice":
        shape = _shape(scope, node.ins[0])
        start = _clamped_starts(scope, node.ins[1:], shape, node.params["slice_sizes"])
        return start == block.start and tuple(node.params["slice_sizes"]) == block.shape
    return False


def _terms(scope, atom, block: Block, budget: int):
    """``(terms, nodes)`` when ``atom`` is the block of the scores plus terms
    (additions, also while split by a reshape merged back), else why not."""
    if _reads_block(scope, atom, block):
        node = scope.producer(scope.resolve(atom))
        is_slice = node is not None and scope.resolve(atom) != block.scores
        return [], [node] if is_slice else []
    node = scope.producer(scope.resolve(atom))
    if node is not None and budget > 0 and node.prim in ADDS:
        a, b = node.ins
        options = [(a, b, -1)] if node.prim == "sub" else [(a, b, 1), (b, a, 1)]
        first = None
        for chain, side, sign in options:
            if scope.shape(chain) != scope.shape(atom):
                continue
            found = _terms(scope, chain, block, budget - 1)
            if isinstance(found, str):
                first = first or found
                continue
            terms, nodes = found
            prof = profile(scope, side, tuple(scope.shape(atom)))
            return [*terms, Term(prof.base, prof.axes, None, sign)], [*nodes, node]
        return first or _what(scope, atom, block)
    if node is not None and budget > 0 and node.prim == "reshape":
        merged = merged_terms(scope, node, reshape_moves)
        if merged is not None:
            found = _terms(scope, merged.src, block, budget - len(merged.terms))
            if isinstance(found, str):
                return found
            terms, nodes = found
            for prof, sign in merged.terms:
                unsplit = merged.unsplit(prof)
                axes = tuple(t if c else None for t, c in enumerate(unsplit.carried()))
                terms.append(Term(prof.base, axes, unsplit, sign))
            return terms, [*nodes, *merged.nodes, node]
    return _what(scope, atom, block)


def _what(scope, atom, block: Block) -> str:
    """What the updates reach instead of the written block, in words."""
    if scope.fold(atom) is not None:
        return "a constant (a fill)"
    node = scope.producer(scope.resolve(atom))
    if node is None:
        return "an input of the function"
    if node.prim in ("slice", "dynamic_slice"):
        if scope.resolve(node.ins[0]) != block.scores:
            return f"`{node.prim}` of another array{where(node)}"
        return (
            f"`{node.prim}` of the scores at another block or stride than the one written "
            f"({block.describe()}){where(node)}"
        )
    return f"`{node.prim}`{where(node)}"
