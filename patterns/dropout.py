"""Dropout on the attention probabilities, recovered from the program.

The spellings, all ending in a keep-mask drawn by ``jax.random.bernoulli``
(or ``jax.random.uniform(key, shape) < keep``, the same equations):

* ``where(keep, p / keep_prob, 0)`` (hand-written, Keras-style; the division
  is an output scale, see `probabilities`), and ``where(drop, 0, p / keep_prob)``
  with ``drop = bernoulli(key, rate)``;
* ``p * keep.astype(p.dtype) / keep_prob`` (mask as a float);
* ``p * (keep.astype(dtype) / keep_prob)``: flax's
  ``dot_product_attention_weights`` (``MultiHeadDotProductAttention`` with
  ``dropout_rate > 0`` and ``deterministic=False``), masks broadcast over batch
  and heads (``broadcast_dropout=True``) or not.

From the equations: the key (a scalar key, ``random_wrap`` of ``uint32[2]``
data or a typed key), the mask's shape and how it broadcasts onto the weights,
the width of the random bits and the uniform's dtype, the threshold compared
against (``keep_prob`` in that dtype), and the multiplier actually used (for
bf16, ``1 / bf16(keep_prob)`` rounded).  The kernel regenerates the same mask
per tile (`flashpass.kernels.dropout`), so the rewrite is the same function
for the same key.  The site is kept, with the reason, where that cannot be
promised: a non-threefry PRNG (``rbg``, ``unsafe_rbg``),
``jax_threefry_partitionable=False``, a key per element, or a mask of more
than 2**32 elements.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from flashpass import compat
from flashpass.graph import Scope
from flashpass.site import ExtraSource, Transform
from flashpass.spec import Dropout

from .common import Miss, profile, scalar_value, where
from .regroup import UNIT, Merged

#: Most keep-mask elements: flat indices fit the low counter word.
MAX_ELEMENTS = 2**32


@dataclasses.dataclass(frozen=True)
class FoundDropout:
    """What `match_dropout` recovered (turned into a `flashpass.spec.Dropout`
    by `dropout_op` once the site's layout is known)."""

    key: object  # the key atom: uint32[2] data, or a typed key
    typed: bool
    strides: dict  # role -> stride of its axis in the flat mask index
    mask_shape: tuple
    bits: int
    uniform_dtype: str
    threshold: float
    keep_below: bool
    scale: float


def match_dropout(scope: Scope, node, pos: int, roles: list) -> FoundDropout | Miss:
    """Dropout at ``node`` (a ``select_n`` or ``mul`` reading the probabilities
    as operand ``pos``, whose axes have ``roles``)."""
    shape = scope.shape(node.out)
    scale = 1.0
    if node.prim == "select_n":
        pred, *cases = node.ins
        if len(cases) != 2 or pos == 0:
            return _miss("a random `select_n`", node)
        other = profile(scope, cases[2 - pos], shape)
        if not other.is_scalar or scalar_value(scope, other.base) != 0.0:
            return _miss("a random choice that is not between the weights and 0", node)
        mask, polarity = pred, pos == 2
    else:  # mul
        mask, polarity = node.ins[1 - pos], True
    prof = profile(scope, mask, shape)
    atom = scope.resolve(prof.base)
    # Back from the mask to the comparison: float casts and a constant divisor.
    while True:
        producer = scope.producer(atom)
        if producer is None:
            return _miss("random values that are not a bernoulli keep-mask", node)
        if producer.prim == "div" and scalar_value(scope, producer.ins[1]) is not None:
            one = np.asarray(1, scope.dtype(producer.out))
            divisor = np.asarray(scalar_value(scope, producer.ins[1]), one.dtype)
            scale = float(np.asarray(one / divisor, one.dtype)) * scale
            atom = scope.resolve(producer.ins[0])
            continue
        if producer.prim == "convert_element_type" and scope.dtype(producer.ins[0]) == np.bool_:
            atom = scope.resolve(producer.ins[0])
            continue
        if producer.prim == "not" and scope.dtype(atom) == np.bool_:
            polarity = not polarity
            atom = scope.resolve(producer.ins[0])
            continue
        if producer.prim == "reshard":  # a mesh-replicated mask laid out like the weights
            atom = scope.resolve(producer.ins[0])
            continue
        break
    if scope.dtype(atom) != np.bool_ or producer.prim != "lt":
        return _miss("random values that are not a bernoulli keep-mask", node)
    if node.prim == "mul" and scope.dtype(mask) == np.bool_:
        return _miss("a boolean random mask multiplied in", node)
    found = _bernoulli(scope, producer)
    if isinstance(found, Miss):
        return found
    key, typed, mask_shape, bits, udtype, threshold = found
    if tuple(scope.shape(atom)) != tuple(mask_shape):
        return _miss("a keep-mask reshaped after drawing", node)
    problem = _exactness(scope, key, mask_shape, node)
    if problem is not None:
        return problem
    strides = _role_strides(prof.axes, roles, mask_shape)
    if isinstance(strides, str):
        return _miss(strides, node)
    return FoundDropout(key, typed, strides, mask_shape, bits, udtype, threshold, polarity, scale)


def _miss(what: str, node) -> Miss:
    return Miss(
        f"dropout on the attention probabilities{where(node)} is kept as written: {what}", node
    )


def _bernoulli(scope: Scope, lt):
    """``lt(uniform, threshold)`` as ``jax.random.uniform`` builds it, back to
    its ``random_bits``: (key atom, typed, shape, bits, uniform dtype, threshold)."""
    u, thr = lt.ins
    threshold = scalar_value(scope, thr)
    if threshold is None:
        return _miss("the keep probability is not a constant", lt)
    dtype = np.dtype(scope.dtype(u))
    if dtype.name not in ("float32", "bfloat16", "float16"):
        return _miss(f"a {dtype.name} uniform", lt)
    finfo = jnp.finfo(dtype)
    nbits, nmant = finfo.bits, finfo.nmant
    rng_bits = 8 if nmant < 8 else nbits
    one_bits = int(np.array(1.0, dtype).view(f"uint{nbits}"))
    # (prim, constant operand expected or None to skip the check)
    steps = [
        ("max", 0.0),
        ("add", 0.0),
        ("mul", 1.0),
        ("sub", 1.0),
        ("bitcast_convert_type", None),
        ("or", float(one_bits)),
        ("shift_right_logical", float(rng_bits - nmant)),
    ]
    atom = scope.resolve(u)
    optional = {"max", "add", "mul"}
    for prim, const in steps:
        node = scope.producer(atom)
        if node is None:
            return _miss("a keep-mask not drawn by jax.random", lt)
        if node.prim != prim:
            if prim in optional:
                continue
            return _miss(f"a keep-mask not drawn by jax.random (`{node.prim}`)", node)
        if const is None:
            atom = scope.resolve(node.ins[0])
            continue
        pick = _operand_besides_const(scope, node, const)
        if pick is None:
            return _miss(f"a keep-mask not drawn by jax.random (`{prim}`)", node)
        atom = pick
    node = scope.producer(atom)
    if node is not None and node.prim == "convert_element_type":
        atom = scope.resolve(node.ins[0])
        node = scope.producer(atom)
    if node is None or node.prim != "random_bits":
        return _miss("a keep-mask not drawn by jax.random.bits", lt)
    if node.params.get("bit_width") != rng_bits:
        return _miss("random bits of an unexpected width", node)
    key = scope.resolve(node.ins[0])
    typed = True
    wrap = scope.producer(key)
    if wrap is not None and wrap.prim == "random_wrap" and scope.shape(wrap.ins[0]) == (2,):
        impl = compat.wrap_impl_name(wrap.params)
        if impl != "threefry2x32":
            return _miss(f"the {impl} PRNG (exact only with threefry2x32)", node)
        key, typed = scope.resolve(wrap.ins[0]), False
    else:
        impl = compat.prng_impl_name(scope.aval(key).dtype)
        if impl != "threefry2x32" or scope.shape(key) != ():
            what = "a key per element" if scope.shape(key) != () else f"the {impl} PRNG"
            return _miss(f"{what} (exact only with one threefry2x32 key)", node)
    shape = tuple(node.params["shape"])
    return key, typed, shape, rng_bits, dtype.name, float(np.asarray(threshold, dtype))


def _operand_besides_const(scope: Scope, node, const: float):
    """The non-constant operand of a binary ``node`` whose other operand is the
    scalar-like ``const`` (max, add, mul commute; the rest take it second)."""
    a, b = node.ins
    for x, c in ((a, b), (b, a)) if node.prim in ("max", "add", "mul") else ((a, b),):
        if scope.shape(x) == scope.shape(node.out) and scalar_value(scope, c) == const:
            return scope.resolve(x)
    return None


def _exactness(scope: Scope, key, mask_shape, node) -> Miss | None:
    if not compat.threefry_partitionable():
        return _miss(
            "jax_threefry_partitionable=False draws bits that depend on the whole mask's "
            "shape, so no tile can be regenerated alone",
            node,
        )
    if int(np.prod(mask_shape, dtype=np.int64)) > MAX_ELEMENTS:
        return _miss("a keep-mask of more than 2**32 elements", node)
    return None


def _role_strides(axes: tuple, roles: list, mask_shape: tuple) -> dict | str:
    """role -> stride of the mask axis that role reads (row-major flat index)."""
    strides = [int(np.prod(mask_shape[i + 1 :], dtype=np.int64)) for i in range(len(mask_shape))]
    out: dict = {}
    used = set()
    for role, axis in zip(roles, axes, strict=True):
        if axis is None or role == UNIT or mask_shape[axis] == 1:
            continue
        if isinstance(role, Merged):
            return "a keep-mask over merged axes"
        if axis in used:
            return "a keep-mask axis read twice"
        used.add(axis)
        out[role] = strides[axis]
    if any(n != 1 and a not in used for a, n in enumerate(mask_shape)):
        return "a keep-mask with an axis the weights do not have"
    return out


def dropout_op(found: FoundDropout, layout, index: int):
    """The site's `Dropout` op (key in ``extras[index]``) and the key's source."""
    b, h, _ = layout.groups
    axes = tuple(
        tuple((layout.sizes[r], found.strides.get(r, 0)) for r in group)
        for group in (b, h, ["T"], ["S"])
    )
    op = Dropout(
        index=index,
        shape=(1, 1, 1, 2),
        mask_shape=tuple(found.mask_shape),
        axes=axes,
        bits=found.bits,
        uniform_dtype=found.uniform_dtype,
        threshold=found.threshold,
        keep_below=found.keep_below,
        scale=found.scale,
    )
    source = ExtraSource(
        found.key, {r: None for r in layout.sizes}, Transform.KEY, np.dtype(np.uint32)
    )
    return op, source
