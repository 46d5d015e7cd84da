"""Every spelling is matched, rewritten, and computes the original function.

The ``reference`` kernel computes the canonical spec naively, so these tests
isolate the matcher's canonicalisation (layouts, roles, score ops) from any
fast kernel's numerics.  Kernel numerics are tested in tests/kernels/.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.kernels import Causal
from flashpass.testing import assert_same_function

import spellings


@pytest.mark.parametrize("name", sorted(spellings.POSITIVE))
def test_spelling_is_rewritten_exactly(name, rng):
    fn, make = spellings.POSITIVE[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="reference")
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, str(report)
    assert not report.fallbacks, str(report)
    rewrite = report.rewrites[0]
    assert rewrite.kernel == "reference"
    assert rewrite.location and "spellings.py:" in rewrite.location
    assert rewrite.causal == (name in spellings.CAUSAL), rewrite.spec
    diff = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    assert_same_function(fn, opt, *args, argnums=diff)


def test_scale_is_recorded(rng):
    q, k, v = spellings.btnh(rng)
    report = flashpass.explain(
        flashpass.optimize(spellings.einsum_btnh, kernel="reference"), q, k, v
    )
    assert report.rewrites[0].scale == pytest.approx(1 / np.sqrt(spellings.D))


def test_causal_offset_bottom_right(rng):
    fn, make = spellings.POSITIVE["causal_bottom_right"]
    args = make(rng)
    report = flashpass.optimize(fn, kernel="reference").explain(*args)
    ops = report.rewrites[0].spec["score_ops"]
    causal = [op for op in ops if op["op"] == "causal"]
    assert len(causal) == 1 and causal[0]["offset"] == spellings.S - 8
    assert causal[0]["fill"] == pytest.approx(-1e30, rel=1e-6)


def test_mask_and_causal_are_split(rng):
    fn, make = spellings.POSITIVE["mask_and_causal"]
    report = flashpass.optimize(fn, kernel="reference").explain(*make(rng))
    kinds = [op["op"] for op in report.rewrites[0].spec["score_ops"]]
    assert sorted(kinds) == ["causal", "mask"]
    assert report.rewrites[0].mask == "causal+key mask"


def test_padding_mask_is_not_materialised(rng):
    fn, make = spellings.POSITIVE["padding_mask"]
    report = flashpass.optimize(fn, kernel="reference").explain(*make(rng))
    (extra,) = report.rewrites[0].spec["extras"]
    # [B, 1, 1, S]: broadcast over heads and queries, never T x S
    assert extra["shape"] == [spellings.B, 1, 1, spellings.S]
    assert extra["dtype"] == "bool"


def test_constant_non_causal_mask_is_a_mask(rng):
    pattern = np.random.default_rng(3).random((spellings.T, spellings.S)) > 0.3
    pattern[:, 0] = True

    def fn(q, k, v):
        s = jnp.where(jnp.asarray(pattern), q @ k.swapaxes(-1, -2), -1e9)
        return jax.nn.softmax(s, -1) @ v

    args = spellings.bnth(rng)
    opt = flashpass.optimize(fn, kernel="reference")
    report = opt.explain(*args)
    assert report.rewrites[0].causal is False and report.rewrites[0].mask == "dense"
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


def test_weak_fill_causal_mask_keeps_literal_semantics(rng):
    # fill -5 does not zero masked keys: must not become a Causal (skippable) op
    def fn(q, k, v):
        t = q.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), q @ k.swapaxes(-1, -2), -5.0)
        return jax.nn.softmax(s, -1) @ v

    args = spellings.bnth(rng)
    opt = flashpass.optimize(fn, kernel="reference")
    spec = opt.explain(*args).rewrites[0].spec
    assert not any(op["op"] == "causal" for op in spec["score_ops"])
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


def test_causal_spec_roundtrip(rng):
    fn, make = spellings.POSITIVE["causal_tril_where"]
    opt = flashpass.optimize(fn, kernel="reference")
    args = make(rng)
    opt(*args)
    site_ops = opt.explain(*args).rewrites[0].spec["score_ops"]
    assert {"op": "causal", "offset": 0, "fill": float("-inf")} in site_ops
    assert Causal(0, float("-inf")).offset == 0


def test_two_sites_in_one_function(rng):
    def two(q, k, v):
        return spellings.matmul_bnth(q, k, v) + spellings.handwritten_softmax(v, q, k)

    args = spellings.bnth(rng)
    opt = flashpass.optimize(two, kernel="reference")
    assert len(opt.explain(*args).rewrites) == 2
    assert_same_function(two, opt, *args, argnums=(0, 1, 2))


def test_softcap_after_causal_mask_is_not_skippable(rng):
    # where(causal, s, -inf) then soft-cap: masked scores become -cap, not excluded
    def fn(q, k, v):
        t = q.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), q @ k.swapaxes(-1, -2), -jnp.inf)
        s = 3.0 * jnp.tanh(s / 3.0)
        return jax.nn.softmax(s, -1) @ v

    args = spellings.bnth(rng)
    opt = flashpass.optimize(fn, kernel="reference")
    spec = opt.explain(*args).rewrites[0].spec
    assert [op["op"] for op in spec["score_ops"]] == ["mask", "softcap"]
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


def test_causal_mask_beyond_the_fold_limit(monkeypatch, rng):
    # iota-built masks are classified symbolically, at any size
    from flashpass import graph

    monkeypatch.setattr(graph, "FOLD_LIMIT", 16)
    for name in ("causal_tril_where", "causal_iota_finfo_min", "causal_bottom_right"):
        fn, make = spellings.POSITIVE[name]
        report = flashpass.optimize(fn, kernel="reference").explain(*make(rng))
        assert report.rewrites[0].causal, (name, report.rewrites[0].spec)


def test_symbolic_and_numeric_causal_agree():
    import jax.numpy as jnp

    from flashpass.graph import build_scopes
    from flashpass.patterns.common import profile
    from flashpass.patterns.masks import causal_offset, symbolic_causal_offset

    def masks(t, s):
        i = jnp.arange(t)[:, None]
        j = jnp.arange(s)[None, :]
        return [j <= i + 2, i >= j, j < i + 1, ~(j > i), (i - j) >= -3, j >= i, i > j + 1]

    for t, s in ((5, 5), (4, 7)):
        closed = jax.make_jaxpr(functools.partial(masks, t, s))()
        scope = build_scopes(closed)[0]
        for out in scope.outputs:
            prof = profile(scope, out, (t, s))
            sym = symbolic_causal_offset(scope, prof, ["T", "S"], True)
            num = causal_offset(np.asarray(scope.fold(out)))
            assert sym == num, (t, s, sym, num)


def test_hf_additive_bias_stays_exact(rng):
    # data-dependent padding inside the additive bias: causal and a key mask, and
    # an EmptyRows op, so fully padded rows keep the original's values and
    # gradients (softmax(s + finfo.min), not a masked row)
    fn, make = spellings.POSITIVE["hf_attention_bias"]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="reference")
    spec = opt.explain(*args).rewrites[0].spec
    assert [op["op"] for op in spec["score_ops"]] == ["scale", "mask", "causal", "emptyrows"]
    assert spec["extras"] == [{"shape": [2, 1, 1, 16], "dtype": "bool"}]
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))


def test_hf_constant_causal_bias_becomes_causal(rng):
    def fn(q, k, v):
        t = q.shape[1]
        causal = jnp.tril(jnp.ones((1, 1, t, t), bool)).astype(jnp.float32)
        bias = jax.lax.select(
            causal > 0,
            jnp.full(causal.shape, 0.0),
            jnp.full(causal.shape, jnp.finfo(jnp.float32).min),
        )
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    args = spellings.btnh(rng)
    opt = flashpass.optimize(fn, kernel="reference")
    spec = opt.explain(*args).rewrites[0].spec
    assert [op["op"] for op in spec["score_ops"]] == ["causal"]
    assert_same_function(fn, opt, *args, argnums=(0, 1, 2))
