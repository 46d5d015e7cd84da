"""Seeded random weights for a model's parameter tree, without running its initialiser.

The shapes come from ``jax.eval_shape(init, ...)`` (nothing runs), so a tiny
model costs nothing to build.  Matrices ~ N(0, 1/fan_in) with fan_in =
shape[0] (scores stay O(1) and softmaxes far from uniform), norm scales
1 + N(0, 0.1^2), other vectors N(0, 0.1^2): the fill the model tests use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def fill(shapes, seed: int = 0):
    """A pytree like ``shapes`` (of ShapeDtypeStruct) with seeded random values."""
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.zeros(x.shape, x.dtype)
        v = rng.standard_normal(x.shape).astype(np.float32)
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", ""))) if path else ""
        if len(x.shape) >= 2:
            v = v / np.sqrt(x.shape[0])
        elif name in ("scale", "weight", "gamma"):
            v = 1.0 + 0.1 * v
        else:
            v = 0.1 * v
        return jnp.asarray(v, x.dtype)

    return jax.tree_util.tree_map_with_path(leaf, shapes)


def random_params(init, *args, seed: int = 0, **kwargs):
    """The pytree ``init(*args, **kwargs)`` would return, filled by `fill`."""
    return fill(jax.eval_shape(lambda *a: init(*a, **kwargs), *args), seed)


def ids(shape, vocab: int, seed: int = 0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def padding(batch: int, length: int, kept: int):
    """Row 0 whole, the others right-padded after ``kept`` tokens (int32 0/1)."""
    keep = np.full((batch,), kept)
    keep[0] = length
    return jnp.asarray(np.arange(length)[None, :] < keep[:, None], jnp.int32)


def normal(shape, seed: int = 0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
