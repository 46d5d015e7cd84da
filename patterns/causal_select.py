"""A mask computed elementwise from one causal pattern and key-side data.

keras-hub merges its padding and causal masks as ``minimum(int(padding)[:,
None, :], int(causal))`` and casts the result to bool.  The padding input is
int32, and nothing says it holds only 0 and 1: ``minimum(-1, 0)`` is -1,
which is True, so the mask is not ``padding & causal`` (`indicators` proves an
AND only on two-valued operands).  It is exactly, entry by entry,

    where(j <= i + d, F(in, padding[j]), F(out, padding[j]))

where ``F`` is the program's arithmetic and ``in``/``out`` the causal
pattern's two values (Shannon's expansion on the pattern).  Neither branch
varies along the queries, so both are computed with the query axis at size 1
(`flashpass.replay.Replayed`): two O(B·S) key masks and a `CausalSelect`, no
``T x S`` operand, whatever values the padding holds.

The reading applies when the mask's equations are elementwise or move axes
(`flashpass.replay.ELEMENTWISE`, ``STRUCTURAL``), exactly one constant among
their leaves varies along the queries and is a causal pattern of two values,
and exactly one traced leaf feeds them, varying along neither the queries
nor (it is read whole) a sharded axis.  `masks.add_mask` tries it last, after
every reading that gives kernels plainer descriptors.
"""

from __future__ import annotations

import jax
import numpy as np

from flashpass.graph import Const
from flashpass.replay import ELEMENTWISE, STRUCTURAL, Replayed, Step, constant_value, unit_only
from flashpass.spec import CausalSelect, excludes

from .common import Profile

#: The most equations a mask's arithmetic may hold to be read this way.
MAX_NODES = 64


def causal_select(build, factor: Profile, keep_when: bool, fill: float, operand=None) -> bool:
    """Add a `CausalSelect` equal to the mask ``factor`` (keeping where it is
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
    if not graph.walk(root, t_axis, s_axis) or graph.causal is None or graph.leaf is None:
        return False
    below, above, offset = graph.causal
    ins = []
    for value in (below, above):
        transform = Replayed(graph.steps(value, negate=not keep_when))
        x = graph.leaf
        out = jax.eval_shape(
            transform.apply, jax.ShapeDtypeStruct(scope.shape(x), scope.dtype(x))
        ).shape
        axes = tuple(None if a is None or out[a] == 1 else a for a in factor.axes)
        ins.append(build.add_extra(Profile(x, axes, factor.target), transform, np.bool_))
    (i_below, shape4), (i_above, _) = ins
    build.ops.append(CausalSelect(i_below, i_above, shape4, offset, fill))
    return True


class _Graph:
    """The mask's equations, walked back from the mask: each value's query
    and key axes, its interior equations in order, the one traced leaf and
    the causal constant ``(in value, out value, offset)``."""

    def __init__(self, scope):
        self.scope = scope
        self.axes: dict = {}  # atom -> (query axis, key axis) in its own shape
        self.order: list = []  # (atom, node) of interior equations, operands first
        self.constants: dict = {}  # atom -> folded value (no query variation)
        self.pattern = None  # the causal constant's atom
        self.causal = None
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
        """The one constant varying along the queries: a causal pattern."""
        if self.pattern is not None:
            return self.pattern == _key(atom)
        if s is None or value is None:
            return False  # (too big to fold)
        arr = np.moveaxis(np.asarray(value), (t, s), (-2, -1))
        arr = arr.reshape(-1, *arr.shape[-2:])
        if not np.all(arr == arr[:1]):
            return False
        mat = arr[0]
        values = np.unique(mat)
        if len(values) != 2:
            return False
        from .masks import causal_offset

        for inside, outside in (values, values[::-1]):
            offset = causal_offset(mat == inside)
            if offset is not None:
                self.pattern, self.causal = _key(atom), (inside, outside, offset)
                return True
        return False

    def steps(self, pattern_value, negate: bool) -> tuple:
        """The replay of the mask's equations with the pattern at ``pattern_value``."""
        scope, index, out = self.scope, {}, []
        for atom, node in self.order:
            refs = []
            for operand in node.ins:
                refs.append(self._ref(operand, pattern_value, index))
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

    def _ref(self, operand, pattern_value, index):
        scope = self.scope
        atom = scope.resolve(operand)
        key = _key(atom)
        if key in index:
            return ("step", index[key])
        dtype = scope.dtype(atom)
        if key == self.pattern:
            return ("value", np.full((1,) * len(scope.shape(atom)), pattern_value, dtype=dtype))
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
