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


# ------------------------------------------- a softmax over a projection, learned queries
#
# CoaT's factorised attention (timm's FactorAttnConvRelPosEnc) normalises the
# key slice of its own ``qkv = x·W`` over the tokens and weighs the value
# slice of the same product with it: no queries·keys score matrix exists, so
# it is no attention site (patterns/softmax_like.py `normalised_projection`).
# Learned-query attention (a parameter as the query) keeps its score matrix
# and is one, even where its keys and values are slices of one product.

HEADS, WIDTH = 4, 128  # 32 channels a head: an exp of tokens x channels is "big"


def factorised(x, w, b):
    batch, n, c = x.shape
    qkv = (x @ w.T + b).reshape(batch, n, 3, HEADS, c // HEADS).transpose(2, 0, 3, 1, 4)
    q, k, v = (jnp.squeeze(t, 0) for t in jnp.split(qkv, 3, axis=0))  # torch's unbind
    context = jax.nn.softmax(k, axis=2).swapaxes(-1, -2) @ v  # [B, h, Ch, Ch]
    return (q @ context).swapaxes(1, 2).reshape(batch, n, c)


def _factorised_args(rng):
    x = jnp.asarray(rng.standard_normal((2, T + 8, WIDTH)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3 * WIDTH, WIDTH)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.standard_normal((3 * WIDTH,)), jnp.float32)
    return x, w, b


def latent_query(latent, x, wq, wkv):
    """timm's AttentionPoolLatent: a learned latent broadcast to the batch and
    projected is the query; keys and values are the two slices of one ``x·W``."""
    batch, n, c = x.shape
    d = c // HEADS
    q = (jnp.broadcast_to(latent, (batch, *latent.shape)) @ wq).reshape(batch, -1, HEADS, d)
    kv = (x @ wkv).reshape(batch, n, 2, HEADS, d).transpose(2, 0, 3, 1, 4)
    k, v = (jnp.squeeze(t, 0) for t in jnp.split(kv, 2, axis=0))
    s = q.transpose(0, 2, 1, 3) @ k.swapaxes(-1, -2) * d**-0.5
    return jax.nn.softmax(s, axis=-1) @ v


def raw_latent_query(latent, x, wk, wv):
    """A learned query used as is (broadcast to the batch, not projected)."""
    q = jnp.broadcast_to(latent, (x.shape[0], *latent.shape))
    s = q @ (x @ wk).swapaxes(-1, -2) * latent.shape[-1] ** -0.5
    return jax.nn.softmax(s, axis=-1) @ (x @ wv)


def _latent_args(rng, t=T):
    latent = jnp.asarray(rng.standard_normal((t, WIDTH)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, T + 8, WIDTH)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((WIDTH, 2 * WIDTH)) * 0.1, jnp.float32)
    return latent, x, w1, w2


def test_softmax_over_a_projection_giving_its_values_is_no_site(rng):
    from no_silent import softmax_like_exps

    args = _factorised_args(rng)
    assert not softmax_like_exps(jax.make_jaxpr(factorised)(*args))
    report = _silent(factorised, *args)
    assert not report.fallbacks, str(report)

    # the same program as a training step: the backward holds no site either
    def step(w, x, b):
        return jax.value_and_grad(lambda w: jnp.sum(factorised(x, w, b) ** 2))(w)

    assert not softmax_like_exps(jax.make_jaxpr(step)(args[1], args[0], args[2]))
    report = _silent(step, args[1], args[0], args[2])
    assert not report.fallbacks, str(report)


def test_softmax_over_a_projection_in_an_exported_artifact(rng):
    # the lifted module slices the product (`slice`, not `split`)
    args = _factorised_args(rng)
    exp = fx.load(jax.export.export(jax.jit(factorised))(*args).serialize())
    report = fx.explain(exp, kernel="blockwise")
    assert not report.unrecognised and not report.fallbacks and not report.rewrites, str(report)


def test_the_projection_rule_reads_the_values_source(rng):
    # the same softmax weighing values from another product is softmax-like:
    # reported (its chain breaks at the slice), not silent
    x, w, b = _factorised_args(rng)
    wv = jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) * 0.1, jnp.float32)

    def other_values(x, w, b, wv):
        batch, n, c = x.shape
        k = (x @ w.T + b)[..., c : 2 * c].reshape(batch, n, HEADS, c // HEADS)
        v = (x @ wv).reshape(batch, n, HEADS, c // HEADS)
        return jnp.einsum("bnhc,bnhd->bhcd", jax.nn.softmax(k, axis=1), v)

    report = flashpass.optimize(other_values, kernel="blockwise").explain(x, w, b, wv)
    assert report.unrecognised or report.fallbacks, str(report)


@pytest.mark.parametrize("fn", [latent_query, raw_latent_query])
def test_learned_query_attention_is_a_site(fn, rng):
    from no_silent import softmax_like_exps

    latent, x, w1, w2 = _latent_args(rng)
    args = (latent, x, w1, w2) if fn is latent_query else (latent, x, w1, w2[:, :WIDTH])
    assert len(softmax_like_exps(jax.make_jaxpr(fn)(*args))) == 1
    opt = flashpass.optimize(fn, kernel="blockwise")
    out = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    np.testing.assert_allclose(out, fn(*args), rtol=1e-5, atol=1e-5)
    assert_no_silent_miss(opt, report, *args)
