"""Additive masks as descriptors: ``s + bias`` where the bias is a mask.

``s + where(m, 0, NEG)``, ``s + (1 - m) * -1e9``, ``s + lax.select(m, zeros,
full(NEG))``, ``s + bias[None, None]``, with ``NEG`` any excluding constant
(``finfo.min``, ``-2.38e38``, ``-1e9``, ``-0.7 * finfo.max``) and ``m`` a
boolean or a two-valued int/float mask (`indicators.two_valued`), are read by
value as ``where(f_1 & f_2 & ..., s, NEG)``.  Each factor then goes to the
mask readers (`masks.add_mask`'s: causal, window, chunk, prefix, sink window,
segment ids...).

The two spellings agree exactly, value and gradient, in every row that keeps
a key: an excluded key's weight is ``exp(s + NEG - max) == 0`` either way, and
so is its gradient.  In a row with every key excluded they do not (the
additive row still depends on ``s``).  When every query row provably keeps a
key (each new op keeps the diagonal ``j = i`` or ``j = i + S - T``, checked
with the ops' own ``keep`` on every row), the descriptors are all.  Otherwise
(a key mask from an input, segment ids from two arrays, kv lengths, a mask
that excludes the diagonal) an `EmptyRows` op follows them, and the rows
they leave empty are computed as the original's ``softmax(s + fill)``
(`flashpass.kernels.empty_rows`).  Only a factor that is itself a ``T x S``
mask, a second such additive mask on the site, or another bias on the
scores with no bound that the fill still excludes beyond (`_spread`), keeps
the bias whole, with the reason recorded for the report
(`SiteBuilder.dense_notes`).  A fill of
exactly ``-inf`` makes such a row NaN in both spellings, but only the
additive one passes that NaN on to the scores' cotangent (``where`` drops
it at every excluded key, ``+`` does not), so q and k get NaN gradients
from it: such a mask gets an `EmptyRows` op too (`-inf` added), whatever
its factors (a dense factor stays a boolean `Mask`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from flashpass.ops import EmptyRows, Mask, Positional, Segments
from flashpass.site import Filled, Transform
from flashpass.spec import Bias, excludes, fill_after

from .indicators import two_valued


@dataclasses.dataclass(eq=False)
class AdditiveSource:
    """Where the descriptors of one additive mask came from: if a later op
    undoes their fill's exclusion, the first is replaced by the original bias
    and the others dropped (`SiteBuilder.build_ops`)."""

    profile: object
    sign: int
    first: bool
    #: The bias is ``where(profile, 0, fill)`` of a boolean profile, never
    #: written as an array (`add_filled`); None: the profile is the bias.
    filled: Filled | None = None

    def literal(self, build):
        if not self.first:
            return None
        return literal_bias(build, self.profile, self.sign, self.filled)


def literal_bias(build, profile, sign: int, filled: Filled | None = None) -> Bias:
    """The additive mask as the one bias it is: the program's array (negated
    for ``s - bias``), or ``where(pred, 0, fill)`` of its boolean ``pred``."""
    if filled is not None:
        index, shape4 = build.add_extra(profile, filled, filled.dtype)
        return Bias(index, shape4, filled.dtype)
    dtype = build.scope.dtype(profile.base)
    index, shape4 = build.add_extra(profile, Transform.NEG if sign < 0 else None, dtype)
    return Bias(index, shape4, dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class AdditiveGroup:
    """The ops one additive mask with a finite fill became (its descriptors,
    and an `EmptyRows` op when rows may be empty).  `settle` turns them back
    into the one dense bias they were written as when the site's other ops
    make them inexact."""

    profile: object
    sign: int
    ops: tuple
    at: str = ""  # where the bias is added, for the report
    filled: Filled | None = None  # as `AdditiveSource.filled`

    def holds(self, op) -> bool:
        """Whether ``op`` is one of the group's (by identity: equal ops of
        another mask are not)."""
        return any(op is g for g in self.ops)

    def why_dense(self, build, others) -> str | None:
        """Why the group must be the original bias again (None: it need not).
        ``others``: the site's ops outside the group."""
        # Another bias can lower the keys this mask keeps to its fill's level,
        # where s + fill and the fill itself no longer agree, unless its values
        # are bounded: then it narrows the gap by at most its spread.
        spread = _spread(build, [op for op in others if isinstance(op, Bias)])
        if spread is None:
            return "the additive mask is added with another bias (it stays one dense array)"
        for i, op in enumerate(build.ops):
            if self.holds(op) and hasattr(op, "fill"):
                if not excludes(fill_after(op.fill, build.ops[i + 1 :])):
                    return ""  # a later op undoes its exclusion: the literal bias, no note
                if spread and not excludes(fill_after(op.fill, build.ops[i + 1 :]) + spread):
                    return "the additive mask is added with another bias (it stays one dense array)"
        return None

    def literal(self, build):
        return literal_bias(build, self.profile, self.sign, self.filled)


def _spread(build, biases) -> float | None:
    """How far the biases ``biases`` (ops of ``build``) may move one key's
    final score against another's: the sum of each bias's spread ``hi - lo``
    (its values' interval, proven by `bounds.interval`), times the factors of
    the `Scale` ops after it.  0 for none; None when a bias has no proven
    bound, or an op after it does more than scale scores (a soft-cap).

    Beside an additive mask with fill ``f``, an excluded key's final score is
    ``s_j + b_j + f`` (in any association: ``(s + b) + m``, ``(s + m) + b``)
    and a kept key's ``s_k + b_k``, so the excluded one's lead over the row's
    best kept key is at most ``f + spread`` (the ``s`` differences taken as
    for a mask alone): when that still `excludes`, its weight is exactly
    zero in the original, as where the descriptors drop it.  A row the mask
    empties is run with every bias (`EmptyRows`), as the original computes it.
    Torch's BLOOM: ``alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(d))`` then the
    ``finfo.min`` mask added, ALiBi bounded from the int attention mask."""
    from flashpass.ops import Scale
    from flashpass.ops.base import ScoreOp

    from .bounds import interval

    total = 0.0
    for bias in biases:
        source = build.extras[bias.index]
        if source.transform not in (None, Transform.NEG):
            return None
        bound = interval(build.scope, source.atom)
        if bound is None:
            return None
        width = bound[1] - bound[0]
        at = next(i for i, op in enumerate(build.ops) if op is bias)
        for op in build.ops[at + 1 :]:
            if isinstance(op, Scale):
                width *= abs(float(op.value))
            elif type(op).final_score is not ScoreOp.final_score:
                return None
        total += width
    return total


def settle(build) -> None:
    """Turn each additive group that cannot stay descriptors back into its
    dense bias (`AdditiveGroup.why_dense`), noting why for the report."""
    for group in build.additive:
        others = [op for op in build.ops if not group.holds(op)]
        why = group.why_dense(build, others)
        if why is None:
            continue
        at = [i for i, op in enumerate(build.ops) if group.holds(op)]
        build.ops[at[0]] = group.literal(build)
        for i in at[1:]:
            build.ops[i] = None
        build.ops = [op for op in build.ops if op is not None]
        build._causal = [(op, s) for op, s in build._causal if any(op is o for o in build.ops)]
        if why:
            build.dense_notes.append(why + group.at)
    build.additive = []


def as_mask(scope, prof, sign: int):
    """``(factors, keep_when, fill)`` when the bias ``sign * prof`` equals
    ``where(all(factors) == keep_when, 0, fill)`` with an excluding ``fill``."""
    if sign < 0:
        return None
    found = two_valued(scope, prof)
    if found is None or not jnp.issubdtype(scope.dtype(prof.base), jnp.floating):
        return None
    low, high = float(found.when_false), float(found.when_true)
    if high == 0.0 and excludes(low):
        return list(found.factors), True, low
    if low == 0.0 and excludes(high) and len(found.factors) == 1:
        return list(found.factors), False, high  # keep where the one factor is False
    return None


def add_additive(build, prof, sign: int, at: str = "") -> str | None:
    """Add the descriptors of an additive mask to ``build``; None when done,
    else why the bias stays dense ("" when it is no mask at all).  ``at``:
    where the bias is added, in the report's words."""
    found = as_mask(build.scope, prof, sign)
    if found is None:
        from .absorbed import add_absorbed  # it reads the mask through as_mask

        return add_absorbed(build, prof, sign, at)  # a mask plus a term it absorbs?
    factors, keep_when, fill = found
    return _add_factors(build, factors, keep_when, fill, prof, sign, None, at)


def add_filled(build, pred, keep_when: bool, fill: float, dtype, at: str = "") -> None:
    """``where(pred == keep_when, s, s + fill)`` with an excluding ``fill``
    (Keras' ``Attention`` layer: masked scores shifted down, not replaced):
    the additive mask ``s + where(pred == keep_when, 0, fill)``, exactly,
    value and gradient, in every row.  Its descriptors when they are exact,
    else that bias, built from ``pred`` (as broadcast as ``pred`` is)."""
    filled = Filled(bool(keep_when), float(fill), str(np.dtype(dtype)))
    why = _add_factors(build, [pred], keep_when, fill, pred, +1, filled, at)
    if why is not None:
        build.ops.append(literal_bias(build, pred, +1, filled))
        if why:
            build.dense_notes.append(why + at)


def _add_factors(build, factors, keep_when, fill, prof, sign, filled, at, term=None) -> str | None:
    """The descriptors of the additive mask ``where(all(factors) ==
    keep_when, 0, fill)`` (an `EmptyRows` op after them when rows may be
    empty), then, where ``term`` is given, the ops ``term(build)`` adds for a
    term the fill absorbs (`absorbed`), all one group; None when done, else
    why the bias stays dense."""
    from .masks import add_mask  # masks imports this module's caller

    before = (len(build.ops), len(build.extras), len(build._causal), len(build.dense_notes))
    for factor in factors:
        add_mask(build, factor, keep_when, fill, at)
    new_ops = build.ops[before[0] :]
    why = _rows_keep_a_key(build, new_ops)
    if why is not None:
        dense = _dense_factor(build, new_ops, fill)
        if dense is not None:
            del build.ops[before[0] :], build.extras[before[1] :], build._causal[before[2] :]
            del build.dense_notes[before[3] :]  # the bias's own note replaces the factor's
            return dense
        # Rows may be empty: the original's s + fill there is run as such.
        dtype = filled.dtype if filled is not None else build.scope.dtype(prof.base)
        build.ops.append(EmptyRows(len(new_ops), fill, dtype))
    if term is not None:
        mark, start = len(build.ops) - 1, len(build.ops)
        term(build)
        if why is not None:  # an empty row's call leaves the absorbed term out
            build.ops[mark] = dataclasses.replace(build.ops[mark], absorbed=len(build.ops) - start)
    # A -inf mask is a group only with an EmptyRows op: `settle` restores
    # the literal bias if a later op (a soft-cap) undoes the exclusion.
    if fill != float("-inf") or why is not None:
        group = AdditiveGroup(prof, sign, tuple(build.ops[before[0] :]), at, filled)
        build.additive.append(group)
    for n, (op, _) in enumerate(build._causal[before[2] :]):
        source = AdditiveSource(prof, sign, first=n == 0, filled=filled)
        build._causal[before[2] + n] = (op, source)
    return None


def _dense_factor(build, ops, fill: float) -> str | None:
    """Why the additive mask of ``ops`` stays one dense bias when rows may be
    empty: a factor is itself a ``T x S`` array (nothing to save, unless the
    fill is ``-inf``: a boolean mask is then a quarter of the bias), or
    another additive mask of the site already has an `EmptyRows` op.  None
    otherwise."""
    for op in ops:
        if fill == float("-inf"):
            break
        if isinstance(op, Mask) and op.shape[2] != 1 and op.shape[3] != 1:
            return "a factor of the additive mask is no structured mask (it stays a dense array)"
    if any(isinstance(op, EmptyRows) for op in build.ops):
        return "a second additive mask of the site may leave a query row with no key"
    return None


def _rows_keep_a_key(build, ops) -> str | None:
    """None if every query row keeps a key under all of ``ops`` together, else
    the factor that may empty a row, in words."""
    t_len, s_len = build.layout.sizes["T"], build.layout.sizes["S"]
    for op in ops:
        if isinstance(op, Mask):
            return "a key mask of the additive mask may leave a query row with no key"
        if isinstance(op, Segments) and not (op.same and t_len == s_len):
            return "the segment ids of the additive mask may leave a query row with no key"
        if not isinstance(op, Positional | Segments):
            return f"the additive mask's {type(op).__name__} factor may leave a row with no key"
    qi = np.arange(t_len)
    for shift in sorted({0, s_len - t_len}):
        kj = qi + shift
        if kj.min() < 0 or kj.max() >= s_len:
            continue
        keep = np.ones(t_len, bool)
        for op in ops:
            if isinstance(op, Positional):
                keep &= np.asarray(op.keep(qi, kj, None), bool)
        if keep.all():
            return None
    return "the additive mask's factors may leave a query row with no key"
