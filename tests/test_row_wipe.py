"""A wipe of the attention output's empty rows after ``P·V`` (patterns/row_wipe.py).

Gemma's keras-hub attention zeroes the output of every query row whose int
mask keeps no key, ``where(all(mask == 0, -1), 0, out)``, after keras' masked
``Softmax`` already zeroed the rows its ``mask > 0`` leaves empty.  The wipe
is proven redundant and joins the site, so a training step keeps no ``T x S``
mask next to the kernel; a wipe the scores' masks do not prove stays as
written, and the site is still rewritten.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from t_by_s import assert_no_t_by_s, optimized_step, t_by_s_shapes

import flashpass

# T above the 64-key block `RowKeep` reads its rows in (one block spans T x 64).
B, H, T, D = 2, 2, 72, 8


def _args(rng):
    q, k, v = (jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32) for _ in range(3))
    pad = np.ones((B, T), np.int32)
    pad[1, :13] = 0  # left padding: rows 0..12 of batch row 1 keep no key
    pad[0, 3], pad[0, 20], pad[1, 30] = -1, 2, -4  # int values a bool cast would not see
    pad[0, :3] = 0  # rows 0..2 of batch row 0 keep only a -1 (masked by ``> 0``)
    return q, k, v, jnp.asarray(pad)


def _mask(pad):
    """keras-hub's decoder mask: ``minimum(padding, int32(causal))``, [B, T, S]."""
    i = jnp.arange(T, dtype=jnp.float32)[:, None]
    j = jnp.arange(T, dtype=jnp.float32)[None, :]
    causal = jnp.broadcast_to((i >= j)[None], (B, T, T)).astype(jnp.int32)
    return jnp.minimum(pad[:, None, :], causal)


def _attention(q, k, v, mask, remask=True):
    """keras' masked ``Softmax`` (``where(mask > 0, s, -1e9)``, then the
    probabilities re-masked) and ``P·V`` to ``[B, T, H, D]``."""
    keep = mask[:, None] > 0
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    p = jax.nn.softmax(jnp.where(keep, s, -1e9), axis=-1)
    if remask:
        p = jnp.where(keep, p, 0.0)
    return jnp.einsum("bhts,bhsd->bthd", p, v)


# The report's location: P·V's line (the first to spell its einsum), not the wipe's.
_PV_LINE = next(n for n, line in enumerate(open(__file__), 1) if '"bhts,bhsd->bthd"' in line)


def _wiped(out, empty):
    return jnp.where(empty[..., None, None], jnp.zeros_like(out), out).reshape(B, T, H * D)


def gemma(q, k, v, pad):
    """Gemma: zero the rows whose mask is all zero, after merging heads."""
    mask = _mask(pad)
    return _wiped(_attention(q, k, v, mask), jnp.all(mask == 0, axis=-1))


def gemma_any(q, k, v, pad):
    """The same wipe spelled ``~any(mask != 0)``."""
    mask = _mask(pad)
    return _wiped(_attention(q, k, v, mask), ~jnp.any(mask != 0, axis=-1))


def full_rows_wiped(q, k, v, pad):
    """Near miss: zeroes the rows whose mask keeps *every* key."""
    mask = _mask(pad)
    return _wiped(_attention(q, k, v, mask), jnp.all(mask != 0, axis=-1))


def no_remask(q, k, v, pad):
    """Near miss: the softmax does not zero its empty rows (they average v),
    so the wipe changes them."""
    mask = _mask(pad)
    return _wiped(_attention(q, k, v, mask, remask=False), jnp.all(mask == 0, axis=-1))


def test_gemma_wipe_joins_the_site(rng):
    args = _args(rng)
    for fn in (gemma, gemma_any):
        report, rewritten, original = optimized_step(fn, args)
        assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)
        assert_no_t_by_s(rewritten, T, T, control=original)
        forward = flashpass.optimize(fn, kernel="blockwise")
        np.testing.assert_allclose(jax.jit(forward)(*args), fn(*args), atol=2e-6)
        location = forward.explain(*args).rewrites[0].location
        assert location.endswith(f":{_PV_LINE}"), f"{location}: not P·V's line"


def test_unproven_wipes_stay_as_written(rng):
    args = _args(rng)
    for fn in (full_rows_wiped, no_remask):
        report, rewritten, _ = optimized_step(fn, args)
        assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)
        assert t_by_s_shapes(rewritten, T, T), f"{fn.__name__}: its wipe was absorbed"
