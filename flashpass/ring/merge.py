"""Merging a ring step's block into the running output and statistics, and
the global statistics a step kernel's backward reads."""

from __future__ import annotations

import jax.numpy as jnp


def merge_block(acc, m, total, o_b, m_b, den_b):
    """The running ``(acc, m, total)`` of some query rows (unnormalised
    output ``[.., t, Dv]``, row max and row sum ``[.., t]``, float32) merged
    with a kernel block's normalised output ``o_b`` and row statistics
    ``m_b``, ``den_b`` (`Kernel.step_forward`, laid out alike): the online
    softmax in float32.  A block row of no weight (``-inf`` statistics) adds
    nothing, whatever its output."""
    m_b, den_b = m_b.astype(jnp.float32), den_b.astype(jnp.float32)
    m_new = jnp.maximum(m, m_b)
    base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    old = jnp.where(jnp.isfinite(m), jnp.exp(m - base), 0.0)
    w = jnp.where(jnp.isfinite(m_b), jnp.exp(m_b - base), 0.0) * den_b
    o_b = jnp.where(w[..., None] > 0, o_b.astype(jnp.float32) * w[..., None], 0.0)
    return acc * old[..., None] + o_b, m_new, total * old + w


def global_stats(o, m, total, rows: tuple):
    """What a kernel step's backward reads (`Kernel.step_backward`): the
    global output ``[*rows, Dv]``, row max and row sum ``rows``, from the
    ring's normalised output and statistics.  A row every key of which
    ``-inf`` excluded gets max 0 and sum 1, so its weights are 0."""
    m_out = jnp.where(jnp.isfinite(m), m, 0.0).reshape(rows)
    den_out = jnp.where(total > 0, total, 1.0).reshape(rows)
    return o.reshape(*rows, o.shape[-1]), m_out, den_out
