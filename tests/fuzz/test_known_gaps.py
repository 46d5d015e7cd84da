"""True attention that flashpass does not rewrite yet (coverage gaps), and the
spellings of gaps since closed (G1-G6), kept as positive tests.

Each open gap's test is the minimal spelling of one gap in
attention_programs.KNOWN_GAPS (the property generators steer around them) and
is a strict xfail: when a change closes a gap, its test fails here — remove the
xfail and the repair in `attention_programs.avoid_known_gaps`, so the properties
cover the spelling.  None of these is a wrong result: the site is kept as written.
"""

import attention_programs as ap
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import flashpass


def _gap(gap_id: str):
    """The strict xfail of an open gap (none is open on JAX 0.10+; G5 is JAX 0.9's)."""
    return pytest.mark.xfail(strict=True, reason=f"{gap_id}: {ap.KNOWN_GAPS[gap_id]}")


def _args(shape=(2, 2, 4, 4), dtype=jnp.float32, n=3):
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(n))


def _assert_rewritten(fn, *args):
    opt = flashpass.optimize(fn, kernel="reference")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, str(report)
    # A closed gap computes the original function, value and gradient.
    low = any(a.dtype == jnp.bfloat16 for a in args)
    tol = 3e-2 if low else 3e-5

    def loss(f):
        return lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)

    ap.assert_same(opt(*args), fn(*args), tol)
    # bfloat16 gradients are compared relative to their largest magnitude.
    for got, want in zip(jax.grad(loss(opt))(*args), jax.grad(loss(fn))(*args), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, atol=tol * max(1.0, np.abs(want).max()), rtol=tol)


def test_softmax_in_bfloat16_with_a_float32_sum():
    # jnp.sum of bfloat16 accumulates in float32 (exp -> convert ->
    # reduce_sum -> convert back); the sum is recognised through the casts.
    def fn(q, k, v):
        return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2), axis=-1) @ v

    def handwritten(q, k, v):
        s = q @ jnp.swapaxes(k, -1, -2)
        e = jnp.exp(s - s.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)) @ v

    args = _args(dtype=jnp.bfloat16)
    for f in (fn, handwritten):
        _assert_rewritten(f, *args)
        out = flashpass.optimize(f, kernel="reference")(*args)
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(f(*args), np.float32), rtol=2e-2, atol=2e-2
        )


def test_log_softmax_in_bfloat16():
    # The float32 sum is cast back to bfloat16 before the log.
    def fn(q, k, v):
        return jnp.exp(jax.nn.log_softmax(q @ jnp.swapaxes(k, -1, -2), axis=-1)) @ v

    _assert_rewritten(fn, *_args(dtype=jnp.bfloat16))


def test_weak_typed_inputs():
    # jnp.full(shape, 0.5) is weak-typed: jnp inserts weak->strong converts after exp
    def fn(q, k, v):
        e = jnp.exp(q @ jnp.swapaxes(k, -1, -2))
        return (e / e.sum(-1, keepdims=True)) @ v

    q, k, v = (jnp.full((2, 2, 4, 4), 0.5) for _ in range(3))
    assert q.weak_type
    _assert_rewritten(fn, q, k, v)


def test_reciprocal_normalisation_with_softmax_axis_not_last():
    def fn(q, k, v):
        s = jnp.einsum("bhtd,bhsd->bhst", q, k)  # keys on axis 2
        e = jnp.exp(s - s.max(axis=2, keepdims=True))
        p = e * (1.0 / e.sum(axis=2, keepdims=True))
        return jnp.einsum("bhst,bhsd->bhtd", p, v)

    _assert_rewritten(fn, *_args())


def test_deferred_normalisation_to_a_bthd_output():
    # The P·V result is transposed before the division.
    def fn(q, k, v):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k)
        e = jnp.exp(s - lax.stop_gradient(s.max(-1, keepdims=True)))
        out = jnp.einsum("bhts,bhsd->bthd", e, v)  # P·V result transposed to BTHD
        return out / jnp.swapaxes(e.sum(-1), 1, 2)[..., None]

    _assert_rewritten(fn, *_args())


def test_unstabilised_softmax_of_scores_minus_bias():
    # A shift that varies along the keys is a (negated) bias.
    def fn(q, k, v, bias):
        e = jnp.exp(q @ jnp.swapaxes(k, -1, -2) - bias)
        return (e / e.sum(-1, keepdims=True)) @ v

    q, k, v = _args()
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, 4, 4)), jnp.float32)
    _assert_rewritten(fn, q, k, v, bias)


@pytest.mark.parametrize("shape", [(1, 2, 4, 4), (2, 1, 4, 4), (1, 1, 4, 4)])
@pytest.mark.xfail(
    not ap.UNIT_AXIS_MATMUL, strict=True, reason=f"G5 on this JAX: {ap.KNOWN_GAPS['G5']}"
)
def test_matmul_with_a_unit_batch_or_head_axis(shape):
    # jnp.matmul squeezes the unit axes before each product and
    # broadcasts them back (patterns/regroup.py).
    def fn(q, k, v):
        return jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2), axis=-1) @ v

    _assert_rewritten(fn, *_args(shape=shape))


@pytest.mark.parametrize("shape", [(1, 2, 4, 4), (2, 1, 4, 4), (1, 1, 4, 4)])
@pytest.mark.parametrize("matmul_for", ["scores", "output"])
@pytest.mark.xfail(
    not ap.UNIT_AXIS_MATMUL, strict=True, reason=f"G5 on this JAX: {ap.KNOWN_GAPS['G5']}"
)
def test_unit_axis_squeezed_by_one_product_only(shape, matmul_for):
    # jnp.matmul squeezes the unit axis for one product only; the
    # other (an einsum) keeps it.  A unit axis P·V batches over that the scores
    # never had stays a size-1 axis of v and the output; a score role P·V never
    # gets back is a size-1 axis absent from them (patterns/regroup.py).
    if matmul_for == "scores":

        def fn(q, k, v):
            p = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2))
            return jnp.einsum("bhts,bhsd->bhtd", p, v)
    else:

        def fn(q, k, v):
            return jax.nn.softmax(jnp.einsum("bhtd,bhsd->bhts", q, k)) @ v

    _assert_rewritten(fn, *_args(shape=shape))
