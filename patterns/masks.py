"""Masks on the scores.

* ``jnp.where(mask, s, fill)`` / ``lax.select`` (``select_n``) with a boolean
  mask and a constant scalar fill (``-inf``, ``finfo.min``, ``-1e9``...).
  Either branch may carry the scores; ``mask_a & mask_b`` is split into one
  mask per factor (``where(a & b, s, f) == where(a, where(b, s, f), f)``).
* Causal masks are recognised by *value*, not spelling: a mask (or additive
  bias) that depends on no input is constant-folded, and if it keeps exactly
  the keys ``j <= i + offset`` it becomes a `Causal` op, which kernels run
  without reading any mask (``jnp.tril``, iota comparisons,
  ``flax.linen.make_causal_mask``, Hugging Face's ``causal_mask`` buffers).
"""

from __future__ import annotations

import numpy as np

from flashpass.kernels import EXCLUDING_FILL

from .chain import Step, rule
from .common import Miss, profile, scalar_value, where


@rule("select_n")
def _select(scope, node, out):
    pred, *cases = node.ins
    if len(cases) != 2 or scope.dtype(pred) != np.bool_:
        return Miss(f"select on the scores is not a boolean where{where(node)}", node)
    shape = scope.shape(node.out)
    readings = []
    for chain_pos in (1, 0):
        chain, fill_atom = cases[chain_pos], cases[1 - chain_pos]
        fill_prof = profile(scope, fill_atom, shape)
        if not fill_prof.is_scalar:
            continue
        fill = scalar_value(scope, fill_prof.base)
        if fill is None:
            return Miss(f"masked scores are filled with a traced value{where(node)}", node)
        readings.append(
            Step(
                node,
                "mask",
                chain,
                {
                    "profile": profile(scope, pred, shape),
                    "fill": fill,
                    # select_n picks cases[pred]: the scores survive where pred == chain_pos.
                    "keep_when": bool(chain_pos),
                },
            )
        )
    if not readings:
        return Miss(f"masked scores are filled with a non-scalar value{where(node)}", node)
    return readings


def and_factors(scope, prof):
    """Split a boolean ``a & b & ...`` profile into factor profiles."""
    node = scope.producer(prof.base)
    if node is None or node.prim != "and" or scope.dtype(node.out) != np.bool_:
        return [prof]
    shape = scope.shape(node.out)
    out = []
    for operand in node.ins:
        sub = profile(scope, operand, shape)
        # Compose: target axis -> base axis of `and` -> operand base axis.
        axes = tuple(None if a is None else sub.axes[a] for a in prof.axes)
        out.extend(and_factors(scope, type(prof)(sub.base, axes, prof.target)))
    return out


def causal_offset(keep: np.ndarray) -> int | None:
    """``offset`` if ``keep[i, j] == (j <= i + offset)`` for all i, j, every row
    keeping at least one key; else None."""
    if keep.ndim != 2:
        return None
    t, s = keep.shape
    first = int(keep[0].sum())
    offset = first - 1
    if offset < 0:
        return None
    expect = np.arange(s)[None, :] <= (np.arange(t)[:, None] + offset)
    return offset if np.array_equal(keep, expect) else None


def excluding(fill: float) -> bool:
    """Whether masked keys get exactly zero weight (see kernels.EXCLUDING_FILL)."""
    return fill <= EXCLUDING_FILL
