"""Near misses: what must NOT be rewritten, and the reasons given."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass

import spellings


def _report(fn, *args):
    return flashpass.optimize(fn, kernel="reference").explain(*args)


def _assert_not_rewritten(fn, args, reason_part=None):
    opt = flashpass.optimize(fn, kernel="reference")
    report = opt.explain(*args)
    assert not report.rewrites, str(report)
    if reason_part is not None:
        reasons = " | ".join(f.reason for f in report.fallbacks)
        assert reason_part in reasons, str(report)
    # and the function is untouched: same outputs
    np.testing.assert_allclose(np.asarray(opt(*args)), np.asarray(fn(*args)), rtol=1e-5, atol=1e-6)
    return report


def test_softmax_over_query_axis(rng):
    def fn(q, k, v):
        s = q @ k.swapaxes(-1, -2)
        return jax.nn.softmax(s, axis=-2) @ v

    report = _assert_not_rewritten(fn, spellings.bnth(rng), "softmax is over the query axis")
    assert "axis=-1" in report.fallbacks[0].reason, str(report)


def test_pv_contracts_query_axis(rng):
    def fn(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bhtd,bhsd->bhts", q, k), axis=-1)
        return jnp.einsum("bhts,bhtd->bhsd", p, v)  # contracts T, not S

    _assert_not_rewritten(fn, spellings.bnth(rng), "different axis than the softmax")


def test_weights_returned(rng):
    def fn(q, k, v):
        p = jax.nn.softmax(q @ k.swapaxes(-1, -2), axis=-1)
        return p @ v, p

    report = _report(fn, *spellings.bnth(rng))
    assert not report.rewrites
    assert "returned" in report.fallbacks[0].reason
    assert "vjp" not in report.fallbacks[0].reason  # no backward was looked for


def test_weights_reused(rng):
    def fn(q, k, v):
        p = jax.nn.softmax(q @ k.swapaxes(-1, -2), axis=-1)
        return (p @ v).sum() + p.max()

    report = _report(fn, *spellings.bnth(rng))
    assert not report.rewrites
    assert "used" in report.fallbacks[0].reason


def test_scores_reused(rng):
    def fn(q, k, v):
        s = q @ k.swapaxes(-1, -2)
        return jax.nn.softmax(s, -1) @ v + s.mean()

    _assert_not_rewritten(fn, spellings.bnth(rng), "also used")


def test_gradient_without_the_attention_output(rng):
    # Only d/dq of a sum: the output and the probabilities are dead after DCE, the
    # backward reads exp and its sum only.  No forward site: nothing is rewritten
    # (tests/test_training.py covers differentiated programs that keep the output).
    def step(q, k, v):
        return jax.grad(lambda q: (jax.nn.softmax(q @ k.swapaxes(-1, -2), -1) @ v).sum())(q)

    report = _report(step, *spellings.bnth(rng))
    assert not report.rewrites


@pytest.mark.parametrize("act", [jax.nn.sigmoid, jax.nn.relu, lambda s: s])
def test_non_softmax_attention(act, rng):
    def fn(q, k, v):
        return act(q @ k.swapaxes(-1, -2)) @ v

    report = _assert_not_rewritten(fn, spellings.bnth(rng))
    assert not report.fallbacks and not report.unrecognised  # nothing softmax-like: no noise


def test_softmax_feeding_a_classifier(rng):
    def fn(x, w):
        return jnp.sum(jax.nn.softmax(x @ w, axis=-1) * jnp.arange(w.shape[-1]), axis=-1)

    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)
    _assert_not_rewritten(fn, (x, w), "varies along the key axis")


def test_moe_router(rng):
    # gates = softmax(x Wg); out = sum_e gates[n, e] * expert_out[n, e, :]
    def fn(x, wg, experts):
        gates = jax.nn.softmax(x @ wg, axis=-1)
        outs = jnp.einsum("nd,edf->nef", x, experts)
        return jnp.einsum("ne,nef->nf", gates, outs)

    x = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    wg = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    ex = jnp.asarray(rng.standard_normal((4, 8, 8)), jnp.float32)
    _assert_not_rewritten(fn, (x, wg, ex), "batches over")


def test_elementwise_tensor_scale(rng):
    def fn(q, k, v, w):
        return jax.nn.softmax((q @ k.swapaxes(-1, -2)) * w, -1) @ v

    q, k, v = spellings.bnth(rng)
    w = jnp.asarray(rng.standard_normal(q.shape[:3] + (k.shape[2],)), jnp.float32)
    _assert_not_rewritten(fn, (q, k, v, w), "multiplied elementwise")


def test_shift_varies_along_softmax_axis(rng):
    def fn(q, k, v):
        s = q @ k.swapaxes(-1, -2)
        e = jnp.exp(s - s.max(axis=-2, keepdims=True))  # shift varies along the key axis
        return (e / e.sum(-1, keepdims=True)) @ v

    _assert_not_rewritten(fn, spellings.bnth(rng), "varies along the softmax axis")


def test_normalised_over_other_axis(rng):
    def fn(q, k, v):
        e = jnp.exp(q @ k.swapaxes(-1, -2))
        return (e / e.sum(-2, keepdims=True)) @ v  # sum over queries, PV over keys

    _assert_not_rewritten(fn, spellings.bnth(rng))


def test_permuted_key_batch_axes(rng):
    # k's batch axes swapped relative to v's: PV pairs head with batch
    def fn(q, k, v):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k)
        p = jax.nn.softmax(s, -1)
        return jnp.einsum("bhts,hbsd->bhtd", p, v)

    q, k, v = spellings.bnth(rng)
    v = jnp.swapaxes(v, 0, 1)  # [H, B, S, D]
    # this *is* attention (v laid out [H, B, S, D]); it must be rewritten correctly
    opt = flashpass.optimize(fn, kernel="reference")
    assert len(opt.explain(q, k, v).rewrites) == 1
    np.testing.assert_allclose(
        np.asarray(opt(q, k, v)), np.asarray(fn(q, k, v)), rtol=2e-5, atol=2e-5
    )


def test_unknown_op_between(rng):
    def fn(q, k, v):
        s = q @ k.swapaxes(-1, -2)
        s = jnp.abs(s)  # not a recognised score operation
        return jax.nn.softmax(s, -1) @ v

    _assert_not_rewritten(fn, spellings.bnth(rng), "`abs`")


def test_traced_scale_after_bias_is_reported(rng):
    def fn(q, k, v, b, t):
        return jax.nn.softmax((q @ k.swapaxes(-1, -2) + b) * t, -1) @ v

    q, k, v = spellings.bnth(rng)
    args = (q, k, v, jnp.ones((1, 1, 1, q.shape[2])), jnp.float32(0.3))
    _assert_not_rewritten(fn, args, "traced value after a bias")


def test_dropout_that_cannot_be_exact_is_reported_not_rewritten(rng):
    # Exact dropout (tests/test_dropout.py) needs threefry keys: an rbg key is kept.
    def fn(q, k, v, key):
        p = jax.nn.softmax(q @ k.swapaxes(-1, -2), -1)
        keep = jax.random.bernoulli(key, 0.9, p.shape)
        return jnp.where(keep, p / 0.9, 0.0) @ v

    q, k, v = spellings.bnth(rng)
    report = _report(fn, q, k, v, jax.random.key(0, impl="rbg"))
    assert not report.rewrites
    assert "dropout" in report.fallbacks[0].reason
    assert "rbg PRNG" in report.fallbacks[0].reason


def test_probabilities_scaled_along_keys(rng):
    def fn(q, k, v, w):
        return (jax.nn.softmax(q @ k.swapaxes(-1, -2), -1) * w) @ v

    q, k, v = spellings.bnth(rng)
    _assert_not_rewritten(fn, (q, k, v, jnp.ones((k.shape[2],))), "varies along the key")


def test_deferred_division_by_other_sum(rng):
    def fn(q, k, v):
        e = jnp.exp(q @ k.swapaxes(-1, -2))
        o = e @ v
        return o / e.sum(-1)[..., None] + 0 * e.sum()  # the exp also feeds another sum

    _assert_not_rewritten(fn, spellings.bnth(rng))


def test_q_times_q(rng):
    def fn(q, v):
        s = q @ q.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
        return jax.nn.softmax(s, -1) @ v

    # self-similarity attention is still attention (k is q): rewritten, and exact
    q, _, v = spellings.bnth(rng)
    opt = flashpass.optimize(fn, kernel="reference")
    assert len(opt.explain(q, v).rewrites) == 1
    np.testing.assert_allclose(np.asarray(opt(q, v)), np.asarray(fn(q, v)), rtol=2e-5, atol=2e-5)
    g1 = jax.grad(lambda q: fn(q, v).sum())(q)
    g2 = jax.grad(lambda q: opt(q, v).sum())(q)
    np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), rtol=1e-4, atol=1e-4)


# Reshapes of the scores (patterns/regroup.py): only unit axes added or removed, and
# batch/head axes merged in order and split back exactly, keep every role.


def _regrouped(reshape_scores, reshape_probs=lambda p, s: p.reshape(s)):
    def fn(q, k, v):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3
        shape = s.shape
        p = jax.nn.softmax(reshape_scores(s), axis=-1)
        return jnp.einsum("bhts,bhsd->bhtd", reshape_probs(p, shape), v)

    return fn


def test_reshape_mixing_query_and_key_axes(rng):
    q, k, v = spellings.bnth(rng, t=8, s=16)
    fn = _regrouped(lambda s: s.reshape(s.shape[0], s.shape[1], 16, 8))
    _assert_not_rewritten(fn, (q, k, v), "made out of several score axes")


def test_reshape_merging_batch_and_heads_out_of_order(rng):
    # [B, H, T, S] -> [H, B, T, S] by reshape: mixes batches and heads
    q, k, v = spellings.bnth(rng)
    fn = _regrouped(lambda s: s.reshape(s.shape[1], s.shape[0], *s.shape[2:]))
    _assert_not_rewritten(fn, (q, k, v), "into sizes that are not its roles")


def test_heads_merged_in_reverse_order(rng):
    # heads-major merge of [B, H] (a transpose, then a reshape): not the product's order
    q, k, v = spellings.bnth(rng)

    def merge(s):
        return jnp.swapaxes(s, 0, 1).reshape(-1, *s.shape[2:])

    def split(p, shape):
        return jnp.swapaxes(p.reshape(shape[1], shape[0], *shape[2:]), 0, 1)

    _assert_not_rewritten(_regrouped(merge, split), (q, k, v), "out of the score product's axis")


def test_reshape_that_transposes_query_and_heads(rng):
    # [B, T, H, S] scores reshaped (not transposed) to [B, H, T, S]
    q, k, v = spellings.btnh(rng)

    def fn(q, k, v):
        s = jnp.einsum("bthd,bshd->bths", q, k)
        p = jax.nn.softmax(s.reshape(s.shape[0], s.shape[2], s.shape[1], s.shape[3]), axis=-1)
        return jnp.einsum("bhts,bshd->bthd", p, v)

    _assert_not_rewritten(fn, (q, k, v), "regroups the query axis with other axes")


def test_scores_broadcast_along_a_new_axis(rng):
    def fn(q, k, v):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k)
        p = jax.nn.softmax(jnp.broadcast_to(s[:, None], (s.shape[0], 2, *s.shape[1:])), axis=-1)
        return jnp.einsum("bghts,bhsd->bghtd", p, v)

    _assert_not_rewritten(fn, spellings.bnth(rng), "broadcasts the scores along")


def test_heads_merged_heads_major_reach_pv(rng):
    # heads merged into the batch heads-major ([H·B]) for the softmax and P·V on a
    # batch-major [B·H] v: the merged axes would pair different (batch, head)s.
    # (The batch-major merge is rewritten: tests/test_torch_layouts.py.)
    def fn(q, k, v):
        b, h, t, d = q.shape
        s = jnp.einsum("bhtd,bhsd->bhts", q, k).transpose(1, 0, 2, 3).reshape(h * b, t, -1)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("nts,nsd->ntd", p, v.reshape(b * h, -1, d))

    _assert_not_rewritten(fn, spellings.bnth(rng), "out of the score product's axis order")


def test_bias_varying_along_merged_heads_is_split_back(rng):
    # Positive neighbour of the regroupings above: a bias along the merged
    # batch x heads axis is split back into its roles when read (site._extra).
    q, k, v = spellings.bnth(rng)
    b, h, _, _ = q.shape
    bias = jnp.asarray(rng.standard_normal((b * h, 1, k.shape[2])), jnp.float32)  # per key

    def fn(q, k, v, bias):
        b, h, t, d = q.shape
        s = jnp.einsum("bhtd,bhsd->bhts", q, k).reshape(b * h, t, -1) + bias
        p = jax.nn.softmax(s, axis=-1).reshape(b, h, t, -1)
        return jnp.einsum("bhts,bhsd->bhtd", p, v)

    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(q, k, v, bias)
    assert len(report.rewrites) == 1, str(report)
    assert report.rewrites[0].spec["extras"][0]["shape"] == [b, h, 1, k.shape[2]]
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    got = jax.grad(loss(opt), argnums=(0, 3))(q, k, v, bias)
    want = jax.grad(loss(fn), argnums=(0, 3))(q, k, v, bias)
    np.testing.assert_allclose(opt(q, k, v, bias), fn(q, k, v, bias), rtol=2e-5, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-5)
