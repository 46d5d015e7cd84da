"""Mask kinds that depend on per-example inputs reach the kernel as O(B·S) /
O(H) descriptors, never as a ``[B|1, H|1, T, S]`` array (issue #28):

* a per-example key (padding) mask ``attention_mask[:, None, None, :]``, bool
  or int, alone and combined with causal / window structure (`Mask` of shape
  ``[B, 1, 1, S]``, beside the structured descriptors), or made additive with
  a finite fill (a `Bias` of that shape);
* ALiBi ``slope[h] * (j - i)`` and ``slope[h] * j`` (`Alibi`, O(H) slopes, a
  constant or an input whose gradient is checked);
* a prefix-LM with per-example traced prefix lengths (`PrefixLengths`);
* gemma's sliding mask on ``[B, T]`` positions from an input (`PositionMask`).

At T = S = 1024 each is checked on the rewritten jaxpr (no kernel operand or
captured constant holds ``T x S`` elements), forward and gradient against the
original under ``jax.jit`` (the first call), and in one SGD training step.
Near misses (slopes or lengths that vary over queries or keys, a distance
that is not affine, float positions) keep a dense bias or mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from t_by_s import assert_no_t_by_s, jaxpr_shapes, kernel_operand_shapes

import flashpass
from flashpass.testing import assert_same_function

B, H, T, D = 2, 2, 1024, 8
NEG = -1e30


def _attend(q, k, v, keep=None, bias=None, fill=NEG):
    s = jnp.einsum("bthd,bshd->bhts", q, k) * D**-0.5
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = jnp.where(keep, s, fill)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def _ij():
    pos = jnp.arange(T)
    return pos[:, None], pos[None, :]


def _valid():
    return jnp.asarray(np.arange(T)[None, :] < np.array([700, T])[:, None])


def _slopes():
    return jnp.asarray(2.0 ** -np.arange(1, H + 1), jnp.float32)


# --------------------------------------------------------------------------- the kinds


def key_bool(q, k, v, valid):
    return _attend(q, k, v, valid[:, None, None, :])


def key_int(q, k, v, valid):
    return _attend(q, k, v, valid.astype(jnp.int32)[:, None, None, :] > 0)


def key_additive(q, k, v, valid):
    # made additive with a finite fill: a key mask, and an EmptyRows op for a
    # fully padded row (its values and gradient flow through s + fill)
    return _attend(q, k, v, bias=jnp.where(valid, 0.0, -1e9)[:, None, None, :])


def causal_and_key(q, k, v, valid):
    i, j = _ij()
    return _attend(q, k, v, (j <= i)[None, None] & valid[:, None, None, :])


def window_and_key(q, k, v, valid):
    i, j = _ij()
    return _attend(q, k, v, ((j <= i) & (j > i - 128))[None, None] & valid[:, None, None, :])


def keras_bool_merge(q, k, v, valid):
    # keras-hub's causal/padding merge in boolean form: [B, 1, S] & [T, S]
    i, j = _ij()
    return _attend(q, k, v, (valid[:, None, :] & (j <= i)[None])[:, None])


def alibi(q, k, v, valid):
    i, j = _ij()
    return _attend(q, k, v, (j <= i), bias=_slopes()[None, :, None, None] * (j - i))


def alibi_input(q, k, v, slopes):
    i, j = _ij()
    dist = (i - j).astype(jnp.float32)  # i - j: the slopes come out negated
    return _attend(q, k, v, (j <= i), bias=-slopes[None, :, None, None] * dist)


def alibi_keys(q, k, v, valid):
    # Bloom: slope[h] * j, with key padding
    j = jnp.arange(T, dtype=jnp.int32)
    bias = _slopes()[None, :, None, None] * j.astype(jnp.float32)[None, None, None, :]
    return _attend(q, k, v, valid[:, None, None, :], bias=bias)


def prefix_lengths(q, k, v, lengths):
    i, j = _ij()
    return _attend(q, k, v, (j <= i)[None, None] | (j[None, None] < lengths[:, None, None, None]))


def gemma_positions(q, k, v, positions):
    kv, qp = positions[:, None, :], positions[:, :, None]
    keep = (kv > qp - 128) & (kv <= qp)
    return _attend(q, k, v, keep[:, None])


def _qkv(rng, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.standard_normal((B, T, H, D)), dtype) for _ in range(3))


def _positions():
    # example 1: two documents, the second restarting at 0
    return jnp.asarray(np.stack([np.arange(T), np.r_[np.arange(300), np.arange(T - 300)]]))


KINDS = {
    "key_bool": (key_bool, _valid, "key mask", "mask"),
    "key_int": (key_int, _valid, "key mask", "mask"),
    "key_additive": (key_additive, _valid, "key mask", "mask"),
    "causal_and_key": (causal_and_key, _valid, "causal+key mask", "mask"),
    "window_and_key": (window_and_key, _valid, "causal+window+key mask", "mask"),
    "keras_bool_merge": (keras_bool_merge, _valid, "causal+key mask", "mask"),
    "alibi": (alibi, _valid, "causal", "alibi"),
    "alibi_input": (alibi_input, _slopes, "causal", "alibi"),
    "alibi_keys": (alibi_keys, _valid, "key mask", "alibi"),
    "prefix_lengths": (
        prefix_lengths,
        lambda: jnp.asarray([100, 0], jnp.int32),
        "prefix_lengths",
        "prefixlengths",
    ),
    "gemma_positions": (gemma_positions, _positions, "positions", "positionmask"),
}

#: The training steps run by default (the others are marked slow).
QUICK_STEPS = {"causal_and_key", "alibi_input", "prefix_lengths", "gemma_positions"}
#: Kinds whose rewrite check is marked slow (spellings the quick ones cover).
SLOW_KINDS = {"key_int", "key_additive", "keras_bool_merge", "alibi_keys"}


def _marked(names, quick):
    return [n if n in quick else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", _marked(sorted(KINDS), set(KINDS) - SLOW_KINDS))
def test_kind_reaches_the_kernel_without_a_t_by_s_operand(name, rng):
    fn, make, mask, op_name = KINDS[name]
    args = (*_qkv(rng), make())
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    site = report.rewrites[0]
    assert site.mask == mask, str(report)
    ops = {op["op"] for op in site.spec["score_ops"]}
    if op_name != "bias":
        assert "bias" not in ops, site.spec["score_ops"]  # (an O(H) bias would pass below)
    assert op_name in ops, ops
    extras = [tuple(e["shape"]) for e in site.spec["extras"]]
    if op_name in ("mask", "bias"):  # the per-example key mask
        assert (B, 1, 1, T) in extras, extras
    assert all(np.prod(e) <= B * H * T for e in extras), extras
    # The original materialises T x S; the rewrite hands the kernel none.
    original = jax.make_jaxpr(fn)(*args)
    assert_no_t_by_s(
        kernel_operand_shapes(opt.rewritten_jaxpr(*args)), T, T, control=jaxpr_shapes(original)
    )
    # First call under jit: forward and gradients (every float input).  Bloom's
    # slope * j reaches 500: float32 scores keep ~3e-5 absolute there.
    tol = 2e-4 if name == "alibi_keys" else None
    assert_same_function(jax.jit(fn), jax.jit(opt), *args, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", _marked(sorted(KINDS), QUICK_STEPS))
def test_one_training_step_per_kind(name, rng):
    fn, make, _, _ = KINDS[name]
    extra = make()
    x = jnp.asarray(rng.standard_normal((B, T, 16)), jnp.float32)
    params = {
        n: jnp.asarray(rng.standard_normal((16, H * D)) * 0.2, jnp.float32) for n in ("q", "k", "v")
    }

    def loss(p, x, extra):
        q, k, v = (jnp.einsum("btc,cf->btf", x, p[n]).reshape(B, T, H, D) for n in "qkv")
        return jnp.mean(fn(q, k, v, extra) ** 2)

    def step(p, x, extra):
        value, grads = jax.value_and_grad(loss)(p, x, extra)
        return value, jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

    opt = flashpass.optimize(step, kernel="blockwise")
    report = opt.explain(params, x, extra)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert_no_t_by_s(kernel_operand_shapes(opt.rewritten_jaxpr(params, x, extra)), T, T)
    want, got = jax.jit(step)(params, x, extra), jax.jit(opt)(params, x, extra)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- near misses


def slopes_over_queries(q, k, v, slopes):
    # a slope per (head, query): not ALiBi
    i, j = _ij()
    return _attend(q, k, v, (j <= i), bias=slopes[None, :, :, None] * (j - i))


def distance_not_affine(q, k, v, valid):
    i, j = _ij()
    return _attend(q, k, v, (j <= i), bias=_slopes()[None, :, None, None] * jnp.abs(j - i))


def distance_scaled(q, k, v, valid):
    # key coefficient 2: not a distance
    i, j = _ij()
    return _attend(q, k, v, (j <= i), bias=_slopes()[None, :, None, None] * (2 * j - i))


def float_positions(q, k, v, positions):
    p = positions.astype(jnp.float32)
    return _attend(q, k, v, (p[:, None, :] > p[:, :, None] - 128)[:, None])


NEAR_MISSES = {
    "slopes_over_queries": (
        slopes_over_queries,
        lambda: jnp.asarray(np.random.default_rng(3).random((H, T)), jnp.float32),
        "bias",
    ),
    "distance_not_affine": (distance_not_affine, _valid, "bias"),
    "distance_scaled": (distance_scaled, _valid, "bias"),
    "float_positions": (float_positions, _positions, "mask"),
}


@pytest.mark.parametrize(
    "name", _marked(sorted(NEAR_MISSES), set(NEAR_MISSES) - {"distance_scaled"})
)
def test_near_miss_stays_dense(name, rng):
    fn, make, kept = NEAR_MISSES[name]
    args = (*_qkv(rng), make())
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, str(report)
    ops = [op["op"] for op in report.rewrites[0].spec["score_ops"]]
    assert kept in ops, ops
    assert not {"alibi", "prefixlengths", "positionmask"} & set(ops), ops
    np.testing.assert_allclose(opt(*args), fn(*args), rtol=2e-5, atol=2e-5)


def test_library_kernels_decline_the_new_kinds_with_a_reason(rng):
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in _qkv(rng))
    order = ["splash", "blockwise"]

    def bhtd(fn):
        return lambda q, k, v, x: jnp.swapaxes(
            fn(*(jnp.swapaxes(a, 1, 2) for a in (q, k, v)), x), 1, 2
        )

    for fn, extra, word in (
        (alibi, _valid(), "ALiBi"),
        (prefix_lengths, jnp.asarray([100, 0], jnp.int32), "prefix"),
        (gemma_positions, _positions(), "positions"),
    ):
        report = flashpass.optimize(bhtd(fn), kernel=order, interpret=True).explain(q, k, v, extra)
        assert report.kernels == ["blockwise"], str(report)
        reasons = " ".join(report.rewrites[0].rejected["splash"])
        assert word in reasons, reasons
