"""Shared vocabulary of the pattern modules: `Miss`, operand `Profile`s, and the
helpers more than one pattern module reads with (affine index arithmetic, a
mask factor's query and key axes, constant keys)."""

from __future__ import annotations

import dataclasses

import numpy as np

from flashpass import compat
from flashpass.graph import Const, Node, Scope
from flashpass.spec import excludes

ESCAPE_HINT = (
    "; to rewrite it, do not return or reuse the attention weights (autodiff's own "
    "backward of the site may read them: a training step is rewritten forward and backward)"
)


class Miss:
    """A failed match that says why.  Falsy, so ``if not m: return m`` reads naturally.

    ``relevant`` marks misses worth reporting to the user: something that looks
    like an attention softmax was found, but a later condition failed.  A bare
    ``exp`` in a GELU is an irrelevant miss and stays silent.
    """

    __slots__ = ("reason", "node", "relevant", "internal", "readers")

    def __init__(
        self,
        reason: str,
        node: Node | None = None,
        relevant: bool = True,
        internal: str | None = None,
        readers: tuple = (),
    ):
        self.reason = reason
        self.node = node
        self.relevant = relevant
        self.internal = internal  # the matcher crashed: "Type: message" (see errors.py)
        self.readers = readers  # a value read by several nodes: each (a path may go on)

    def __bool__(self) -> bool:
        return False

    @property
    def location(self) -> str | None:
        return self.node.location if self.node is not None else None

    def __repr__(self) -> str:
        return f"Miss({self.reason!r} at {self.location})"


def where(node: Node | None) -> str:
    """`` at file.py:LINE`` for messages (empty when unknown)."""
    loc = node.location if node is not None else None
    return f" at {loc}" if loc else ""


@dataclasses.dataclass(frozen=True)
class Profile:
    """How an operand broadcasts against a value of ``target`` shape.

    ``base`` is the un-broadcast atom; ``axes[t]`` is the base axis that feeds
    target axis ``t``, or None where the operand is broadcast along ``t``.
    Base axes not named in ``axes`` have size 1.
    """

    base: object
    axes: tuple
    target: tuple

    @property
    def is_scalar(self) -> bool:
        return all(a is None for a in self.axes)


def profile(scope: Scope, atom, target: tuple[int, ...]) -> Profile:
    """Peel size-1 broadcasting, ``broadcast_in_dim``, transposes and unit reshapes off ``atom``."""
    shape = scope.shape(atom)
    if not shape:  # lax binops broadcast rank-0 operands
        return Profile(scope.resolve(atom), (None,) * len(target), tuple(target))
    if len(shape) != len(target):
        raise ValueError(f"operand of shape {shape} does not broadcast to {target}")
    axes = tuple(None if (shape[t] == 1 and target[t] != 1) else t for t in range(len(target)))
    atom = scope.resolve(atom)
    while True:
        node = scope.producer(atom)
        if node is None:
            break
        if node.prim == "broadcast_in_dim":
            dims = node.params["broadcast_dimensions"]
            src = node.ins[0]
            src_shape = scope.shape(src)
            new = []
            for a in axes:
                if a is None or a not in dims:
                    new.append(None)
                else:
                    b = dims.index(a)
                    new.append(None if src_shape[b] == 1 and scope.shape(atom)[a] != 1 else b)
            axes, atom = tuple(new), scope.resolve(src)
            continue
        if node.prim in compat.VALUE_IDENTITY_PRIMITIVES:  # pvary: a type change only
            atom = scope.resolve(node.ins[node.outs.index(atom)])
            continue
        if node.prim == "transpose":
            # A permutation moves axes and nothing else: output axis i is the
            # operand's axis perm[i] (keras' 5-D GQA mask moves a unit axis
            # to the front; the mask is then read from what it transposed).
            perm = node.params["permutation"]
            axes = tuple(None if a is None else perm[a] for a in axes)
            atom = scope.resolve(node.ins[0])
            continue
        if node.prim == "reshape" and node.params.get("dimensions") is None:
            found = _unit_reshape_source(scope, node, scope.shape(atom))
            if found is None:
                break
            mapped, src = found
            axes = tuple(None if a is None else mapped[a] for a in axes)
            atom = scope.resolve(src)
            continue
        break
    # Axes that survive must really carry the target extent (or be size-1 broadcasts).
    base_shape = scope.shape(atom)
    axes = tuple(
        None if (a is not None and base_shape[a] == 1 and target[t] != 1) else a
        for t, a in enumerate(axes)
    )
    return Profile(atom, axes, tuple(target))


def _unit_reshape_source(scope: Scope, node, dst: tuple):
    """``(mapping, source)`` for the reshape ``node`` (to ``dst``) or a chain of
    reshapes ending in it, where the chain from ``source`` only adds or removes
    size-1 axes (`unit_reshape_map`), nearest source first.  A chain of
    row-major reshapes is one reshape from its first input, so a merge undone
    (torch's ``[B, H, 1, S]`` viewed as ``[B·H, 1, S]`` and back) is read
    through; else None."""
    while True:
        src = scope.resolve(node.ins[0])
        mapped = unit_reshape_map(scope.shape(src), dst)
        if mapped is not None:
            return mapped, src
        node = scope.producer(src)
        if node is None or node.prim != "reshape" or node.params.get("dimensions") is not None:
            return None


def unit_reshape_map(src: tuple, dst: tuple) -> dict | None:
    """For a reshape that only adds/removes size-1 axes: dst axis -> src axis."""
    if [d for d in src if d != 1] != [d for d in dst if d != 1]:
        return None
    src_big = [i for i, d in enumerate(src) if d != 1]
    dst_big = [i for i, d in enumerate(dst) if d != 1]
    mapping = {d: s for d, s in zip(dst_big, src_big, strict=True)}
    return {i: mapping.get(i) for i in range(len(dst))}


def scalar_value(scope: Scope, atom) -> float | None:
    """The Python float of a scalar-like constant operand, else None."""
    value = scope.fold(atom)
    if value is None:
        return None
    value = np.asarray(value)
    if value.size == 0:
        return None
    flat = value.reshape(-1)
    if not np.all(flat == flat[0]) and not np.all(np.isnan(flat)):
        return None
    return float(flat[0])


def uniform_value(scope: Scope, atom) -> float | None:
    """The Python float of ``atom`` when every element is that constant: a
    broadcast scalar, also one an enclosing scope hoisted out of a loop body
    (a ``scan``'s loop-invariant constant, through `Scope.outer`) or a slice of
    a uniform stacked operand (`Scope.sliced`)."""
    prof = profile(scope, atom, scope.shape(atom))
    if prof.is_scalar:
        return scalar_value(scope, prof.base)
    base = scope.resolve(prof.base)
    if isinstance(base, Const) or scope.producer(base) is not None:
        return None
    # Hoisted out of the loop, or a slice of a stacked operand that is uniform.
    found = scope.outer.get(base) or scope.sliced.get(base)
    if found is None:
        return None
    parent, outer_atom = found
    return uniform_value(parent, outer_atom)


def const_key(c: Const):
    """A hashable key of a constant's value (by identity above 1024 elements),
    for signatures that must tell constants apart."""
    value = np.asarray(c.value)
    if value.size > 1024:
        return ("const", id(c.value))
    return ("const", value.dtype.str, value.shape, value.tobytes(), str(c.aval))


# --------------------------------------------------------------------------- mask factors


def role_axes(build, factor: Profile) -> dict:
    """``{role: base axis}`` of a factor profile (carried axes only)."""
    return {build.roles[t]: a for t, a in enumerate(factor.axes) if a is not None}


def query_key_axes(build, factor: Profile, fill):
    """`role_axes` of a factor that varies along both the query and key axes
    and is filled with an excluding value, else None (not a position mask)."""
    if not excludes(fill):
        return None
    axes = role_axes(build, factor)
    return axes if "T" in axes and "S" in axes else None


def folded_matrix(scope, factor, axes):
    """The constant factor as a ``[T, S]`` matrix (equal over every other axis)."""
    base = scope.fold(factor.base)
    if base is None:
        return None
    arr = np.asarray(base)
    t_axis, s_axis = axes["T"], axes["S"]
    others = [a for a in range(arr.ndim) if a not in (t_axis, s_axis)]
    arr = np.transpose(arr, [*others, t_axis, s_axis])
    arr = arr.reshape(-1, arr.shape[-2], arr.shape[-1])
    if not np.all(arr == arr[:1]):
        return None
    return arr[0]


def score_sizes(build) -> tuple[int, int]:
    """The query and key lengths ``(T, S)`` of the site being built."""
    return build.layout.sizes["T"], build.layout.sizes["S"]


# --------------------------------------------------------------------------- affine indices
#
# Masks built from iotas (``jnp.tril``, ``arange`` comparisons,
# ``make_causal_mask``) are affine in the indices: an int value is
# ``sum(coef[a] * idx[a]) + const``, read symbolically at any size.


def affine(scope, atom, depth=0):
    """``(coef tuple, const)`` of an int value affine in its indices, read from
    iotas, integer constants and integer arithmetic, else None."""
    if depth > 32:
        return None
    atom = scope.resolve(atom)
    shape = scope.shape(atom)
    if isinstance(atom, Const):
        value = np.asarray(atom.value)
        if value.size == 1 and np.issubdtype(value.dtype, np.integer):
            return (0,) * len(shape), int(value.reshape(-1)[0])
        return None
    node = scope.producer(atom)
    if node is None:
        return None
    prim = node.prim
    if prim == "iota":
        coef = [0] * len(shape)
        coef[node.params["dimension"]] = 1
        return tuple(coef), 0
    if prim == "convert_element_type" and np.issubdtype(scope.dtype(atom), np.integer):
        return affine(scope, node.ins[0], depth + 1)
    if prim == "broadcast_in_dim":
        src = affine(scope, node.ins[0], depth + 1)
        if src is None:
            return None
        coef = [0] * len(shape)
        src_shape = scope.shape(node.ins[0])
        for k, d in enumerate(node.params["broadcast_dimensions"]):
            coef[d] = src[0][k] if src_shape[k] == shape[d] else 0
        return tuple(coef), src[1]
    if prim in ("add", "sub", "mul"):
        a, b = (affine(scope, x, depth + 1) for x in node.ins)
        if a is None or b is None:
            return None
        a, b = broadcast_affine(a, len(shape)), broadcast_affine(b, len(shape))
        if prim == "add":
            return tuple(x + y for x, y in zip(a[0], b[0], strict=True)), a[1] + b[1]
        if prim == "sub":
            return tuple(x - y for x, y in zip(a[0], b[0], strict=True)), a[1] - b[1]
        if not any(b[0]):
            return tuple(x * b[1] for x in a[0]), a[1] * b[1]
        if not any(a[0]):
            return tuple(x * a[1] for x in b[0]), b[1] * a[1]
    return None


def broadcast_affine(value, rank):
    """An `affine` value at ``rank`` axes: a rank-0 operand's has no
    coefficients, and broadcasts with all of them 0."""
    coef, const = value
    return (coef if len(coef) == rank else (0,) * rank), const
