"""The same rewrite in every context of the first call.

Users call an optimized function as ``jax.jit(opt)(...)``, from inside their
own ``jit``, ``eval_shape``, ``grad``, ``vmap``, a ``scan`` body,
``checkpoint`` or a ``shard_map`` body.  For every spelling of the catalogue
(tests/spellings.py), a *fresh* optimized function makes its first call in
each context; the pass must find the same sites as a direct call (every one
rewritten, nothing kept, no internal error) and compute the original function
in that context.  The suite runs strict (conftest.py), so a crash in the
matcher fails here instead of becoming a fallback.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.printer import count_kernel_calls

import spellings
from contexts import CONTEXTS, in_context


def _tolerance(args):
    return 2e-2 if any(a.dtype == jnp.bfloat16 for a in args) else 2e-5


def _assert_same(actual, expected, tol):
    for a, e in zip(
        jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True
    ):
        if isinstance(e, jax.ShapeDtypeStruct):
            assert (a.shape, a.dtype) == (e.shape, e.dtype)
            continue
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=tol, atol=tol
        )


@functools.cache
def _direct_sites(name: str) -> int:
    """The sites a direct call rewrites, once per spelling for the module (the
    tests' inputs are ``make(rng)`` with the conftest's seed, so the same)."""
    fn, make = spellings.POSITIVE[name]
    args = make(np.random.default_rng(0))
    return len(flashpass.optimize(fn, kernel="blockwise").explain(*args).rewrites)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("name", sorted(spellings.POSITIVE))
def test_first_call_in_context(name, context, rng):
    fn, make = spellings.POSITIVE[name]
    args = make(rng)
    # Distinct inputs: with q = k = v (or equal batch entries) any weights, or a
    # batch mix-up, could give the same output.
    floats = [np.asarray(a, np.float32) for a in args if jnp.issubdtype(a.dtype, jnp.floating)]
    assert len({a.tobytes() for a in floats}) == len(floats), name
    expected_sites = _direct_sites(name)
    assert expected_sites >= 1

    opt = flashpass.optimize(fn, kernel="blockwise")
    out = in_context(context, opt, args)
    assert opt.traces == 1
    report = opt.reports[-1]
    assert len(report.rewrites) == expected_sites, f"{context}:\n{report}"
    assert not report.fallbacks and not report.errors, f"{context}:\n{report}"
    _assert_same(out, in_context(context, fn, args), _tolerance(args))
    if context == "vmap":  # the two stacked entries differ, so a batch mix-up shows
        first = np.asarray(jax.tree_util.tree_leaves(out)[0], np.float32)
        assert not np.allclose(first[0], first[1], rtol=0.1, atol=0.1), name


def test_readme_example_under_jit(rng):
    """The README's example, first called under jax.jit, is rewritten."""

    @flashpass.optimize
    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    q, k, v = (jnp.asarray(rng.standard_normal((1, 1024, 2, 16)), jnp.float32) for _ in range(3))
    out = jax.jit(attention)(q, k, v)
    (report,) = attention.reports
    assert report.kernels == ["blockwise"] and report.rewrites[0].causal, str(report)
    assert attention.explain(q, k, v) is report  # same signature, same entry
    np.testing.assert_allclose(out, attention.__wrapped__(q, k, v), rtol=2e-5, atol=2e-5)


def test_call_order_does_not_matter(rng):
    args = spellings.bnth(rng)
    fn = spellings.causal_iota_finfo_min
    first_jit = flashpass.optimize(fn, kernel="blockwise")
    jax.jit(first_jit)(*args)
    first_direct = flashpass.optimize(fn, kernel="blockwise")
    first_direct(*args)
    jax.jit(first_direct)(*args)
    a, b = first_jit.explain(*args), first_direct.explain(*args)
    assert a.to_dict() == b.to_dict()
    assert str(first_jit.rewritten_jaxpr(*args)) == str(first_direct.rewritten_jaxpr(*args))
    assert first_jit.traces == first_direct.traces == 1


def test_cached_call_reuses_the_pass(rng):
    args = spellings.bnth(rng)
    opt = flashpass.optimize(spellings.matmul_bnth, kernel="blockwise")
    for _ in range(3):
        opt(*args)
        jax.jit(opt)(*args)
        jax.eval_shape(opt, *args)
    assert opt.traces == 1 and opt.cache_info()["size"] == 1


def test_idempotent(rng):
    """Kernel calls the pass made are opaque: never matched again."""
    fn = spellings.causal_tril_where
    args = spellings.btnh(rng)
    inner = flashpass.optimize(fn, kernel="blockwise")
    twice = flashpass.optimize(inner, kernel="blockwise")
    around = flashpass.optimize(lambda *a: inner(*a) * 2.0, kernel="blockwise")
    for outer in (twice, around):
        report = outer.explain(*args)
        assert not report.rewrites and not report.fallbacks and not report.errors, str(report)
        assert sum(count_kernel_calls(outer.rewritten_jaxpr(*args)).values()) == 1
    np.testing.assert_allclose(twice(*args), fn(*args), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(around(*args), 2.0 * fn(*args), rtol=2e-5, atol=2e-5)
    assert inner.traces == 1


def test_closure_over_an_outer_tracer(rng):
    """A function closing over the enclosing jit's values: rewritten, not cached."""
    q, k, v = spellings.bnth(rng)

    made = []

    @jax.jit
    def outer(q, k, v, scale):
        opt = flashpass.optimize(
            lambda q: spellings.matmul_bnth(q * scale, k, v), kernel="blockwise"
        )
        made.append(opt)
        return opt(q)

    out = outer(q, k, v, 2.0)
    np.testing.assert_allclose(out, spellings.matmul_bnth(q * 2.0, k, v), rtol=2e-5, atol=2e-5)
    (opt,) = made
    # The rewritten program holds the enclosing trace's values: never cached.
    assert opt.traces == 1 and opt.cache_info()["size"] == 0
    assert "flashpass_blockwise" in str(jax.make_jaxpr(outer)(q, k, v, 2.0))


# ------------------------------------------------------------------ internal errors


def _crash(*args, **kwargs):
    raise RuntimeError("injected matcher bug")


def test_internal_error_is_reported_and_warned(monkeypatch, rng, caplog):
    monkeypatch.setattr("flashpass.patterns.match.match_site", _crash)
    args = spellings.bnth(rng)
    opt = flashpass.optimize(spellings.matmul_bnth, kernel="blockwise", strict=False)
    with caplog.at_level(logging.WARNING, logger="flashpass"):
        out = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert not report.rewrites and not report.fallbacks
    (error,) = report.errors
    assert error.stage == "match" and "injected matcher bug" in error.error
    assert "please report" in error.hint and "internal error" in str(report)
    assert report.to_dict()["internal_errors"][0]["stage"] == "match"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "injected matcher bug" in warnings[0].getMessage()
    np.testing.assert_allclose(out, spellings.matmul_bnth(*args), rtol=1e-5, atol=1e-6)


def test_strict_reraises(monkeypatch, rng):
    monkeypatch.setattr("flashpass.patterns.match.match_site", _crash)
    args = spellings.bnth(rng)
    with pytest.raises(RuntimeError, match="injected matcher bug"):
        flashpass.optimize(spellings.matmul_bnth, kernel="blockwise", strict=True)(*args)
    monkeypatch.setenv("FLASHPASS_STRICT", "1")
    with pytest.raises(RuntimeError, match="injected matcher bug"):
        jax.jit(flashpass.optimize(spellings.matmul_bnth, kernel="blockwise"))(*args)
    monkeypatch.setenv("FLASHPASS_STRICT", "0")
    report = flashpass.optimize(spellings.matmul_bnth, kernel="blockwise").explain(*args)
    assert len(report.errors) == 1


def test_rewrite_failure_is_an_internal_error(monkeypatch, rng):
    def broken(*args, **kwargs):
        raise RuntimeError("injected rewriter bug")

    monkeypatch.setattr("flashpass.pipeline.rewrite", broken)
    args = spellings.bnth(rng)
    opt = flashpass.optimize(spellings.matmul_bnth, kernel="blockwise", strict=False)
    report = opt.explain(*args)
    assert [e.stage for e in report.errors] == ["rewrite"] and not report.rewrites
    np.testing.assert_allclose(opt(*args), spellings.matmul_bnth(*args), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="injected rewriter bug"):
        flashpass.optimize(spellings.matmul_bnth, kernel="blockwise", strict=True).explain(*args)


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match="strict must be"):
        flashpass.optimize(spellings.matmul_bnth, strict="yes")


def test_debug_dump(monkeypatch, tmp_path, rng):
    monkeypatch.setenv("FLASHPASS_DUMP", str(tmp_path))
    monkeypatch.setenv("FLASHPASS_DUMP_FILTER", "matmul_bnth")
    args = spellings.bnth(rng)
    flashpass.optimize(spellings.matmul_bnth, kernel="blockwise").explain(*args)
    flashpass.optimize(spellings.einsum_btnh, kernel="blockwise").explain(*spellings.btnh(rng))
    (folder,) = tmp_path.iterdir()  # the filter left einsum_btnh out
    assert folder.name.startswith("matmul_bnth-")
    files = {p.name: p.read_text() for p in folder.iterdir()}
    assert set(files) == {
        "1-traced.jaxpr.txt",
        "2-rewritten.jaxpr.txt",
        "report.txt",
        "report.json",
    }
    assert "flashpass_blockwise" in files["2-rewritten.jaxpr.txt"]
    assert "flashpass_blockwise" not in files["1-traced.jaxpr.txt"]
    assert "1 rewritten" in files["report.txt"]
