"""PRNG internals used by exact attention dropout.

A keep-mask drawn by ``jax.random.bernoulli(key, p, shape)`` is regenerated
tile by tile from the key (see `flashpass.kernels.dropout`).  That needs the
raw threefry primitive (``jax.extend.random.threefry2x32_p``), the name of a
key type's PRNG implementation, and the ``jax_threefry_partitionable`` flag,
which decides how ``random_bits`` maps flat indices to counters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def threefry2x32(k1, k2, x1, x2):
    """The two output words of Threefry-2x32 of counters ``(x1, x2)`` under the
    key ``(k1, k2)`` (uint32; scalars broadcast), as ``jax.random.bits`` runs it."""
    from jax.extend.random import threefry2x32_p

    x1, x2 = jnp.broadcast_arrays(x1, x2)
    k1 = jnp.broadcast_to(jnp.asarray(k1, jnp.uint32), x1.shape)
    k2 = jnp.broadcast_to(jnp.asarray(k2, jnp.uint32), x1.shape)
    return threefry2x32_p.bind(k1, k2, x1, x2)


def threefry2x32_rounds(k1, k2, x1, x2):
    """`threefry2x32` written out in uint32 adds, rotations and XORs (Threefry-2x32's
    20 rounds with JAX's rotation constants): bit-equal to the primitive, for
    kernels whose backend has no lowering rule for it (Pallas Triton)."""
    k1, k2 = (jnp.asarray(k, jnp.uint32) for k in (k1, k2))
    keys = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    x1, x2 = x1 + keys[0], x2 + keys[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x1 = x1 + x2
            x2 = (x2 << np.uint32(r)) | (x2 >> np.uint32(32 - r))
            x2 = x2 ^ x1
        x1 = x1 + keys[(i + 1) % 3]
        x2 = x2 + keys[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def threefry_partitionable() -> bool:
    """Whether ``random_bits`` draws element ``i`` from counter ``i`` alone
    (``jax_threefry_partitionable``, the default since JAX 0.5)."""
    return bool(jax.config.jax_threefry_partitionable)


def is_key_dtype(dtype) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``key<fry>``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def prng_impl_name(dtype) -> str | None:
    """The PRNG implementation's name of a key dtype ("threefry2x32", "rbg",
    "unsafe_rbg", ...), or None when it cannot be told."""
    impl = getattr(dtype, "_impl", None)
    return getattr(impl, "name", None)


def wrap_impl_name(params: dict) -> str | None:
    """The implementation's name of a ``random_wrap`` equation's params."""
    return getattr(params.get("impl"), "name", None)


def raw_key_data(x):
    """uint32 key data of a typed key, or ``x`` itself for a raw ``uint32[2]`` key."""
    if is_key_dtype(jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype):
        return jax.random.key_data(x)
    return jnp.asarray(x, np.uint32)
