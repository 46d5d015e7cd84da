"""No silent misses: a softmax-like ``exp`` the matcher does not take as
attention is reported, with the equation that broke the chain
(patterns/softmax_like.py); what is not attention stays out of the report."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from no_silent import assert_no_silent_miss

import flashpass
import flashpass.export as fx
from flashpass.patterns import softmax_like

import spellings

T = 32  # two axes of T >= softmax_like.MIN_LEN


def _qkv(rng, t=T):
    return tuple(jnp.asarray(rng.standard_normal((2, 3, t, 8)), jnp.float32) for _ in range(3))


def unnormalised(q, k, v):
    return jnp.exp(q @ k.swapaxes(-1, -2) * 0.1) @ v


def eps_normalised(q, k, v):
    e = jnp.exp(q @ k.swapaxes(-1, -2) * 0.1)
    return (e / (e.sum(-1, keepdims=True) + 1e-6)) @ v


def masked(q, k, v):
    mask = jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), bool))
    return jnp.where(mask, jnp.exp(q @ k.swapaxes(-1, -2) * 0.1), 0.0) @ v


def masked_before_and_after(q, k, v):
    # the same boolean mask on the scores and on the weights: a mask, no
    # function of the scores' values (the predicate is no own value)
    mask = jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), bool))
    s = jnp.where(mask, q @ k.swapaxes(-1, -2) * 0.1, -1e9)
    return jnp.where(mask, jnp.exp(s), 0.0) @ v


def float_mask_before_and_after(q, k, v):
    # an additive bias and a multiplicative mask from one float cast of a
    # boolean of the scores' shape: an indicator, no function of the scores
    causal = jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), bool))
    keep = jnp.broadcast_to(causal, (*q.shape[:-1], k.shape[-2])).astype(q.dtype)
    s = q @ k.swapaxes(-1, -2) * 0.1 + (1.0 - keep) * -1e9
    return (jnp.exp(s) * keep) @ v


def padding_before_and_after(q, k, v):
    # a float key padding mask (from the keys' values) broadcast over the
    # queries, as a bias and as a factor: shared along an axis, no element's own
    keep = jnp.broadcast_to(jnp.abs(jnp.sign(k[..., None, :, 0])), (*q.shape[:-1], k.shape[-2]))
    s = q @ k.swapaxes(-1, -2) * 0.1 + (1.0 - keep) * -1e9
    return (jnp.exp(s) * keep) @ v


def dropout(q, k, v):
    s = q @ k.swapaxes(-1, -2) * 0.1
    keep = jax.random.bernoulli(jax.random.key(0), 0.9, s.shape)
    return (jnp.exp(s) * keep / 0.9) @ v


def guarded(q, k, v):
    # the weights selected by a comparison of the scores themselves
    s = q @ k.swapaxes(-1, -2) * 0.1
    return jnp.where(s > -1e30, jnp.exp(s), 0.0) @ v


def _first_call(fn, *args):
    """The report of the first call under ``jax.jit``, and the Optimized."""
    opt = flashpass.optimize(fn, kernel="blockwise")
    out = jax.jit(opt)(*args)
    np.testing.assert_allclose(out, jax.jit(fn)(*args), rtol=1e-6)
    assert opt.rewritten_jaxpr(*args) is opt.original_jaxpr(*args)  # kept as written
    return opt.reports[-1], opt


@pytest.mark.parametrize(
    "fn, broke, why",
    [
        (unnormalised, "exp", "exp is not normalised by a sum"),
        (eps_normalised, "reduce_sum", "not divided by that sum"),
    ],
)
def test_softmax_like_is_reported_with_the_break(fn, broke, why, rng):
    args = _qkv(rng)
    report, opt = _first_call(fn, *args)
    assert not report.rewrites and not report.fallbacks, str(report)
    (u,) = report.unrecognised
    assert u.broke == broke and why in u.reason, str(report)
    assert "test_softmax_like.py" in (u.location or "") and u.scope == "top level"
    assert "`exp` of [2, 3, 32, 32]" in u.reason and "reaches a `dot_general`" in u.reason
    text = str(report)
    assert "1 softmax-like not recognised as attention" in text.splitlines()[0]
    assert "softmax-like computations not recognised as attention" in text
    assert report.to_dict()["unrecognised"][0]["broke"] == broke
    assert_no_silent_miss(opt, report, *args)


@pytest.mark.parametrize(
    "fn",
    [
        masked,
        masked_before_and_after,
        float_mask_before_and_after,
        padding_before_and_after,
        dropout,
        guarded,
    ],
)
def test_masked_and_dropped_weights_are_still_softmax_like(fn, rng):
    # Negative controls of the activation rule: masks, keep-masks and a guard
    # on the scores scale exp(s) by no other function of s's own values.
    args = _qkv(rng)
    report, opt = _first_call(fn, *args)
    (u,) = report.unrecognised
    assert u.broke == "exp" and "exp is not normalised by a sum" in u.reason, str(report)
    assert_no_silent_miss(opt, report, *args)


def test_softmax_like_inside_a_scan_body(rng):
    q, k, v = _qkv(rng)

    def fn(q, k, v):
        def body(x, _):
            return unnormalised(x, k, v), None

        return jax.lax.scan(body, q, None, length=2)[0]

    report, _ = _first_call(fn, q, k, v)
    (u,) = report.unrecognised
    assert "scan" in u.scope, str(report)


def test_the_check_sees_a_silent_miss(rng, monkeypatch):
    # Positive control of tests/no_silent.py: with the detector off, the exp
    # left in the program has no report entry and the check fails.
    monkeypatch.setattr("flashpass.patterns.match.softmax_like", lambda *a: None)
    args = _qkv(rng)
    opt = flashpass.optimize(unnormalised, kernel="blockwise")
    report = opt.explain(*args)
    assert not report.unrecognised and not report.fallbacks
    with pytest.raises(AssertionError, match="softmax-like exps left"):
        assert_no_silent_miss(opt, report, *args)


def test_rewritten_attention_is_not_softmax_like_noise(rng):
    fn, make = spellings.POSITIVE["deferred_regrouped"]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.unrecognised, str(report)
    assert_no_silent_miss(opt, report, *args)


# ------------------------------------------------------------------ not attention


def _silent(fn, *args):
    report = flashpass.optimize(fn, kernel="blockwise").explain(*args)
    assert not report.rewrites and not report.unrecognised, str(report)
    return report


def test_short_exp_is_not_softmax_like(rng):
    # below the threshold on one axis: a softmax over 8 keys is no score matrix
    q, k, v = _qkv(rng, t=softmax_like.MIN_LEN // 2)
    _silent(unnormalised, q, k, v)


def test_softmax_over_classes_without_a_product(rng):
    x = jnp.asarray(rng.standard_normal((2, T, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    # an expected class index: the probabilities are weighted and summed (the
    # matcher may still list it as a near miss; it is no softmax-like exp)
    _silent(lambda x, w: jnp.sum(jax.nn.softmax(x @ w) * jnp.arange(64), -1), x, w)


def test_cross_entropy_training_step(rng):
    # logsumexp's exp over a big vocabulary: summed into the loss, and in the
    # gradient the one-hot targets are added before the product.
    x = jnp.asarray(rng.standard_normal((2, T, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 64, (2, T)))

    def step(w, x, labels):
        def loss(w):
            logp = jax.nn.log_softmax(x @ w)
            return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))

        return jax.value_and_grad(loss)(w)

    report = _silent(step, w, x, labels)
    assert not report.fallbacks, str(report)


def test_exp_of_a_big_array_summed_away(rng):
    # exp(x) of a T x S array reduced before any product: not softmax-like
    x = jnp.asarray(rng.standard_normal((2, T, T)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((T, 4)), jnp.float32)
    _silent(lambda x, w: jnp.log(jnp.exp(x).sum(-1)) @ w[:, 0], x, w)


# An exp combined elementwise with another function of its own input on its
# way to the product is an activation (patterns/softmax_like.py).


def _mlp_args(rng):
    x = jnp.asarray(rng.standard_normal((2, T, 16)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    return x, w1, w2


def erf_expansion(h):
    # the shape of CHLO's erf: exp(-h*h) times a rational function of h, selected
    e = jnp.exp(-h * h) * ((0.3 * h + 1.1) / (jnp.abs(h) + 2.0))
    return jnp.where(jnp.abs(h) < 1.0, 1.0 - h * (1.1 + 0.1 * h * h), e)


def silu_divided(h):
    return h / (1.0 + jnp.exp(-h))


def silu_ratio(h):
    return h * jnp.exp(h) / (1.0 + jnp.exp(h))


def silu_shared_exp(h):
    e = jnp.exp(h)
    return h * (e / (1.0 + e))


@pytest.mark.parametrize("act", [erf_expansion, silu_divided, silu_ratio, silu_shared_exp])
def test_activation_written_with_exp_is_not_softmax_like(act, rng):
    x, w1, w2 = _mlp_args(rng)
    report = _silent(lambda x, w1, w2: act(x @ w1) @ w2, x, w1, w2)
    assert not report.fallbacks, str(report)


def test_exact_gelu_in_an_exported_artifact_is_not_softmax_like(rng):
    # jax.export lowers erf through CHLO into exp(-x*x) times polynomials in x;
    # the lifted module shows it as such (it used to read as attention).
    x, w1, w2 = _mlp_args(rng)

    def mlp(x, w1, w2):
        return jax.nn.gelu(x @ w1, approximate=False) @ w2

    exp = fx.load(jax.export.export(jax.jit(mlp))(x, w1, w2).serialize())
    assert "stablehlo.exponential" in exp.mlir_module()  # the expansion is there
    report = fx.explain(exp, kernel="blockwise")
    assert report.route == "lift" and not report.unrecognised, str(report)
    # the same artifact route still reports an unnormalised exp(q·kᵀ)·v
    attn = fx.load(jax.export.export(jax.jit(unnormalised))(*_qkv(rng)).serialize())
    (u,) = fx.explain(attn, kernel="blockwise").unrecognised
    assert "exp is not normalised by a sum" in u.reason
