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

import dataclasses

import jax.numpy as jnp
import numpy as np

from flashpass.site import Compared, Transform
from flashpass.spec import EXCLUDING_FILL, Bias, Causal, Mask, excludes

from .additive import add_additive, add_filled
from .chain import Step, rule
from .common import (
    Miss,
    Profile,
    affine,
    broadcast_affine,
    profile,
    scalar_value,
    uniform_value,
    where,
)
from .indicators import COMPARISONS, SWAPPED, boolean_factors, compose, two_valued


@dataclasses.dataclass
class MaskStep(Step):
    """``where(pred, s, fill)`` with a scalar ``fill``; ``keep_when`` is the
    value of ``pred`` that keeps the scores."""

    profile: Profile
    keep_when: bool
    fill: float

    def apply(self, build) -> None:
        add_mask(build, self.profile, self.keep_when, self.fill, where(self.node))


@dataclasses.dataclass
class ShiftedMaskStep(Step):
    """``where(pred, s, s + fill)``: the masked scores are the scores shifted
    by an excluding scalar ``fill`` (``shift`` computes ``s + fill``), which
    is the additive mask ``s + where(pred, 0, fill)`` (`additive.add_filled`)."""

    profile: Profile
    keep_when: bool
    fill: float
    shift: object

    @property
    def side(self) -> list:
        return [self.node.ins[0]]  # the predicate; the shifted branch is the scores'

    @property
    def interior(self) -> tuple:
        return (self.shift,)

    def apply(self, build) -> None:
        dtype = build.scope.dtype(self.chain_in)
        add_filled(build, self.profile, self.keep_when, self.fill, dtype, where(self.node))


@dataclasses.dataclass
class BiasStep(Step):
    """``s + bias`` (``sign`` +1) or ``s - bias`` (-1)."""

    profile: Profile
    sign: int

    def apply(self, build) -> Miss | None:
        scope = build.scope
        base = scope.fold(self.profile.base)
        if base is not None and not np.any(np.asarray(base)):
            # A bias that is zero by value (torchax's SDPA adds ``zeros(L, S)``
            # when there is no mask) changes neither the scores nor a gradient.
            return None
        why = add_additive(build, self.profile, self.sign, where(self.node))
        if why is None:
            return None
        found = additive_mask(scope, self.profile, self.sign, build.roles)
        if found is not None:
            add_mask(build, *found, at=where(self.node))
            return None
        prof, sign = self.profile, self.sign
        if any(recognise(build, prof, sign) for recognise in BIAS_RECOGNISERS):
            return None
        causal = classify(scope, prof, build.roles, additive=True, sign=sign)
        if isinstance(causal, Causal):
            build.add_causal(causal, CausalSource("bias", prof, sign=sign))
            return None
        dtype = scope.dtype(prof.base)
        if not jnp.issubdtype(dtype, jnp.floating):
            return Miss(f"scores biased by a {dtype} tensor{where(self.node)}", self.node)
        index, shape4 = build.add_extra(prof, Transform.NEG if sign < 0 else None, dtype)
        build.ops.append(Bias(index, shape4, dtype))
        if why:
            build.dense_notes.append(why + where(self.node))
        return None


@dataclasses.dataclass(frozen=True)
class CausalSource:
    """Where a `Causal` op came from, to express it as the literal mask or bias
    it was written as when a later op undoes its exclusion (see builder.py)."""

    kind: str  # "mask" or "bias"
    profile: Profile
    keep_when: bool = True
    fill: float | None = None
    sign: int = 1
    roles: tuple = ()

    def literal(self, build):
        """The `Mask` or `Bias` op (and its extra) equal to the causal op."""
        scope, prof = build.scope, self.profile
        if self.kind == "bias":
            dtype = scope.dtype(prof.base)
            index, shape4 = build.add_extra(prof, Transform.NEG if self.sign < 0 else None, dtype)
            return Bias(index, shape4, dtype)
        index, shape4 = build.add_extra(prof, None if self.keep_when else Transform.NOT, np.bool_)
        return Mask(index, shape4, self.fill)


#: Structured-mask recognisers, tried in order on each mask factor that is not
#: a constant causal mask: ``recognise(build, factor, keep_when, fill)``
#: returns True after adding its descriptor op(s) to ``build`` (a window, kv
#: lengths, segment ids...), or False to leave the factor to the next one and,
#: last, to a dense `Mask`.  A recogniser must prove its descriptor equals the
#: factor for every index (by value or symbolically), never assume it.  They
#: are tried by the rank each declares (`mask_recogniser`), whatever order the
#: modules load in.
MASK_RECOGNISERS: list = []

#: Position-bias recognisers (ALiBi...), tried on an additive bias that is not
#: an additive mask: ``recognise(build, bias, sign)`` returns True after adding
#: its op(s) to ``build``, or False; it must prove its op equals the bias.
#: Tried by their declared ranks (`bias_recogniser`).
BIAS_RECOGNISERS: list = []


def _register(registry: list, rank: int, fn) -> None:
    """Put ``fn`` in ``registry`` at its declared ``rank`` (a module loaded
    again replaces its recogniser); a rank another recogniser holds is an
    error: where readings overlap the order decides the op, so it is never a
    tie."""
    name = recogniser_name(fn)
    kept = [f for f in registry if recogniser_name(f) != name]
    taken = [recogniser_name(f) for f in kept if f.rank == rank]
    if not isinstance(rank, int) or taken:
        raise ValueError(f"recogniser {name}: rank {rank!r} is not an int of its own ({taken})")
    fn.rank = rank
    registry[:] = sorted([*kept, fn], key=lambda f: f.rank)


def recogniser_name(fn) -> str:
    """``module.function`` of a recogniser, as the declared orders name it."""
    return f"{fn.__module__.rpartition('.')[2]}.{fn.__name__}"


def bias_recogniser(rank: int):
    """Register a position-bias recogniser (see `BIAS_RECOGNISERS`), tried
    after those of lower ``rank``."""
    return lambda fn: _register(BIAS_RECOGNISERS, rank, fn) or fn


def mask_recogniser(rank: int):
    """Register a structured-mask recogniser (see `MASK_RECOGNISERS`), tried
    after those of lower ``rank``.  It matters where readings overlap: the
    first recogniser that proves a factor decides the op the site gets, and so
    which kernels can run it and what the report (and a golden) says.  The
    ranks: kv lengths 10, prefix lengths 20, position masks 30, the diagonal
    40, prefix-LM 50, chunks and segments 60, sink windows 70 (a constant
    sink-window mask whose window spans every query is also a prefix-LM mask:
    it is a `Prefix`, ranked first), block-causal 80, and last, at 90, any
    combination of a per-query and a per-key array (`OuterMask`)."""
    return lambda fn: _register(MASK_RECOGNISERS, rank, fn) or fn


#: The report's note for a boolean factor passed to the kernel as a ``T x S``
#: array (`add_mask`).
DENSE_FACTOR = "a mask factor no descriptor reads is passed as a dense T x S array"


def add_mask(build, pred: Profile, keep_when: bool, fill: float, at: str = "") -> None:
    """One score op per factor of ``pred``: `Causal` when the factor is a
    constant causal mask, nothing when it keeps everything, a descriptor when a
    registered recogniser proves one, else a `Mask` of the factor's array (as
    broadcast as it is); one that varies over both queries and keys is noted
    for the report (`SiteBuilder.dense_notes`, ``at``: where it is applied).
    A mask that keeps where ``pred`` is False and ``pred`` is ``~(a & b)``
    (``s.masked_fill(~mask, -inf)``) keeps where ``a`` and ``b`` are True."""
    if not keep_when:
        found = two_valued(build.scope, pred)
        if found is not None and len(found.factors) > 1 and not found.when_true:
            if found.when_false:  # pred == ~(a & b & ...)
                for part in found.factors:
                    add_mask(build, part, True, fill, at)
                return
    for factor in and_factors(build.scope, pred):
        if _read_outside(build, factor, keep_when, fill, at):
            continue
        causal = classify(build.scope, factor, build.roles, keep_when=keep_when, fill=fill)
        if causal == "all":
            continue  # keeps every score: no-op
        if isinstance(causal, Causal):
            source = CausalSource("mask", factor, keep_when, fill, roles=tuple(build.roles))
            build.add_causal(causal, source)
            continue
        if any(recognise(build, factor, keep_when, fill) for recognise in MASK_RECOGNISERS):
            continue
        parts = boolean_factors(build.scope, factor) if keep_when else None
        if parts is not None:  # int masks combined arithmetically: one op per operand
            for part in parts:
                add_mask(build, part, keep_when, fill, at)
            continue
        narrowed = compared_broadcast(build.scope, factor)
        if _band_select(build, factor, keep_when, fill, narrowed):
            continue  # (last: plainer descriptors first)
        if narrowed is not None:
            factor, compared = narrowed
            transform = dataclasses.replace(compared, negate=not keep_when)
        else:
            transform = None if keep_when else Transform.NOT
        index, shape4 = build.add_extra(factor, transform, np.bool_)
        build.ops.append(Mask(index, shape4, fill))
        if shape4[2] != 1 and shape4[3] != 1 and DENSE_FACTOR + at not in build.dense_notes:
            build.dense_notes.append(DENSE_FACTOR + at)


def _read_outside(build, factor, keep_when, fill, at) -> bool:
    from .outside import read_outside  # (it reads the factor with `add_mask`)

    return read_outside(build, factor, keep_when, fill, at)


def _band_select(build, factor, keep_when, fill, narrowed) -> bool:
    from .band_select import band_select  # (it reads `causal_offset` from here)

    return band_select(build, factor, keep_when, fill, narrowed[0] if narrowed else factor)


def compared_broadcast(scope, factor: Profile):
    """``(profile, Compared)`` when the mask ``factor`` is ``x <cmp> c`` (a
    scalar constant ``c``) and ``x`` is broadcast along more score axes than
    the comparison's result: the mask is then read from ``x`` (Hugging Face's
    ``ne(broadcast(attention_mask), 0)``).  None otherwise."""
    node = scope.producer(factor.base)
    if node is None or node.prim not in COMPARISONS or len(node.ins) != 2:
        return None
    for side, prim in ((0, node.prim), (1, SWAPPED[node.prim])):
        value = scalar_value(scope, node.ins[1 - side])
        x = node.ins[side]
        if value is None or scope.shape(x) != scope.shape(factor.base):
            continue
        inner = compose(scope, factor, x)
        if sum(a is not None for a in inner.axes) < sum(a is not None for a in factor.axes):
            return inner, Compared(prim, value)
    return None


def additive_mask(scope, prof: Profile, sign: int, roles):
    """A bias that is a *constant* additive mask ``select(pred, 0, -huge)``
    (Hugging Face's causal attention bias), as (pred Profile, keep_when, fill).

    Constant masks whose factors are causal: every row then keeps a key, so
    ``s + fill`` and ``where(pred, s, fill)`` agree in value *and* gradient.
    Any mask with a fill of exactly ``-inf``: a fully masked row is NaN in the
    original.  Another data-dependent (padding) bias stays a `Bias`: for a
    fully padded row the original's gradient flows through ``s + fill``, which
    a mask would not do.
    """
    if sign < 0:
        return None
    found = additive_select(scope, prof)
    if found is None:
        return None
    pred, keep_when, fill = found
    if fill == float("-inf"):
        # Exactly -inf (PyTorch's boolean ``attn_mask`` made additive): both
        # spellings give excluded keys weight 0 and zero gradient; a row with
        # every key excluded is NaN in the original, value and gradient.
        return found
    for factor in and_factors(scope, pred):
        kind = classify(scope, factor, roles, keep_when=keep_when, fill=fill)
        if kind != "all" and not isinstance(kind, Causal):
            return None
    return found


def classify(scope, prof, roles, *, keep_when=True, fill=None, additive=False, sign=1):
    """Classify a constant mask/bias: a `Causal` op, "all" (keeps everything) or None."""
    if not additive and fill is not None and excludes(fill):
        offset = symbolic_causal_offset(scope, prof, roles, keep_when)
        if offset is not None:
            return Causal(offset, fill)
    base = scope.fold(prof.base)
    if base is None:
        return None
    role_axes = {roles[t]: prof.axes[t] for t in range(len(roles))}
    if role_axes.get("T") is None or role_axes.get("S") is None:
        if additive or not np.all(np.asarray(base) == keep_when):
            return None
        return "all"
    t_axis, s_axis = role_axes["T"], role_axes["S"]
    arr = np.asarray(base)
    others = [a for a in range(arr.ndim) if a not in (t_axis, s_axis)]
    arr = np.transpose(arr, [*others, t_axis, s_axis])
    arr = arr.reshape(-1, arr.shape[-2], arr.shape[-1])
    if not np.all(arr == arr[:1]):
        return None
    mat = arr[0]
    if additive:
        mat = mat * sign
        keep = mat == 0
        masked = mat[~keep]
        if masked.size == 0 or not np.all(masked <= EXCLUDING_FILL):
            return None
        fill_value = float(masked.max())
    else:
        keep = mat == keep_when
        if keep.all():
            return "all"
        fill_value = fill
        if fill_value is None or not excludes(fill_value):
            return None
    offset = causal_offset(keep)
    if offset is None:
        return None
    return Causal(offset, fill_value)


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
        shifted = _shifted_scores(scope, chain, fill_atom)
        if shifted is not None:
            keep = profile(scope, pred, shape)
            readings.append(ShiftedMaskStep(node, chain, keep, bool(chain_pos), *shifted))
            continue
        if not fill_prof.is_scalar:
            # A broadcast fill hoisted out of a loop body (autodiff of a scan does it).
            fill = uniform_value(scope, fill_atom)
            if fill is None:
                continue
        else:
            fill = scalar_value(scope, fill_prof.base)
        if fill is None:
            return Miss(f"masked scores are filled with a traced value{where(node)}", node)
        # select_n picks cases[pred]: the scores survive where pred == chain_pos.
        readings.append(MaskStep(node, chain, profile(scope, pred, shape), bool(chain_pos), fill))
    if not readings:
        return Miss(f"masked scores are filled with a non-scalar value{where(node)}", node)
    return readings


def _shifted_scores(scope, chain, fill_atom):
    """``(fill, node)`` when ``fill_atom`` is ``chain + fill`` or ``chain -
    (-fill)`` (``node`` computes it) with an excluding scalar constant
    ``fill``; None otherwise."""
    node = scope.producer(fill_atom)
    if node is None or node.prim not in ("add", "sub") or len(node.ins) != 2:
        return None
    a, b = node.ins
    scores = scope.resolve(chain)  # the same array across a call boundary
    for x, c, ok in ((a, b, True), (b, a, node.prim == "add")):
        if not ok or scope.resolve(x) != scores:
            continue
        c_prof = profile(scope, c, scope.shape(node.out))
        value = scalar_value(scope, c_prof.base) if c_prof.is_scalar else None
        if value is None:
            continue
        fill = value if node.prim == "add" else -value
        if excludes(fill):
            return fill, node
    return None


def and_factors(scope, prof):
    """Split a boolean ``a & b & ...`` profile into factor profiles.

    ``float(a & b) > 0`` and ``x != 0`` of a converted boolean (Flax's
    ``combine_masks`` + Hugging Face's ``mask > 0``) are looked through.
    """
    node = scope.producer(prof.base)
    if node is None or scope.dtype(node.out) != np.bool_:
        return [prof]
    if node.prim == "and":
        return [
            f for operand in node.ins for f in and_factors(scope, compose(scope, prof, operand))
        ]
    if node.prim in ("gt", "ne"):
        x, zero = node.ins
        inner = scope.producer(x)
        zero_prof = profile(scope, zero, scope.shape(node.out))
        if (
            zero_prof.is_scalar
            and scalar_value(scope, zero_prof.base) == 0.0
            and inner is not None
            and inner.prim == "convert_element_type"
            and scope.dtype(inner.ins[0]) == np.bool_
        ):
            converted = compose(scope, prof, x)
            return and_factors(scope, compose(scope, converted, inner.ins[0]))
    pred = _compared_select(scope, node)
    if pred is not None:
        return and_factors(scope, compose(scope, compose(scope, prof, node.ins[0]), pred))
    return [prof]


_CMP_VALUE = COMPARISONS


def _compared_select(scope, node):
    """``pred`` when ``node`` is ``cmp(select(pred, a, b), c)`` with scalar
    constants ``a``, ``b``, ``c``, ``cmp(a, c)`` false and ``cmp(b, c)`` true:
    the comparison then equals ``pred`` elementwise.  MaxText spells its masks
    this way: an additive ``where(keep, 0, -0.7 * max)`` read back as
    ``mask >= -0.7 * max * 0.5``."""
    if node.prim not in _CMP_VALUE:
        return None
    x, c = node.ins
    sel = scope.producer(x)
    if sel is None or sel.prim != "select_n" or len(sel.ins) != 3:
        return None
    pred = sel.ins[0]
    if scope.dtype(pred) != np.bool_:
        return None
    shape = scope.shape(node.out)
    c_prof = profile(scope, c, shape)
    c_value = scalar_value(scope, c_prof.base) if c_prof.is_scalar else None
    if c_value is None:
        return None
    cases = []
    for case in sel.ins[1:]:
        cp = profile(scope, case, scope.shape(x))
        value = scalar_value(scope, cp.base) if cp.is_scalar else None
        if value is None:
            return None
        # Compared in the select's dtype, as the program does.
        dtype = scope.dtype(x)
        cases.append(
            bool(_CMP_VALUE[node.prim](np.asarray(value, dtype), np.asarray(c_value, dtype)))
        )
    return pred if cases == [False, True] else None


#: An additive mask ``select(keep, 0, fill)`` with a fill this large swallows any
#: score (``s + fill == fill`` in float32 for ``|s| < 1e30``), so it is exactly
#: ``where(keep, s, fill)``.
SWALLOWING_FILL = -1e37


def additive_select(scope, prof):
    """``(keep Profile, keep_when, fill)`` if a bias is ``select(pred, 0, fill)``."""
    node = scope.producer(prof.base)
    if node is None or node.prim != "select_n" or len(node.ins) != 3:
        return None
    pred, case0, case1 = node.ins
    if scope.dtype(pred) != np.bool_:
        return None
    shape = scope.shape(node.out)
    values = []
    for case in (case0, case1):
        cp = profile(scope, case, shape)
        values.append(scalar_value(scope, cp.base) if cp.is_scalar else None)
    if values[0] == 0.0 and values[1] is not None and values[1] <= SWALLOWING_FILL:
        return compose(scope, prof, pred), False, values[1]
    if values[1] == 0.0 and values[0] is not None and values[0] <= SWALLOWING_FILL:
        return compose(scope, prof, pred), True, values[0]
    return None


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


# --------------------------------------------------------------------------- symbolic masks
#
# Folding a causal mask materialises T x S values, which is refused above
# `graph.FOLD_LIMIT`.  Masks built from iotas (``jnp.tril``, ``arange``
# comparisons, ``make_causal_mask``) are affine in the indices, so they are also
# evaluated symbolically: an int value is ``sum(coef[a] * idx[a]) + const``, a
# boolean a conjunction of half-spaces ``affine >= 0``.  Exact, any size.

_CMP = {"ge": (1, 0), "gt": (1, -1), "le": (-1, 0), "lt": (-1, -1)}


def halfspaces(scope, atom, depth=0):
    """Conjunction of ``(coef, const)`` half-spaces (keep iff coef·idx + const >= 0)
    equal to the boolean ``atom``, [] for all-True, or None if not affine."""
    if depth > 32:
        return None
    atom = scope.resolve(atom)
    node = scope.producer(atom)
    shape = scope.shape(atom)
    value = scope.fold(atom) if node is None or not shape else None
    if value is not None and np.asarray(value).size == 1:
        return [] if bool(np.asarray(value).reshape(-1)[0]) else None
    if node is None:
        return None
    prim = node.prim
    if prim in _CMP:
        a, b = (affine(scope, x, depth + 1) for x in node.ins)
        if a is None or b is None:
            return None
        a, b = broadcast_affine(a, len(shape)), broadcast_affine(b, len(shape))
        sign, shift = _CMP[prim]
        coef = tuple(sign * (x - y) for x, y in zip(a[0], b[0], strict=True))
        return [(coef, sign * (a[1] - b[1]) + shift)]
    if prim == "and":
        parts = [halfspaces(scope, x, depth + 1) for x in node.ins]
        if any(p is None for p in parts):
            return None
        return [h for p in parts for h in p]
    if prim == "not":
        inner = halfspaces(scope, node.ins[0], depth + 1)
        if inner is None or len(inner) != 1:
            return None
        coef, const = inner[0]
        return [(tuple(-c for c in coef), -const - 1)]
    if prim == "broadcast_in_dim":
        inner = halfspaces(scope, node.ins[0], depth + 1)
        if inner is None:
            return None
        src_shape = scope.shape(node.ins[0])
        out = []
        for coef, const in inner:
            new = [0] * len(shape)
            for k, d in enumerate(node.params["broadcast_dimensions"]):
                new[d] = coef[k] if src_shape[k] == shape[d] else 0
            out.append((tuple(new), const))
        return out
    if prim == "select_n" and len(node.ins) == 3:
        pred, false_case, true_case = node.ins
        f = profile(scope, false_case, shape)
        t = profile(scope, true_case, shape)
        if f.is_scalar and t.is_scalar:
            fv, tv = scalar_value(scope, f.base), scalar_value(scope, t.base)
            if fv == 0.0 and tv == 1.0 and scope.dtype(atom) == np.bool_:
                return halfspaces(scope, pred, depth + 1)
    return None


def symbolic_causal_offset(scope, prof, roles, keep_when: bool) -> int | None:
    """`causal_offset` computed symbolically for a mask `Profile` (any size)."""
    halves = halfspaces(scope, prof.base)
    if halves is None or len(halves) != 1:
        return None
    coef, const = halves[0]
    if not keep_when:
        coef, const = tuple(-c for c in coef), -const - 1
    base_to_role = {a: roles[t] for t, a in enumerate(prof.axes) if a is not None}
    by_role = {}
    for axis, c in enumerate(coef):
        if c == 0:
            continue
        role = base_to_role.get(axis)
        if role not in ("T", "S"):
            return None
        by_role[role] = c
    # keep iff i - j + const >= 0, i.e. j <= i + const
    if by_role != {"T": 1, "S": -1} or const < 0:
        return None
    return const
