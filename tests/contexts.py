"""Calling a function for the first time in each context users call it from.

Shared by tests/test_contexts.py (every spelling) and the model suite
(tests/models/conftest.py).  ``in_context(context, f, args)`` makes the call;
``f`` may be the original or an optimized function, so the two can be
compared context by context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

CONTEXTS = ("direct", "jit", "eval_shape", "grad", "vmap", "scan", "checkpoint", "shard_map")


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _other(x, i: int):
    """A second batch entry unlike ``x``, for argument ``i``: a floating array
    rolled by ``i + 1`` along its last axis (a different shift per argument, so
    q . k changes too; masks and biases stay masks and biases, with the same
    number of kept keys per row); other arrays (ids, booleans) unchanged.  A
    kernel that mixes up the two entries then computes something else."""
    x = jnp.asarray(x)
    if not _is_float(x) or x.ndim == 0:
        return x
    return jnp.roll(x, i + 1, axis=-1)


def _mesh():
    return jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def in_context(context: str, f, args, *, grad_argnums=None, batched=None):
    """``f(*args)``'s first call made in ``context``; returns what to compare.

    ``grad_argnums``: the arguments ``grad`` differentiates (default: every
    floating-point array argument).  ``batched``: the arguments ``vmap`` and
    ``scan`` map over (default: all; parameters are usually left out).
    """
    args = tuple(args)
    if not batched:  # nothing named (or nothing but parameters): map over everything
        batched = tuple(range(len(args)))
    if context == "direct":
        return f(*args)
    if context == "jit":
        return jax.jit(f)(*args)
    if context == "eval_shape":
        return jax.eval_shape(f, *args)
    if context == "grad":
        if grad_argnums is None:
            grad_argnums = tuple(i for i, a in enumerate(args) if _is_float(a))
        shape = jax.eval_shape(f, *args).shape
        ct = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)

        def loss(*a):
            return jnp.sum(f(*a).astype(jnp.float32) * ct)

        return jax.grad(loss, argnums=grad_argnums)(*args)
    if context == "vmap":
        stacked = [
            jax.tree_util.tree_map(lambda x, i=i: jnp.stack([x, _other(x, i)]), a)
            if i in batched
            else a
            for i, a in enumerate(args)
        ]
        axes = tuple(0 if i in batched else None for i in range(len(args)))
        return jax.vmap(f, in_axes=axes)(*stacked)
    if context == "scan":
        xs = tuple(jax.tree_util.tree_map(lambda x: x[None], args[i]) for i in batched)

        def step(carry, x):
            full = list(args)
            for i, value in zip(batched, x, strict=True):
                full[i] = value
            return carry, f(*full)

        return jax.lax.scan(step, 0.0, xs)[1][0]
    if context == "checkpoint":
        return jax.checkpoint(f)(*args)
    if context == "shard_map":
        specs = tuple(P() for _ in args)
        return jax.jit(jax.shard_map(f, mesh=_mesh(), in_specs=specs, out_specs=P()))(*args)
    raise ValueError(f"unknown context {context!r}")
