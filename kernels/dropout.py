"""Exact attention dropout: any tile of the program's keep-mask, from its key.

Under partitionable Threefry (JAX's default), ``jax.random.bits(key, shape)``
draws flat element ``i`` as the XOR of the two words of
``threefry2x32(key, (hi, lo))``, ``(hi, lo)`` the 64-bit ``i``; narrower bits
are the low bits of that word.  ``jax.random.uniform`` then keeps the top
mantissa bits: ``bitcast((bits >> (bits - nmant)) | bits(1.0)) - 1``, and
``bernoulli`` compares that with ``p``.  So the keep-mask at any element is a
pure function of the key and the element's flat index in the program's mask:
a kernel regenerates a tile ``[t0:t1, s0:s1]`` without the ``T x S`` mask.
`Dropout` (in `flashpass.spec`) records what the program drew; `keep_mask`
computes it for canonical indices and `reference_keep` via ``jax.random``
itself (the oracle of the tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass import compat
from flashpass.spec import AttentionSpec, Dropout

_UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32}


def flat_index(op: Dropout, b, h, t, s):
    """The flat keep-mask index (uint32) of canonical positions ``b, h, t, s``
    (integer arrays that broadcast together)."""
    total = None
    for digits, index in zip(op.axes, (b, h, t, s), strict=True):
        rest = jnp.asarray(index).astype(jnp.uint32)
        for size, stride in reversed(digits):
            if size > 1 and stride:
                part = (rest % np.uint32(size)) * np.uint32(stride)
                total = part if total is None else total + part
            rest = rest // np.uint32(size)
    if total is None:
        return jnp.zeros((), jnp.uint32)
    return total


def uniform_of_bits(op: Dropout, bits32):
    """``jax.random.uniform``'s value in ``[0, 1)`` from 32 random bits, for
    ``op.bits`` drawn bits (the low ones) and ``op.uniform_dtype``."""
    dtype = np.dtype(op.uniform_dtype)
    finfo = jnp.finfo(dtype)
    nbits, nmant = finfo.bits, finfo.nmant
    bits = bits32 if op.bits == 32 else bits32.astype(_UINT[op.bits])
    bits = bits.astype(_UINT[nbits])
    one = np.array(1.0, dtype).view(_UINT[nbits])
    floats = (bits >> _UINT[nbits](op.bits - nmant)) | one
    return lax.bitcast_convert_type(floats, dtype) - jnp.asarray(1.0, dtype)


def keep_mask(op: Dropout, key, b, h, t, s):
    """Whether the program keeps the weight at canonical ``(b, h, t, s)``
    (index arrays that broadcast together); ``key`` is the op's extra."""
    key = jnp.reshape(key, (2,)).astype(jnp.uint32)
    return keep_mask_words(op, key[0], key[1], b, h, t, s)


def keep_mask_words(op: Dropout, k1, k2, b, h, t, s, threefry=None):
    """`keep_mask` from the key's two uint32 words ``k1``, ``k2`` (scalars):
    the form a Pallas kernel calls, with the key read from scalar memory.
    ``threefry``: the Threefry-2x32 function (default: JAX's primitive;
    `compat.threefry2x32_rounds` where a backend has no rule for it)."""
    threefry = threefry or compat.threefry2x32
    flat = flat_index(op, b, h, t, s)
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (b, h, t, s)))
    flat = jnp.broadcast_to(flat, shape)
    k1, k2 = (jnp.asarray(w).astype(jnp.uint32) for w in (k1, k2))
    w1, w2 = threefry(k1, k2, jnp.zeros_like(flat), flat)
    return _compare(op, uniform_of_bits(op, w1 ^ w2))


def _compare(op: Dropout, u):
    threshold = jnp.asarray(op.threshold, u.dtype)
    return u < threshold if op.keep_below else u >= threshold


def apply_dropout(op: Dropout, p, keep):
    """``where(keep, p * scale, 0)`` in ``p``'s dtype."""
    if op.scale != 1.0:
        p = p * jnp.asarray(op.scale, p.dtype)
    return jnp.where(keep, p, jnp.zeros((), p.dtype))


def reference_keep(spec: AttentionSpec, op: Dropout, key):
    """The ``[B, H, T, S]`` keep-mask, drawn with ``jax.random`` itself (as
    ``bernoulli`` does) and gathered at each canonical position's flat index."""
    k = jax.random.wrap_key_data(jnp.reshape(key, (2,)).astype(jnp.uint32), impl="threefry2x32")
    u = jax.random.uniform(k, op.mask_shape, np.dtype(op.uniform_dtype))
    keep = _compare(op, u).reshape(-1)
    b, h, t, s = (
        jnp.arange(n).reshape([n if i == a else 1 for i in range(4)])
        for a, n in enumerate((spec.batch, spec.heads, spec.q_len, spec.kv_len))
    )
    shape = (spec.batch, spec.heads, spec.q_len, spec.kv_len)
    return keep[jnp.broadcast_to(flat_index(op, b, h, t, s), shape)]


def dropout_reasons(spec: AttentionSpec, kernel) -> list[str]:
    """The reason a kernel that does not declare `Kernel.dropout` rejects a
    spec with a `Dropout` op (empty otherwise)."""
    if spec.dropout is None or kernel.dropout:
        return []
    return [
        f"{kernel.name} cannot regenerate the program's dropout mask (exact dropout "
        "on the attention weights); the 'blockwise' kernel does"
    ]
