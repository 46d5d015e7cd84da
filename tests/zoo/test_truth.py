"""The zoo's float64 interpreter (benchmarks/zoo/truth.py) on small programs:
each result equals the same program written in float64, from float32 inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.zoo import truth
from flashpass.compat import x64_scope


def _check(fn, *args, ref=None):
    """``fn`` traced in float32 and run by `truth.evaluate` equals ``ref``
    (``fn`` unless given) run under x64 on the float64 inputs, to 1e-12.
    Constants are exact in binary: a literal is baked at its float32 value."""
    args32 = [
        np.asarray(a, np.float32)
        if np.issubdtype(np.asarray(a).dtype, np.floating)
        else np.asarray(a)
        for a in args
    ]
    closed = jax.make_jaxpr(fn)(*args32)
    got = truth.evaluate(closed, *args32)
    with x64_scope():
        want = jax.tree_util.tree_leaves(
            (ref or fn)(
                *[
                    jnp.asarray(a, np.float64) if a.dtype == np.float32 else jnp.asarray(a)
                    for a in args32
                ]
            )
        )
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w)
        if np.issubdtype(w.dtype, np.floating):
            assert g.dtype == np.float64
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
        else:
            # (integers keep their traced width; the x64 reference widens them)
            assert np.array_equal(g, w)
    return got


def _x(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape)


def test_matmul_softmax_and_its_gradient():
    def f(q, k):
        s = jnp.einsum("td,sd->ts", q, k) / 4.0
        return jax.nn.softmax(s, axis=-1)  # a custom_jvp inside

    _check(f, _x(8, 4), _x(6, 4, seed=1))
    _check(jax.grad(lambda q, k: jnp.sum(f(q, k) ** 2)), _x(8, 4), _x(6, 4, seed=1))


def test_dtype_params_are_retyped():
    def f(x, dtype=jnp.float32):
        # bfloat16 rounds in float32, not in the truth (every float is float64)
        y = x.astype(jnp.bfloat16 if dtype == jnp.float32 else dtype).astype(dtype)
        i = jax.lax.iota(dtype, 5)
        d = jax.lax.dot_general(x, x, (((0,), (0,)), ((), ())), preferred_element_type=dtype)
        return jnp.sin(y), i, d, jnp.argmax(x)

    _check(f, _x(5), ref=lambda x: f(x, jnp.float64))


def test_scan():
    def f(x, xs):
        def body(c, v):
            c = jnp.tanh(c * v + 0.125)
            return c, c * 2

        return jax.lax.scan(body, x, xs)

    _check(f, _x(3), _x(7, 3, seed=1))


def test_while_loop():
    def f(x):
        return jax.lax.while_loop(
            lambda c: c[0] < 10, lambda c: (c[0] + 1, jnp.sin(c[1]) * 1.25), (0, x)
        )

    _check(f, _x(4))


def test_custom_vjp():
    @jax.custom_vjp
    def g(x):
        return jnp.exp(x) / 8.0

    g.defvjp(lambda x: (g(x), x), lambda x, ct: (ct * jnp.exp(x) / 8.0,))
    _check(lambda x: g(x) + 1, _x(5))
    _check(jax.grad(lambda x: jnp.sum(g(x) ** 2)), _x(5))


def test_scatter_add_and_its_combiner():
    _check(lambda x, i: x.at[i].add(x[::-1] * 0.5), _x(4), np.array([1, 1, 3, 0]))


def test_cond():
    def f(p, x):
        return jax.lax.cond(p > 0, lambda v: jnp.log1p(v * v), lambda v: v / 4.0, x)

    _check(f, np.float32(1.0), _x(4))
    _check(f, np.float32(-1.0), _x(4))


def test_pjit_nest_and_remat():
    @jax.jit
    def inner(x):
        return jnp.cos(x) @ x.T

    @jax.jit
    def outer(x):
        return jax.checkpoint(lambda y: inner(y) * 0.5)(x)

    _check(outer, _x(3, 3))
    _check(jax.grad(lambda x: jnp.sum(outer(x))), _x(3, 3))


def test_random_bits_keep_their_meaning():
    # The float32 program's random draws (32 bits each), computed on in float64.
    def f(x, dtype=jnp.float32):
        u = jax.random.uniform(jax.random.key(0), x.shape, jnp.float32)
        return x + u.astype(dtype)

    _check(f, _x(4), ref=lambda x: f(x, jnp.float64))
    closed = jax.make_jaxpr(lambda: jax.random.normal(jax.random.key(1), (16,)))()
    (got,) = truth.evaluate(closed)
    want = jax.random.normal(jax.random.key(1), (16,))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_float32_is_truly_less_accurate():
    # A float32 cancellation the float64 evaluation does not make.
    closed = jax.make_jaxpr(lambda x: (x + 1e8) - 1e8)(np.float32(0.25))
    (got,) = truth.evaluate(closed, np.float32(0.25))
    assert got == 0.25 and got.dtype == np.float64


def test_unknown_higher_order_primitive_is_reported():
    with pytest.raises(truth.Unsupported):
        truth._apply(
            type(
                "E",
                (),
                {
                    "primitive": jax.lax.sin_p,
                    "params": {"jaxpr": jax.make_jaxpr(jnp.sin)(1.0)},
                    "invars": [],
                },
            )(),
            [],
        )


def test_verdict_judges_against_the_truth_only_where_recorded():
    from benchmarks.zoo import harness

    base = {
        "status": "fail",
        "mode": "train",
        "kept": [],
        "sites": 1,
        "silent": 0,
        "internal_errors": [],
        "fwd_err": 1e-7,
        "grad_err": 3.3e-3,
    }
    assert harness.account(base)["problems"] == ["gradient numerics"]  # old record
    within = harness.account(base | {"grad_err_truth": 4e-6, "orig_grad_err_truth": 3.5e-2})
    assert (
        within["status"] == "ok" and "4.0e-06 from the float64 truth" in within["numerics_notes"][0]
    )
    no_worse = harness.account(base | {"grad_err_truth": 2e-2, "orig_grad_err_truth": 3.5e-2})
    assert no_worse["status"] == "ok" and "no worse" in no_worse["numerics_notes"][0]
    worse = harness.account(base | {"grad_err_truth": 5e-2, "orig_grad_err_truth": 3.5e-2})
    assert worse["problems"] == ["gradient numerics"] and "numerics_notes" not in worse
    both_inf = harness.account(
        base | {"grad_err_truth": float("inf"), "orig_grad_err_truth": float("inf")}
    )
    assert both_inf["status"] == "fail"
