"""The executable definition of `AttentionSpec` semantics.

`reference_attention` computes a spec the naive way (full ``T x S`` scores).
It is the oracle of the kernel conformance tests and, registered as the
``reference`` kernel (never in a default order), lets tests check the
matcher's canonicalisation independently of any fast kernel's numerics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashpass.ops import apply_score_ops
from flashpass.spec import AttentionSpec

from .base import CheckContext, PlainJaxKernel
from .dropout import apply_dropout, reference_keep


def repeat_kv(spec: AttentionSpec, x):
    """Expand ``[B, Hkv, S, D]`` to ``[B, H, S, D]`` (query head h reads h // G)."""
    if spec.groups == 1:
        return x
    return jnp.repeat(x, spec.groups, axis=1)


def softmax_with_sink(spec: AttentionSpec, s, extras):
    """``softmax(s)`` over the last axis, with the spec's `Sink` logit (if any)
    joining the normaliser: ``softmax(concat([s, sink]))[..., :-1]``."""
    op = spec.sink
    if op is None:
        return jax.nn.softmax(s, axis=-1)
    sink = jnp.broadcast_to(extras[op.index].astype(s.dtype), (*s.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]


def sink_cotangent(sink, m, den, delta):
    """The cotangent of a `Sink` extra ``sink`` (``[B|1, H|1, T|1, 1]``) for a
    kernel that started each row's softmax from it.  The sink weighs ``p =
    exp(sink - m) / den`` in its row (``m``, ``den``: the row max and sum,
    sink included, ``[B, H, T]``) and has no value, so ``dsink = -p * delta``
    (``delta = rowsum(dO * O)``), summed over the axes ``sink`` broadcasts
    along."""
    full = delta.shape
    s = jnp.broadcast_to(sink[..., 0].astype(delta.dtype), full)
    weight = jnp.where(s == -jnp.inf, 0, jnp.exp(s - m) / den)
    axes = tuple(a for a in range(3) if sink.shape[a] == 1 and full[a] != 1)
    grad = (-weight * delta).sum(axes, keepdims=True)
    return grad.reshape(sink.shape).astype(sink.dtype)


def reference_attention(spec: AttentionSpec, q, k, v, extras=(), *, dtype=None, q_pos=None):
    """Naive attention for ``spec``; ``dtype`` overrides the compute dtype
    (tests use float64 as the oracle).  ``q_pos``: the queries' positions
    where ``q`` holds some of the spec's rows (``extras`` sliced to them;
    the `chunked` kernel), else ``0 .. T-1``."""
    cdt = jnp.dtype(dtype or spec.compute_dtype)
    k = repeat_kv(spec, k)
    v = repeat_kv(spec, v)
    s = jnp.einsum("bhtd,bhsd->bhts", q.astype(cdt), k.astype(cdt), preferred_element_type=cdt)
    s = apply_score_ops(spec, s, extras, q_pos=q_pos)
    p = softmax_with_sink(spec, s, extras)
    drop = spec.dropout
    if drop is not None:
        p = apply_dropout(drop, p, reference_keep(spec, drop, extras[drop.index]))
    p_dtype = cdt if dtype is not None else spec.p_dtype
    v_dtype = cdt if dtype is not None else v.dtype
    out = jnp.einsum(
        "bhts,bhsd->bhtd", p.astype(p_dtype), v.astype(v_dtype), preferred_element_type=cdt
    )
    return out.astype(spec.out_dtype if dtype is None else cdt)


class ReferenceKernel(PlainJaxKernel):
    """Naive XLA attention on the canonical layout.  Not in any default order:
    it exists to test the matcher (its numerics equal the original code's).
    Capabilities: every spec, as a `PlainJaxKernel`, dropout included (drawn
    with ``jax.random`` itself, `dropout.reference_keep`)."""

    name = "reference"
    dropout = True

    def check(self, spec, ctx: CheckContext):
        return self.platform_reasons(ctx)

    def apply(self, spec, q, k, v, extras=(), *, interpret=False):
        return reference_attention(spec, q, k, v, extras)
