"""``chunked``: exact attention one query chunk at a time, in plain JAX.

Each chunk of ``chunk`` query rows takes its full row of scores against every
key, softmax and ``P·V`` at once (no running max to rescale), under
``jax.checkpoint``: memory is ``chunk x S`` scores per step, forward and
backward, never ``T x S``.  Nothing here is a ``custom_vjp``, so JAX
differentiates it in both modes: ``jax.jvp``, ``jax.jacfwd`` and
``jax.linearize`` work through it, which no flash kernel with its own
backward allows.  Name it (``kernel="chunked"``) for a program that is
differentiated forward; it is in no default order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .base import CheckContext, PlainJaxKernel
from .blockwise.tiles import slice_t
from .dropout import dropout_reasons
from .reference import reference_attention


class ChunkedKernel(PlainJaxKernel):
    """Query-chunked exact attention (see the module doc).  Capabilities: every
    spec a `PlainJaxKernel` takes except dropout (it cannot regenerate the
    program's keep-mask)."""

    name = "chunked"

    def __init__(self, chunk: int = 256):
        if chunk < 1:
            raise ValueError(f"chunk={chunk}: a positive number of query rows")
        self.chunk = chunk

    def check(self, spec, ctx: CheckContext):
        return self.platform_reasons(ctx) + dropout_reasons(spec, self)

    def apply(self, spec, q, k, v, extras=(), *, interpret=False):
        self.require(dropout_reasons(spec, self))
        t, c = q.shape[2], min(self.chunk, q.shape[2])
        n, tail = divmod(t, c)

        def rows(start, size):
            """The output rows ``start .. start + size`` (``start`` may be traced):
            the reference on those queries, per-query extras sliced to them."""
            qc = lax.dynamic_slice_in_dim(q, start, size, axis=2)
            ex = [slice_t(x, start, size) for x in extras]
            return reference_attention(spec, qc, k, v, ex, q_pos=start + jnp.arange(size))

        step = jax.checkpoint(lambda start: rows(start, c), prevent_cse=False)
        head = lax.map(step, jnp.arange(n) * c)  # [n, B, H, c, Dv]
        out = jnp.moveaxis(head, 0, 2).reshape(*head.shape[1:3], n * c, head.shape[-1])
        if tail:
            out = jnp.concatenate([out, rows(n * c, tail)], axis=2)
        return out
