"""A mask computed elementwise from diagonal patterns and key-side data.

keras-hub merges its padding and causal masks as ``minimum(int(padding)[:,
None, :], int(causal))`` and casts the result to bool (Mistral's decoders
also take the ``minimum`` with a sliding-window mask).  The padding input is
int32, and nothing says it holds only 0 and 1: ``minimum(-1, 0)`` is -1,
which is True, so the mask is not ``padding & causal`` (`indicators` proves an
AND only on two-valued operands).  Each positional pattern here depends on
the diagonal ``d = j - i`` alone, so the diagonals fall into bands on which
every pattern is constant, and on each band the mask is, exactly,

    F(pattern values on the band, padding[j])

where ``F`` is the program's arithmetic (Shannon's expansion on the
patterns).  No band's mask varies along the queries, so each is computed
with the query axis at size 1 (`flashpass.replay.Replayed`): one O(B·S) key
mask per band and a `BandSelect`, no ``T x S`` operand, whatever values the
padding holds.

The reading applies when the mask's equations are elementwise or move axes
(`flashpass.replay.ELEMENTWISE`, ``STRUCTURAL``), every constant among their
leaves that varies along the queries depends on ``j - i`` only (at most
`MAX_BANDS` bands in all), and exactly one traced leaf feeds them, varying
along neither the queries nor (it is read whole) a sharded axis.
`masks.add_mask` tries it last, after every reading that gives kernels
plainer descriptors.
"""

from __future__ import annotations

import jax
import numpy as np

from flashpass.graph import Const
from flashpass.replay import ELEMENTWISE, STRUCTURAL, Replayed, Step, constant_value, unit_only
from flashpass.spec import BandSelect, excludes

from .common import Profile

#: The most equations a mask's arithmetic may hold to be read this way.
MAX_NODES = 64

#: The most bands of diagonals (one key mask each) a mask may split into.
MAX_BANDS = 4


def band_select(build, factor: Profile, keep_when: bool, fill: float, operand=None) -> bool:
    """Add a `BandSelect` equal to the mask ``factor`` (keeping where it is
    ``keep_when``) and return True, or return False and add nothing.
    ``operand``: the array the mask would otherwise be read from (a
    comparison's operand before its broadcast); tried only when that one
    varies along the queries and the keys."""
    scope, roles = build.scope, build.roles
    if not excludes(fill) or "T" not in roles or "S" not in roles:
        return False
    operand = factor if operand is None else operand
    if any(operand.axes[roles.index(r)] is None for r in ("T", "S")):
        return False
    t_axis, s_axis = factor.axes[roles.index("T")], factor.axes[roles.index("S")]
    if t_axis is None or s_axis is None:
        return False
    graph = _Graph(scope)
    root = scope.resolve(factor.base)
    if not graph.walk(root, t_axis, s_axis) or not graph.patterns or graph.leaf is None:
        return False
    bands = _bands(graph.patterns, scope.shape(root)[t_axis], scope.shape(root)[s_axis])
    if bands is None:
        return False
    x, indices, shape4 = graph.leaf, [], None
    for values in bands.values:
        transform = Replayed(graph.steps(values, negate=not keep_when))
        out = jax.eval_shape(
            transform.apply, jax.ShapeDtypeStruct(scope.shape(x), scope.dtype(x))
        ).shape
        axes = tuple(None if a is None or out[a] == 1 else a for a in factor.axes)
        index, shape4 = build.add_extra(Profile(x, axes, factor.target), transform, np.bool_)
        indices.append(index)
    build.ops.append(BandSelect(tuple(indices), bands.offsets, shape4, fill))
    return True


class _Bands:
    """Each band's pattern values (``{pattern key: value}``) and the
    offsets cutting the diagonals ``j - i`` into the bands."""

    def __init__(self, values: list, offsets: tuple):
        self.values, self.offsets = values, offsets


def _bands(patterns: dict, t: int, s: int):
    """The bands on which every pattern (``key -> [T, S] matrix``) is constant,
    each pattern a function of ``j - i`` alone; None otherwise."""
    diagonals = np.arange(-(t - 1), s)
    labels = []
    for mat in patterns.values():
        first = np.array([mat[max(0, -d), max(0, -d) + d] for d in diagonals])
        i, j = np.arange(t)[:, None], np.arange(s)[None, :]
        if not np.array_equal(mat, first[(j - i) + (t - 1)]):
            return None  # not a function of the diagonal
        labels.append(first)
    joint = list(zip(*labels, strict=True))
    values, offsets = [joint[0]], []
    for d, label in zip(diagonals[1:], joint[1:], strict=True):
        if label != values[-1]:
            offsets.append(int(d) - 1)
            values.append(label)
    if len(values) > MAX_BANDS or len(values) < 2:
        return None
    keys = list(patterns)
    return _Bands([dict(zip(keys, v, strict=True)) for v in values], tuple(offsets))


class _Graph:
    """The mask's equations, walked back from the mask: each value's query
    and key axes, its interior equations in order, the one traced leaf and
    the positional patterns (``key -> [T, S]`` matrix)."""

    def __init__(self, scope):
        self.scope = scope
        self.axes: dict = {}  # atom -> (query axis, key axis) in its own shape
        self.order: list = []  # (atom, node) of interior equations, operands first
        self.constants: dict = {}  # atom -> folded value (no query variation)
        self.patterns: dict = {}  # constants varying along the queries: key -> [T, S]
        self.leaf = None

    def walk(self, atom, t, s) -> bool:
        scope, key = self.scope, _key(atom)
        if key in self.axes:
            return self.axes[key] == (t, s)
        if len(self.order) > MAX_NODES:
            return False
        self.axes[key] = (t, s)
        shape = scope.shape(atom)
        varies = t is not None and shape[t] != 1
        node = None if isinstance(atom, Const) else scope.producer(atom)
        if isinstance(atom, Const) or _constant(scope, atom):
            value = np.asarray(atom.value) if isinstance(atom, Const) else scope.fold(atom)
            if varies and (value is None or not _uniform_along(value, t)):
                return self._pattern(atom, value, t, s)
            if value is not None:
                self.constants[key] = value  # (the same along the queries)
                return True
        elif varies and (node is None or node.prim not in (*ELEMENTWISE, *STRUCTURAL)):
            return False  # traced data along the queries: not key-side
        if node is None or node.prim not in (*ELEMENTWISE, *STRUCTURAL) or len(node.outs) != 1:
            if varies or isinstance(atom, Const) or self.leaf not in (None, atom):
                return False  # one traced array only (an extra reads one atom)
            self.leaf = atom
            return True
        for operand, axes in zip(node.ins, _operand_axes(scope, node, t, s), strict=True):
            if axes is False:
                return False
            if not self.walk(scope.resolve(operand), *axes):
                return False
        self.order.append((atom, node))
        return True

    def _pattern(self, atom, value, t, s) -> bool:
        """A constant varying along the queries: a positional pattern, the
        same at every index of its other axes."""
        if s is None or value is None:
            return False  # (too big to fold)
        arr = np.moveaxis(np.asarray(value), (t, s), (-2, -1))
        arr = arr.reshape(-1, *arr.shape[-2:])
        if not np.all(arr == arr[:1]):
            return False
        self.patterns[_key(atom)] = arr[0]
        return True

    def steps(self, pattern_values: dict, negate: bool) -> tuple:
        """The replay of the mask's equations with each pattern at its value
        on one band (``pattern_values``: key -> value)."""
        scope, index, out = self.scope, {}, []
        for atom, node in self.order:
            refs = []
            for operand in node.ins:
                refs.append(self._ref(operand, pattern_values, index))
            out.append(
                Step(
                    node.prim,
                    tuple(refs),
                    scope.dtype(atom),
                    dict(node.params),
                    tuple(scope.shape(node.ins[0])),
                    tuple(scope.shape(atom)),
                )
            )
            index[_key(atom)] = len(out) - 1
        if negate:
            out.append(Step("not", (("step", len(out) - 1),), np.bool_))
        return tuple(out)

    def _ref(self, operand, pattern_values, index):
        scope = self.scope
        atom = scope.resolve(operand)
        key = _key(atom)
        if key in index:
            return ("step", index[key])
        dtype = scope.dtype(atom)
        if key in pattern_values:
            value = pattern_values[key]
            return ("value", np.full((1,) * len(scope.shape(atom)), value, dtype=dtype))
        if isinstance(atom, Const) or key in self.constants:
            value = atom.value if isinstance(atom, Const) else self.constants[key]
            t = self.axes.get(key, (None, None))[0]
            return ("value", constant_value(value, dtype, t))
        return ("x",)


def _key(atom):
    """A hashable key for an atom (a `Const` by identity)."""
    return ("const", id(atom)) if isinstance(atom, Const) else atom


def _uniform_along(value, axis: int) -> bool:
    """Whether ``value`` is the same at every index of ``axis``."""
    value = np.asarray(value)
    return bool(np.all(value == np.take(value, [0], axis=axis)))


def _constant(scope, atom) -> bool:
    """Whether ``atom`` depends on no input of the program."""
    if scope.producer(atom) is None:
        return False
    for node in scope.backward_cone([atom]):
        for a in node.ins:
            if not isinstance(a, Const) and scope.producer(scope.resolve(a)) is None:
                return False
    return True


def _operand_axes(scope, node, t, s) -> list:
    """Each operand's (query axis, key axis), or False where the equation
    moves them in a way a replay does not follow."""
    out_shape = scope.shape(node.out)
    prim, params = node.prim, node.params
    result = []
    for operand in node.ins:
        in_shape = scope.shape(operand)
        if prim in ELEMENTWISE:
            # Equal shapes, a scalar, or size-1 axes the operation broadcasts.
            if not in_shape:
                result.append((None, None))
            elif len(in_shape) != len(out_shape) or any(
                d not in (1, o) for d, o in zip(in_shape, out_shape, strict=True)
            ):
                result.append(False)
            else:
                result.append(
                    tuple(None if a is None or in_shape[a] != out_shape[a] else a for a in (t, s))
                )
        elif prim == "transpose":
            perm = params["permutation"]
            result.append(tuple(None if a is None else perm[a] for a in (t, s)))
        elif prim == "broadcast_in_dim":
            dims = params["broadcast_dimensions"]
            axes = []
            for a in (t, s):
                i = dims.index(a) if a is not None and a in dims else None
                axes.append(i if i is not None and in_shape[i] == out_shape[a] else None)
            result.append(tuple(axes))
        else:  # reshape, squeeze, expand_dims: unit axes only
            if params.get("dimensions") is not None or not unit_only(in_shape, out_shape):
                result.append(False)
                continue
            ins = [a for a, d in enumerate(in_shape) if d != 1]
            outs = [a for a, d in enumerate(out_shape) if d != 1]
            axes = []
            for a in (t, s):
                axes.append(None if a is None or a not in outs else ins[outs.index(a)])
            result.append(tuple(axes))
    return result
