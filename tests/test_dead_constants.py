"""A constant only a rewritten site read leaves the rewritten program.

GPT-Neo (Hugging Face, through torchax) slices its causal mask from a
``tril(ones(max_positions, max_positions))`` buffer, a constant of the
traced program (``[1, 1, 2T, 2T]`` booleans at ``max_positions = 2T``).  The
site reads the slice as a `Causal` op, so nothing reads the buffer after the
rewrite; JAX's ``dce_jaxpr`` keeps every ``constvar`` of a closed jaxpr
though, so the buffer stayed held by the rewritten program (and counted as
a ``T x S`` array of its training step).  `compat.dce_closed_jaxpr` drops
the constants no equation reads.  A constant something else still reads
stays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from t_by_s import assert_no_t_by_s, optimized_step, t_by_s_shapes

import flashpass

B, H, T, D = 2, 4, 64, 16
MAX_POSITIONS = 2 * T
BUFFER = np.tril(np.ones((MAX_POSITIONS, MAX_POSITIONS), bool))[None, None]
MIN = float(np.finfo(np.float32).min)


def _qkv(rng):
    return tuple(jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32) for _ in range(3))


def _attention(q, k, v):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    causal = jnp.asarray(BUFFER)[:, :, :T, :T]  # GPT-Neo: bias[:, :, k - q : k, :k]
    s = jnp.where(causal, s, MIN)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def gpt_neo(q, k, v):
    return _attention(q, k, v)


def buffer_read_elsewhere(q, k, v):
    # The buffer also scales the output: it is still read after the rewrite.
    return _attention(q, k, v) * jnp.mean(jnp.asarray(BUFFER, jnp.float32))


def _constant_shapes(closed):
    return [tuple(v.aval.shape) for v in closed.jaxpr.constvars]


def test_a_buffer_only_the_site_read_is_dropped(rng):
    args = _qkv(rng)
    report, rewritten, original = optimized_step(gpt_neo, args)
    assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)
    assert "causal" in str(report), str(report)
    assert (1, 1, MAX_POSITIONS, MAX_POSITIONS) in original  # the control holds it
    assert_no_t_by_s(rewritten, T, T, control=original)


def test_a_buffer_read_elsewhere_stays(rng):
    args = _qkv(rng)
    report, rewritten, _ = optimized_step(buffer_read_elsewhere, args)
    assert len(report.rewrites) == 1, str(report)
    assert t_by_s_shapes(rewritten, T, T) == [(1, 1, MAX_POSITIONS, MAX_POSITIONS)]
    opt = flashpass.optimize(buffer_read_elsewhere, kernel="blockwise")
    np.testing.assert_allclose(
        jax.jit(opt)(*args), buffer_read_elsewhere(*args), rtol=2e-5, atol=2e-5
    )
    assert (1, 1, MAX_POSITIONS, MAX_POSITIONS) in _constant_shapes(opt.rewritten_jaxpr(*args))
