"""A learned bias shared by two layers, in a training step (keras-hub's T5:
the first layer of a stack builds its relative position bias and every later
layer adds the same array to its scores).

The second layer reads the bias, and also q, k and v, which the first layer's
output makes from that bias: the equations from the bias to the second site
pass through the whole first layer.  They are no part of the second site's
forward (the kernel reads q and the bias as independent operands; autodiff
sums the bias' cotangents of both layers outside the sites), so both sites
are rewritten forward and backward.  Near misses: the second layer's
weights read in the loss keep that site (the first is still rewritten); a
bias broadcast once for both layers keeps both (the broadcast is each site's
forward, and autodiff sums the layers' cotangents before its transpose).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from t_by_s import assert_no_t_by_s, jaxpr_shapes

import flashpass

B, H, T, D = 2, 2, 256, 8


def _attention(x, w, bias):
    q, k, v = (jnp.einsum("btd,hde->bhte", x, w[i]) for i in range(3))
    s = jnp.einsum("bhte,bhse->bhts", q, k) + bias
    p = jax.nn.softmax(s, axis=-1)
    return x + jnp.einsum("bhts,bhse->bhte", p, v).sum(1), p


def _two_layers(params, x, read_weights=False):
    bias = params["bias"]
    if bias.ndim == 2:  # [H, S], broadcast once: each site's glue, shared
        bias = bias[None, :, None, :]
    x, _ = _attention(x, params["w0"], bias)
    x, p = _attention(x, params["w1"], bias)  # the same bias, after layer 0
    loss = jnp.mean(x**2)
    return loss + (jnp.mean(p * jnp.log(p + 1e-6)) if read_weights else 0.0)


def _args(rng, bias=(1, H, 1, T)):
    params = {
        "w0": jnp.asarray(rng.standard_normal((3, H, D, D)) / np.sqrt(D), jnp.float32),
        "w1": jnp.asarray(rng.standard_normal((3, H, D, D)) / np.sqrt(D), jnp.float32),
        "bias": jnp.asarray(rng.standard_normal(bias), jnp.float32),
    }
    return params, jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)


def _step(read_weights):
    return jax.value_and_grad(lambda p, x: _two_layers(p, x, read_weights))


def _run(step, args):
    opt = flashpass.optimize(step, kernel="blockwise")
    value, grads = jax.jit(opt)(*args)  # the first call, under jit
    want_value, want = step(*args)
    np.testing.assert_allclose(value, want_value, rtol=2e-5)
    for name in want:
        np.testing.assert_allclose(grads[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
    return opt, opt.reports[-1]


# [1, H, 1, S]: learned per head and key.  [1, H, T, S]: learned per head and
# position, as T5's relative bias (the bias and its gradient are the
# program's own T x S arrays, H of them: the probabilities are B * H).
@pytest.mark.parametrize("shape", [(1, H, 1, T), (1, H, T, T)], ids=["keys", "dense"])
def test_a_bias_shared_by_two_layers_is_rewritten_forward_and_backward(shape, rng):
    args = _args(rng, shape)
    step = _step(read_weights=False)
    opt, report = _run(step, args)
    assert [r.passes for r in report.rewrites] == ["forward+backward"] * 2, str(report)
    assert not report.fallbacks, str(report)
    rewritten = jaxpr_shapes(opt.rewritten_jaxpr(*args), outside_kernels=True)
    control = jaxpr_shapes(jax.make_jaxpr(step)(*args))
    assert_no_t_by_s(rewritten, T, T, copies=B * H, control=control)


def test_the_second_layers_weights_read_in_the_loss_keep_that_site(rng):
    _, report = _run(_step(read_weights=True), _args(rng))
    assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)
    assert len(report.fallbacks) == 1, str(report)
    assert "also used by" in report.fallbacks[0].reason, str(report)


def test_a_bias_broadcast_once_for_both_layers_stays_as_written(rng):
    # The broadcast joins each site's forward (the kernel reads [H, S]); autodiff
    # sums the layers' cotangents before its transpose, so neither site's own
    # vjp is in the program: both kept, still exact.
    _, report = _run(_step(read_weights=False), _args(rng, (H, T)))
    assert not report.rewrites and len(report.fallbacks) == 2, str(report)
