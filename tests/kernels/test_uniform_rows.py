"""The empty rows' mean-of-v forward (kernels/uniform_rows.py).

A left-padded additive mask ``s + where(causal & keep, 0, fill)`` leaves its
first rows with no key; the original computes them as ``softmax(s * c +
fill)`` over every key.  Where every ``s * c + fill`` rounds to ``fill`` in
float32, that is the mean of v, and the kernel's second call is skipped in the
forward; otherwise it runs.  Both are checked against the original computed in
float32 (whose rounding decides which it is), forward and gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import bias_op, mask_op, normal, run_and_compare, spec_of

from flashpass.kernels import empty_rows, get_kernel, uniform_rows
from flashpass.kernels.reference import reference_attention
from flashpass.spec import Bias, Causal, EmptyRows, Scale, Softcap

T = 64
LEAD = 12  # example 0's first rows keep no key under causality


def _spec(scale: float, fill: float):
    mask, mask_extra = mask_op(0, (2, 1, 1, T), fill)
    ops = (Scale(scale), Causal(0, fill), mask, EmptyRows(2, fill, "float32"))
    return spec_of(b=2, h=2, t=T, ops=ops, extras=(mask_extra,))


def _keys():
    keep = np.ones((2, 1, 1, T), bool)
    keep[0, ..., :LEAD] = False
    return jnp.asarray(keep)


def _original_f32(spec, fill):
    """The program's own float32 computation: the additive mask as a dense bias."""
    bias, extra = bias_op(0, (2, 1, T, T))
    scale = spec.score_ops[0]
    dense = spec.with_ops((scale, bias), extras=(extra,))
    causal = np.tril(np.ones((T, T), bool))

    def original(q, k, v, keys):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        values = jnp.where(causal & keys, 0.0, jnp.float32(fill))
        out = reference_attention(dense, q, k, v, (values,), dtype=jnp.float32)
        return out.astype(jnp.float64)

    return original


class _Split:
    def __init__(self, kernel):
        self.kernel = kernel

    def apply(self, spec, q, k, v, extras=(), *, interpret=False):
        return empty_rows.apply(self.kernel, spec, q, k, v, extras, interpret=interpret)


@pytest.mark.parametrize(
    "scale, fill",
    [
        (0.001, -1e9),  # |s * c| < 1: every score rounds to the fill: the mean of v
        (2.0, float(np.finfo(np.float32).min)),  # the fill's spacing is ~1e31
        (100.0, -1e9),  # |s * c| up to ~1e3: the grid of 64 at 1e9 keeps some of it
    ],
)
def test_empty_rows_match_the_original_in_float32(scale, fill):
    spec = _spec(scale, fill)
    kernel = _Split(get_kernel("blockwise"))
    errors = run_and_compare(
        kernel, spec, (_keys(),), tol=2e-3, reference=_original_f32(spec, fill)
    )
    assert errors["out"] < 2e-3


def test_rows_that_do_not_round_to_the_fill_are_not_the_mean():
    """The control for the third case above: there the original's empty rows
    are far from the mean of v, so a mean taken past the bound would fail it."""
    spec = _spec(100.0, -1e9)
    q, k, v = (normal(shape, seed) for seed, shape in enumerate(spec_shapes(spec)))
    with jax.enable_x64(True):
        original = _original_f32(spec, -1e9)(q, k, v, _keys())
    mean = jnp.mean(v, axis=2)[0, :, None, :]
    gap = jnp.max(jnp.abs(original[0, :, :LEAD] - mean))
    assert gap > 0.1, gap


def spec_shapes(spec):
    return spec.q_shape, spec.k_shape, spec.v_shape


def _counting_call(value: float):
    def call(q_rows, k, v, extras):
        return jnp.full((*q_rows.shape[:3], v.shape[-1]), value, jnp.float32)

    return call


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_the_mean_is_taken_only_below_the_bound(layout):
    """Grouped heads (4 query heads over 2 kv heads), k and v in either
    layout: below the bound the result is the mean of v over the keys for each
    query head's kv head; above it, the kernel's call."""
    fill = -1e9
    spec = spec_of(b=2, h=4, hkv=2, t=8, s=32, ops=(Scale(1.0), Bias(0, (1, 1, 1, 1), "float32")))
    extras = (jnp.full((1, 1, 1, 1), fill, jnp.float32),)
    k = normal((2, 2, 32, 16), 1)
    v = normal((2, 2, 32, 16), 2)
    if layout == "bshd":
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    want = jnp.repeat(jnp.mean(normal((2, 2, 32, 16), 2), axis=2), 2, axis=1)
    for q_scale, expected in ((1e-3, "mean"), (1e3, "call")):
        q = normal((2, 4, 8, 16), 0) * q_scale
        out = jax.jit(
            lambda q, k, v, e: uniform_rows.rows_call(
                _counting_call(7.0), spec, fill, layout, q, k, v, e
            )
        )(q, k, v, extras)
        if expected == "mean":
            np.testing.assert_allclose(
                out, jnp.broadcast_to(want[:, :, None], out.shape), rtol=1e-6
            )
        else:
            np.testing.assert_array_equal(out, 7.0)


def test_the_gradient_is_the_kernels_even_where_the_forward_is_the_mean():
    """``d(s + fill) / ds = 1``: the scores' gradient reaches q and k although
    every score rounds to the fill; the mean's own derivative would give none."""
    fill = -1e9
    spec = spec_of(b=1, h=1, t=4, s=16, ops=(Scale(1e-3), Bias(0, (1, 1, 1, 1), "float32")))
    kernel = get_kernel("blockwise")
    extras = (jnp.full((1, 1, 1, 1), fill, jnp.float32),)

    def call(q, k, v, e):
        return kernel.apply(spec, q, k, v, e)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, extras)))

    q, k, v = normal((1, 1, 4, 16), 0), normal((1, 1, 16, 16), 1), normal((1, 1, 16, 16), 2)

    def fast(q, k, v, e):
        return uniform_rows.rows_call(call, spec, fill, "bhsd", q, k, v, e)

    got = jax.grad(lambda *a: loss(fast, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: loss(call, *a), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-9)
    assert float(jnp.max(jnp.abs(got[0]))) > 0.0


def test_factor_reads_only_scale_and_the_fill():
    fill = Bias(1, (1, 1, 1, 1), "float32")
    base = dict(b=1, h=1, t=4)
    assert uniform_rows.factor(spec_of(**base, ops=(Scale(0.5), fill, Scale(3.0))), 1) == 0.5
    assert uniform_rows.factor(spec_of(**base, ops=(fill,)), 1) == 1.0
    other = Bias(0, (1, 1, 1, 4), "float32")
    assert uniform_rows.factor(spec_of(**base, ops=(Scale(0.5), other, fill)), 1) is None
    assert uniform_rows.factor(spec_of(**base, ops=(Softcap(30.0), fill)), 1) is None
    assert uniform_rows.factor(spec_of(**base, ops=(Scale(0.5),)), 1) is None
    assert uniform_rows.factor(spec_of(**base, ops=(Causal(0, -1e9), fill)), 1) is None
