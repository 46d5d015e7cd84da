"""Near misses of the issue-20 spellings: each must keep the site as written.

A re-mask of the probabilities is rewritten only when proven to keep exactly
what the scores' masks keep; a shift that depends on the scores is no bias.
"""

import jax
import jax.numpy as jnp
import numpy as np

import flashpass

import spellings


def _assert_not_rewritten(fn, args, reason_part):
    opt = flashpass.optimize(fn, kernel="reference")
    report = opt.explain(*args)
    assert not report.rewrites, str(report)
    assert reason_part in " | ".join(f.reason for f in report.fallbacks), str(report)
    np.testing.assert_allclose(np.asarray(opt(*args)), np.asarray(fn(*args)), rtol=1e-5, atol=1e-6)


def _scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3


def test_remask_by_one_factor_of_the_score_mask():
    # Scores masked by padding & causal, probabilities by the padding alone: a fully
    # masked row (left padding) would weigh keys the rewrite zeroes.
    def fn(q, k, v, mask):
        t = q.shape[1]
        pad = mask[:, None, None, :]
        m = jnp.logical_and(pad, jnp.tril(jnp.ones((t, t), bool)))
        p = jnp.where(pad, jax.nn.softmax(jnp.where(m, _scores(q, k), -1e9), -1), 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    args = spellings._padded_rows_args(np.random.default_rng(0))
    _assert_not_rewritten(fn, args, "did not mask the scores")


def test_remask_by_a_wider_mask():
    # The probabilities re-masked by padding & causal, the scores by the padding only.
    def fn(q, k, v, mask):
        t = q.shape[1]
        pad = mask[:, None, None, :]
        m = jnp.logical_and(pad, jnp.tril(jnp.ones((t, t), bool)))
        p = jnp.where(m, jax.nn.softmax(jnp.where(pad, _scores(q, k), -1e9), -1), 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    args = spellings._mask_args(np.random.default_rng(0))
    _assert_not_rewritten(fn, args, "did not mask the scores")


def test_remask_after_a_fill_that_does_not_exclude():
    # where(m, s, -1): masked keys keep a weight, which the re-mask then zeroes.
    def fn(q, k, v, mask):
        m = mask[:, None, None, :]
        p = jnp.where(m, jax.nn.softmax(jnp.where(m, _scores(q, k), -1.0), -1), 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    args = spellings._mask_args(np.random.default_rng(0))
    _assert_not_rewritten(fn, args, "non-excluding")


def test_probabilities_cast_to_int_are_not_a_layout_op():
    def fn(q, k, v):
        p = jax.nn.softmax(q @ k.swapaxes(-1, -2), -1)
        return (p * 100).astype(jnp.int32).astype(jnp.float32) @ v

    _assert_not_rewritten(fn, spellings.bnth(np.random.default_rng(0)), "")


def test_a_softmax_that_top_k_selects_from_is_no_site():
    # A mixture-of-experts router: softmax over experts of x·W, then top_k.
    # No P·V: not rewritten, and not reported as a kept attention site.
    def router(x, w):
        probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, w), axis=-1)
        weights, experts = jax.lax.top_k(probs, 2)
        return weights, experts

    rng = np.random.default_rng(0)
    args = (
        jnp.asarray(rng.standard_normal((2, 64, 16)), jnp.float32),
        jnp.asarray(rng.standard_normal((16, 64)), jnp.float32),
    )
    opt = flashpass.optimize(router, kernel="reference")
    report = opt.explain(*args)
    assert not report.rewrites and not report.fallbacks, str(report)
    got, want = opt(*args), router(*args)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)


def test_a_softmax_over_top_k_selected_logits_is_no_site():
    # gpt-oss' gate: top_k of the router logits, then a softmax over the k
    # chosen; its weights mix the chosen experts.  Not rewritten, not a kept
    # attention site.  The same selection as big as a score matrix (top-k
    # attention: 32 of 64 keys per query) is not left silent: it is reported
    # as softmax-like.
    def gate(x, w, experts):
        logits, chosen = jax.lax.top_k(jnp.einsum("btd,de->bte", x, w), w.shape[1] // 2)
        weights = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("btk,btkd->btd", weights, experts[:, :, : logits.shape[-1]]), chosen

    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    for n, silent in ((4, True), (64, False)):
        args = (normal(2, 64, 16), normal(16, n), normal(2, 64, n // 2, 8))
        opt = flashpass.optimize(gate, kernel="reference")
        report = opt.explain(*args)
        assert not report.rewrites and not report.fallbacks, str(report)
        assert (not report.unrecognised) == silent, str(report)
        assert "selected from the scores" in str(report) or silent, str(report)
        got, want = opt(*args), gate(*args)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)


def test_attention_weights_also_read_by_top_k_keep_the_site():
    # Token selection by attention weight (EViT-style): P feeds P·V and top_k;
    # the weights escape, so the site is kept, and the report says so.
    def fn(q, k, v):
        p = jax.nn.softmax(_scores(q, k), -1)
        _, keep = jax.lax.top_k(p[:, :, 0, :].mean(1), 4)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), keep

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 64, 2, 8)), jnp.float32) for _ in range(3))
    opt = flashpass.optimize(fn, kernel="reference")
    report = opt.explain(q, k, v)
    assert not report.rewrites and report.fallbacks, str(report)
    got, want = opt(q, k, v), fn(q, k, v)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))
