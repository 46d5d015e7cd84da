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

from flashpass.ops import DESCRIPTORS, apply_score_ops

from .base import CheckContext, PlainJaxKernel
from .blockwise.tiles import slice_t
from .dropout import dropout_reasons
from .reference import repeat_kv, softmax_with_sink


class ChunkedKernel(PlainJaxKernel):
    """Query-chunked exact attention (see the module doc).  Capabilities: every
    spec a `PlainJaxKernel` takes except dropout (it cannot regenerate the
    program's keep-mask)."""

    name = "chunked"
    descriptors = frozenset(DESCRIPTORS)

    def __init__(self, chunk: int = 256):
        if chunk < 1:
            raise ValueError(f"chunk={chunk}: a positive number of query rows")
        self.chunk = chunk

    def check(self, spec, ctx: CheckContext):
        return self.platform_reasons(ctx) + dropout_reasons(spec, self)

    def apply(self, spec, q, k, v, extras=(), *, interpret=False):
        self.require(dropout_reasons(spec, self))
        k, v = repeat_kv(spec, k), repeat_kv(spec, v)
        t, c = q.shape[2], min(self.chunk, q.shape[2])
        n, tail = divmod(t, c)

        def rows(start, size):
            return _rows(spec, q, k, v, extras, start, size)

        step = jax.checkpoint(lambda start: rows(start, c), prevent_cse=False)
        head = lax.map(step, jnp.arange(n) * c)  # [n, B, H, c, Dv]
        out = jnp.moveaxis(head, 0, 2).reshape(*head.shape[1:3], n * c, head.shape[-1])
        if tail:
            out = jnp.concatenate([out, rows(n * c, tail)], axis=2)
        return out


def _rows(spec, q, k, v, extras, start, size):
    """The output rows ``start .. start + size`` (``start`` may be traced)."""
    cdt = jnp.dtype(spec.compute_dtype)
    qc = lax.dynamic_slice_in_dim(q, start, size, axis=2)
    ex = [slice_t(x, start, size) for x in extras]  # per-query extras: this chunk's rows
    s = jnp.einsum("bhtd,bhsd->bhts", qc.astype(cdt), k.astype(cdt), preferred_element_type=cdt)
    s = apply_score_ops(spec, s, ex, q_pos=start + jnp.arange(size))
    p = softmax_with_sink(spec, s, ex)
    out = jnp.einsum("bhts,bhsd->bhtd", p.astype(spec.p_dtype), v, preferred_element_type=cdt)
    return out.astype(spec.out_dtype)
