"""Dead uses of attention weights do not block a site (issue 41).

A layer that returns ``(output, weights)`` to a caller that drops the weights
(Keras' ``MultiHeadAttention._compute_attention``), or a body that computes
something from the weights and never uses it, leaves the weights with a use
that is dead code.  The pass removes dead code before matching, in every
context: directly, under ``jit``, in ``scan`` bodies (JAX's DCE prunes them)
and in ``while`` bodies (JAX's DCE keeps a loop whole: flashpass's own
`compat.dce_loop_bodies` cleans them).  A use that is live keeps the site,
with its reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import flashpass

B, H, T, D = 1, 2, 64, 16


@jax.jit
def layer(q, k, v):
    """Attention that also returns its weights (a nested ``jit``)."""
    p = jax.nn.softmax(jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5, axis=-1)
    return jnp.einsum("bhts,bhsd->bhtd", p, v), p


def dropped(q, k, v):
    return layer(q, k, v)[0]


def while_dead_reader(q, k, v):
    def body(carry):
        i, x = carry
        out, p = layer(x, k, v)
        _ = jnp.sum(p * 2.0)  # read, never used
        return i + 1, out

    return lax.while_loop(lambda c: c[0] < 2, body, (0, q))[1]


def fori_dropped(q, k, v):
    return lax.fori_loop(0, 2, lambda i, x: layer(x, k, v)[0], q)


def scan_dropped(q, k, v):
    def body(x, _):
        out, p = layer(x, k, v)
        return out, jnp.max(p)  # a per-step output the caller drops

    return lax.scan(body, q, None, length=2)[0]


def while_in_scan(q, k, v):
    def body(x, _):
        return lax.while_loop(
            lambda c: c[0] < 1, lambda c: (c[0] + 1, layer(c[1], k, v)[0]), (0, x)
        )[1], None

    return lax.scan(body, q, None, length=2)[0]


DEAD = [dropped, while_dead_reader, fori_dropped, scan_dropped, while_in_scan]


def _args():
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32) for _ in range(3))


@pytest.mark.parametrize("outer", ["direct", "jit"])
@pytest.mark.parametrize("fn", DEAD, ids=lambda f: f.__name__)
def test_dead_use_is_removed(fn, outer):
    program = jax.jit(fn) if outer == "jit" else fn
    opt = flashpass.optimize(program, kernel="blockwise")
    args = _args()
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, report
    assert not report.fallbacks and not report.errors, report
    np.testing.assert_allclose(opt(*args), fn(*args), rtol=2e-5, atol=2e-5)


def while_live_carry(q, k, v):
    """The weights are carried out of the loop and returned: live."""

    def body(carry):
        i, x, _ = carry
        out, p = layer(x, k, v)
        return i + 1, out, p

    p0 = jnp.zeros((B, H, T, T), q.dtype)
    _, out, p = lax.while_loop(lambda c: c[0] < 2, body, (0, q, p0))
    return out, p


def while_live_reader(q, k, v):
    """The weights feed the next iteration's input: live."""

    def body(carry):
        i, x = carry
        out, p = layer(x, k, v)
        return i + 1, out + jnp.sum(p, axis=-1, keepdims=True)

    return lax.while_loop(lambda c: c[0] < 2, body, (0, q))[1]


def scan_live_output(q, k, v):
    def body(x, _):
        out, p = layer(x, k, v)
        return out, jnp.max(p)

    return lax.scan(body, q, None, length=2)


LIVE = [
    (while_live_carry, "leave the `while` body"),
    (while_live_reader, "leave the `while` body"),
    (scan_live_output, "scan"),
]


@pytest.mark.parametrize("fn, words", LIVE, ids=lambda x: getattr(x, "__name__", ""))
def test_live_use_keeps_its_reason(fn, words):
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*_args())
    assert not report.rewrites, report
    assert not report.errors, report
    reasons = " ".join(f.reason for f in report.fallbacks)
    assert words in reasons, reasons
    np.testing.assert_allclose(
        jax.tree.leaves(opt(*_args()))[0], jax.tree.leaves(fn(*_args()))[0], rtol=1e-6
    )
