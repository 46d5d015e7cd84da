"""Empty rows whose filled scores all round to the fill: the mean of v.

A query row that an additive mask leaves with no key computes, in the
original, ``softmax(s * c + fill)`` over every key (`kernels.empty_rows`).
Where ``|s * c|`` is below a quarter of the spacing of float32 numbers at
``fill`` (``-1e9``: 16; ``finfo.min``: about 1e31), every ``s * c + fill``
rounds to ``fill`` itself, so every probability is ``1 / S`` and the row is the
mean of v over the keys: what the kernel's second call computes, without its
score product.  The bound is checked on the values, per gathered chunk of rows
(Cauchy-Schwarz: ``|q . k| <= |q| |k|``, doubled for the product's rounding);
a chunk that misses it runs the kernel.

Only the forward is shortened: the original's scores still depend on q and k
(``d(s + fill) / ds = 1``, whatever the rounding), so the gradient is the
kernel's own vjp of its second call, recomputed (`jax.custom_vjp`).  Left
padding thus costs its empty rows' mean in inference and their full attention
in training, as the original does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flashpass.ops import Bias, Scale

from .blockwise.tiles import varying

#: The bound's margin below the spacing at ``fill``: half for rounding to
#: nearest, and half again for the score product's own rounding error.
MARGIN = 0.25


def factor(spec, fill_index: int) -> float | None:
    """The scale applied to ``q . k`` before the fill is added, when the filled
    spec's scores are ``(q . k) * c + fill`` (times any later scales): every
    op a `Scale` or the fill's one-element `Bias`.  None otherwise."""
    c, seen = 1.0, False
    for op in spec.ops:
        if isinstance(op, Scale):
            c = c if seen else c * float(op.value)
        elif isinstance(op, Bias) and op.index == fill_index and not seen:
            seen = True
        else:
            return None
    return c if seen else None


def rows_call(call, spec, added: float, kv_layout: str, q_rows, k, v, extras):
    """``call(q_rows, k, v, extras)`` (the kernel's second call on gathered
    empty rows), or the mean of v where the bound above holds for the chunk."""
    c = factor(spec, len(extras) - 1)
    fill = np.float32(added)
    if c is None or not np.isfinite(fill):
        return call(q_rows, k, v, extras)
    # The spacing below |fill| (toward zero: at a power of two, the finer one).
    limit = float(np.abs(fill) - np.nextafter(np.abs(fill), np.float32(0))) * MARGIN
    key_axis = 2 if kv_layout == "bhsd" else 1

    def mean_v(q_rows, k, v):
        mean = jnp.mean(v.astype(jnp.float32), axis=key_axis)  # [B, Hkv, Dv]
        mean = jnp.repeat(mean, spec.heads // spec.kv_heads, axis=1)
        out = jnp.broadcast_to(mean[:, :, None, :], (*q_rows.shape[:3], mean.shape[-1]))
        return out.astype(spec.out_dtype)

    def fast(q_rows, k, v, extras):
        qn = jnp.max(jnp.linalg.norm(q_rows.astype(jnp.float32), axis=-1))
        kn = jnp.max(jnp.linalg.norm(k.astype(jnp.float32), axis=-1))
        rounds_to_fill = abs(c) * qn * kn < limit

        def uniform():
            return varying(mean_v(q_rows, k, v), q_rows, k, v, extras)

        return lax.cond(rounds_to_fill, uniform, lambda: call(q_rows, k, v, extras))

    @jax.custom_vjp
    def rows(q_rows, k, v, extras):
        return fast(q_rows, k, v, extras)

    def fwd(q_rows, k, v, extras):
        return fast(q_rows, k, v, extras), (q_rows, k, v, extras)

    def bwd(res, ct):
        _, pull = jax.vjp(call, *res)
        return pull(ct)

    rows.defvjp(fwd, bwd)
    return rows(q_rows, k, v, extras)
