"""`Replayed`: an extra computed by replaying a few elementwise equations of the program.

A mask the program computes elementwise from positional patterns and a
key-side array (keras-hub's ``minimum(int(padding)[:, None], int(causal))``)
is, on each band of diagonals, that arithmetic with every pattern replaced by
its value there.  With the patterns held constant nothing varies along the
queries any more, so the arithmetic runs with the query axis of every value at size 1:
the result is ``[.., 1, S]``, O(B·S), and no ``T x S`` array is built.
`patterns.band_select` proves the reading and records the equations as
`Step`s; `Replayed.apply` runs them on the key-side array, in the program's
own dtypes (so ``minimum(-1, 0)`` is what the program computes).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

#: Primitives a replay runs, as NumPy-style functions that broadcast (the
#: query axis of every value is size 1 in a replay, not the program's T).
ELEMENTWISE = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "min": jnp.minimum,
    "max": jnp.maximum,
    "and": jnp.bitwise_and,
    "or": jnp.bitwise_or,
    "xor": jnp.bitwise_xor,
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "lt": jnp.less,
    "le": jnp.less_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
    "not": jnp.invert,
    "neg": jnp.negative,
    "abs": jnp.abs,
    "sign": jnp.sign,
    "convert_element_type": lambda x: x,  # the cast is the step's dtype
    "copy": lambda x: x,
    "copy_p": lambda x: x,
    "select_n": lambda which, *cases: _select_n(which, cases),
}

#: Primitives that move axes; a replay follows them with the query axis at size 1.
STRUCTURAL = ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims")


def _select_n(which, cases):
    if len(cases) == 2:
        return jnp.where(which.astype(bool), cases[1], cases[0])
    out = cases[0]
    for i, case in enumerate(cases[1:], 1):
        out = jnp.where(which == i, case, out)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """One equation of a replay: ``prim`` on ``ins`` (each ``("x",)``, the
    key-side array; ``("value", array)``, a constant, already with the query
    axis at size 1; or ``("step", i)``), giving ``dtype``.  Structural
    primitives carry the program's ``in_shape`` and ``out_shape`` and their
    ``params``."""

    prim: str
    ins: tuple
    dtype: object
    params: dict = dataclasses.field(default_factory=dict)
    in_shape: tuple = ()
    out_shape: tuple = ()


@dataclasses.dataclass(frozen=True, eq=False)
class Replayed:
    """An extra that is the program's equations `steps` replayed on one
    key-side array (the atom the `ExtraSource` reads), with the query axis at
    size 1 (`t_axes`: each structural step's query axis in its output, or
    None).  Its axes are those of the last step's output, not the atom's, so
    it is read whole (never sharded: `flashpass.sharding`)."""

    steps: tuple

    #: Read whole by every device (its axes are not the atom's).
    reads_whole = True

    def apply(self, x):
        values = []
        for step in self.steps:
            ins = [_read(ref, x, values) for ref in step.ins]
            values.append(_run(step, ins))
        return values[-1]


def _read(ref, x, values):
    kind = ref[0]
    if kind == "x":
        return jnp.asarray(x)
    if kind == "value":
        return jnp.asarray(ref[1])
    return values[ref[1]]


def _run(step: Step, ins: list):
    if step.prim in ELEMENTWISE:
        return jnp.asarray(ELEMENTWISE[step.prim](*ins)).astype(step.dtype)
    (x,) = ins[:1]
    x = jnp.asarray(x)
    if step.prim == "transpose":
        return jnp.transpose(x, step.params["permutation"])
    if step.prim == "broadcast_in_dim":
        dims = step.params["broadcast_dimensions"]
        # The output keeps the program's sizes where the operand has them,
        # 1 where the operand (query axis, substituted pattern) is 1.
        shape = [x.shape[dims.index(o)] if o in dims else 1 for o in range(len(step.out_shape))]
        return lax.broadcast_in_dim(x, tuple(shape), dims)
    # reshape / squeeze / expand_dims that only add or remove unit axes
    # (`patterns.band_select` checks): drop the program's unit input axes,
    # add its unit output axes.
    drop = tuple(a for a, d in enumerate(step.in_shape) if d == 1)
    x = jnp.squeeze(x, drop) if drop else x
    add = tuple(a for a, d in enumerate(step.out_shape) if d == 1)
    return jnp.expand_dims(x, add) if add else x


def unit_only(in_shape, out_shape) -> bool:
    """Whether a reshape from ``in_shape`` to ``out_shape`` only adds or
    removes size-1 axes."""
    return [d for d in in_shape if d != 1] == [d for d in out_shape if d != 1]


def constant_value(value, dtype, t_axis):
    """A constant operand of a replay: ``value`` in ``dtype`` with its query
    axis (``t_axis``, or None) cut to size 1."""
    value = np.asarray(value, dtype=dtype)
    if t_axis is not None and value.ndim and value.shape[t_axis] != 1:
        value = np.take(value, [0], axis=t_axis)
    return value
