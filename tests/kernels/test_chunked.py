"""The ``chunked`` kernel: plain JAX, differentiated in both modes, never T x S.

Its numerics on every case are the conformance suite's
(tests/kernels/test_conformance.py); here: what only it offers, forward-mode
differentiation (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) of an
optimized function, each first called under ``jax.jit``, in chunk-sized memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import spec_of
from t_by_s import assert_no_t_by_s, jaxpr_shapes

import flashpass
from flashpass.kernels import CheckContext, get_kernel
from flashpass.kernels.chunked import ChunkedKernel
from flashpass.spec import Dropout

B, H, T, D = 1, 2, 512, 16


def _attention(q, k, v, lengths):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) / 4.0
    causal = jnp.tril(jnp.ones((T, T), bool))
    keep = causal & (jnp.arange(T) < lengths[:, None, None, None])
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(jnp.where(keep, s, -1e9), -1), v)


def _inputs():
    q, k, v = (jax.random.normal(jax.random.key(i), (B, H, T, D)) for i in range(3))
    return q, k, v, jnp.array([T - 37], jnp.int32)


def _optimized():
    opt = flashpass.optimize(_attention, kernel=ChunkedKernel(chunk=96))  # a 32-row tail
    report = flashpass.explain(opt, *_inputs())
    assert [r.kernel for r in report.rewrites] == ["chunked"], report
    return opt


def test_forward_mode_matches_the_original_in_chunk_sized_memory():
    q, k, v, lengths = _inputs()
    opt = _optimized()

    def jvp(fn):
        return jax.jit(lambda *p: jax.jvp(lambda *a: fn(*a, lengths), p, (q, -k, 2 * v)))

    (out, tangent), (want, want_tangent) = jvp(opt)(q, k, v), jvp(_attention)(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tangent, want_tangent, rtol=1e-4, atol=1e-5)

    # jax.jacfwd (vmapped jvp) and jax.linearize, first called under jax.jit.
    def scaled(fn):
        return lambda a: fn(a * q, k, v, lengths).sum(axis=(0, 1, 3))  # [T]

    jac, want_jac = (jax.jit(jax.jacfwd(scaled(f)))(0.5) for f in (opt, _attention))
    np.testing.assert_allclose(jac, want_jac, rtol=1e-4, atol=1e-4)
    lin = jax.jit(lambda x, t: jax.linearize(lambda y: opt(y, k, v, lengths), x)[1](t))
    want_lin = jax.jvp(lambda y: _attention(y, k, v, lengths), (q,), (k,))[1]
    np.testing.assert_allclose(lin(q, k), want_lin, rtol=1e-4, atol=1e-5)

    # Inside the kernel too: chunk x S scores, never T x S (the original's control).
    rewritten = jaxpr_shapes(jax.make_jaxpr(jvp(opt))(q, k, v))
    original = jaxpr_shapes(jax.make_jaxpr(jvp(_attention))(q, k, v))
    assert_no_t_by_s(rewritten, T, T, control=original)


def test_reverse_mode_keeps_chunk_sized_residuals():
    q, k, v, lengths = _inputs()
    opt = _optimized()

    def step(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a, lengths) ** 2), argnums=(0, 1, 2)))

    for g, w in zip(step(opt)(q, k, v), step(_attention)(q, k, v), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    rewritten = jaxpr_shapes(jax.make_jaxpr(step(opt))(q, k, v))
    original = jaxpr_shapes(jax.make_jaxpr(step(_attention))(q, k, v))
    assert_no_t_by_s(rewritten, T, T, control=original)


def test_chunked_is_named_never_defaulted_and_declines_dropout():
    assert get_kernel("chunked").chunk == 256
    assert all("chunked" not in flashpass.kernels.default_order(p) for p in ("cpu", "gpu", "tpu"))
    with pytest.raises(ValueError, match="positive"):
        ChunkedKernel(chunk=0)
    drop = Dropout(0, (1, 1, 1, 2), (2, 2, 16, 16), (), 32, "float32", 0.9)
    spec = spec_of(ops=[drop], extras=[((1, 1, 1, 2), np.uint32)])
    (reason,) = get_kernel("chunked").check(spec, CheckContext("cpu"))
    assert "dropout" in reason and "blockwise" in reason, reason


def test_forward_mode_through_a_custom_vjp_kernel_says_what_to_do():
    q, k, v, lengths = _inputs()
    opt = flashpass.optimize(_attention, kernel="blockwise")
    with pytest.raises(TypeError, match="forward-mode") as info:
        jax.jvp(lambda x: opt(x, k, v, lengths), (q,), (k,))
    assert any("kernel='chunked'" in note for note in info.value.__notes__), info.value
