"""An additive mask and a bounded term in one bias: ``s + (where(m, 0, f) + a)``.

Hugging Face BLOOM adds one bias, ``select(mask > 0, 0, finfo.min) + alibi``,
the ALiBi term ``[B, H, 1, S]`` computed from the attention mask (so from the
input).  When ``f + a`` rounds back to ``f`` for every value ``a`` can take
(`bounds.absorbs`, with ``a``'s interval proven from the dtypes and
operations that produce it, `bounds.interval`), the bias is, elementwise and
exactly in the program's arithmetic::

    where(m, 0, f) + a  ==  where(m, a, f)

(where ``m`` keeps a key, ``0 + a == a``; where it excludes, ``f + a == f``).
So the scores are ``s + a`` on kept keys and ``s + f`` on excluded ones: the
additive mask ``where(m, 0, f)`` read as its descriptors (`additive`), then
``a`` as its own op, kept un-broadcast (`Alibi` when a bias recogniser
proves it, else a `Bias` of ``a``'s own shape, O(S) for BLOOM's).  The kernel
computes ``where(m, s, f) + a``: ``s + a`` on kept keys, ``f + a == f`` on
excluded ones.  A row the mask empties is ``s + f`` in the original (each
``f + a`` rounded back to ``f``); `EmptyRows.absorbed` drops the term from
that row's call, so it is ``s + f`` there too.

``a`` has no gradient to lose: its interval is proven only from constants and
integer or boolean values, none of which carries one.  A fill too small to
absorb ``a``'s bound, or a term with no bound (a float input), keeps the bias
one dense array.
"""

from __future__ import annotations

import numpy as np

from flashpass.spec import Bias

from .bounds import absorbs, interval
from .indicators import compose


def split_sum(scope, prof, sign: int):
    """``(mask_prof, term_prof, term_atom)`` when the bias ``sign * prof`` is
    ``mask + term`` (one ``add``, in the bias's float dtype) with ``mask`` an
    additive mask whose fill absorbs every value of ``term``; else None."""
    from .additive import as_mask  # additive imports this module's caller

    if sign < 0:
        return None
    base = scope.resolve(prof.base)
    dtype = np.dtype(scope.dtype(base))
    node = scope.producer(base)
    if node is None or node.prim not in ("add", "add_any") or len(node.ins) != 2:
        return None
    if any(np.dtype(scope.dtype(x)) != dtype for x in node.ins):
        return None
    for mask_in, term_in in (node.ins, node.ins[::-1]):
        mask_prof = compose(scope, prof, mask_in)
        found = as_mask(scope, mask_prof, +1)
        if found is None:
            continue
        if absorbs(found[2], interval(scope, term_in), dtype):
            return mask_prof, compose(scope, prof, term_in), term_in
    return None


def add_absorbed(build, prof, sign: int, at: str = "") -> str | None:
    """Add the ops of ``s + (mask + term)`` (see the module doc) to ``build``;
    None when done, else why the bias stays dense ("" when it is no such sum)."""
    from .additive import _add_factors, as_mask
    from .masks import BIAS_RECOGNISERS

    found = split_sum(build.scope, prof, sign)
    if found is None:
        return ""
    mask_prof, term_prof, term_in = found
    factors, keep_when, fill = as_mask(build.scope, mask_prof, +1)

    def add_term(build) -> None:
        if any(recognise(build, term_prof, +1) for recognise in BIAS_RECOGNISERS):
            return
        dtype = build.scope.dtype(term_prof.base)
        index, shape4 = build.add_extra(term_prof, None, dtype)
        build.ops.append(Bias(index, shape4, dtype))

    # The group is the whole bias: settled back to dense, it is ``prof`` again.
    return _add_factors(build, factors, keep_when, fill, prof, sign, None, at, term=add_term)
