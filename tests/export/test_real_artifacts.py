"""Artifacts as a new user brings them: constants fold outside tracing, any op
loads (ops with regions too), sites are found whatever else the module holds,
and the rewritten artifact is called as the original is.  Each on both routes."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass.export as fx
from flashpass import compat
from flashpass.kernels.blockwise import BlockwiseKernel

from spellings import POSITIVE

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
ROUTES = ("lift", "splice")
#: Blocks smaller than the sequences below, so the kernel's own tiles are not T×S.
SMALL = BlockwiseKernel(block_q=32, block_k=32)


def _txs(module_text: str, t: int, s: int) -> list:
    """Tensor types of ``module_text`` with a T dimension before an S dimension."""
    return re.findall(rf"tensor<(?:\d+x)*{t}x{s}x\w+>", module_text)


def _structs(args):
    return [jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype) for a in args]


def _check(exp, args, route, *, n_sites=1, kernel="blockwise", grad=True, atol=2e-5):
    """Rewrite ``exp`` on ``route``; its value, and its gradient through
    ``vjp_order=1``, equal the original artifact's."""
    new, report = fx.rewrite_and_explain(exp, route=route, kernel=kernel)
    assert report.route == route and len(report.rewrites) == n_sites, str(report)
    assert [s.route for s in report.sites if s.route != "kept"] == [route] * n_sites
    new = jax.export.deserialize(new.serialize(vjp_order=1 if grad else 0))
    assert (new.in_avals, new.out_avals, new.in_tree) == (exp.in_avals, exp.out_avals, exp.in_tree)
    tol = dict(atol=atol, rtol=0)
    got, want = jax.jit(new.call)(*args), exp.call(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)
    if grad:
        floats = [
            i for i, a in enumerate(args) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)
        ]

        def loss(call):
            def f(*fl):
                full = list(args)
                for i, x in zip(floats, fl, strict=True):
                    full[i] = x
                out = call(*full)
                return sum(jnp.sum(jnp.asarray(o, jnp.float32) ** 2) for o in jax.tree.leaves(out))

            return jax.grad(f, argnums=tuple(range(len(floats))))

        float_args = [args[i] for i in floats]
        for g, w in zip(loss(new.call)(*float_args), loss(exp.call)(*float_args), strict=True):
            np.testing.assert_allclose(
                np.asarray(g, np.float32), np.asarray(w, np.float32), atol=1e-4
            )
    return new, report


# ---------------------------------------------------------------- constants fold on the host

#: The scale spellings: jnp.sqrt of the head size, math.sqrt, lax.rsqrt, a
#: Python constant, a traced scale, a bf16 cast after a sqrt.
SCALES = ["einsum_btnh", "matmul_transpose_rsqrt", "traced_scale"]


def _exported_spelling(name):
    fn, make = POSITIVE[name]
    args = make(np.random.default_rng(0))
    return jax.export.export(jax.jit(fn))(*_structs(args)), args


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", SCALES)
def test_scale_spellings_are_rewritten(name, route):
    """``/ jnp.sqrt(d)``, ``* lax.rsqrt(d)`` fold on the host (they crashed as
    traced constants); a traced scale stays an input.  The gradient: below (slow)."""
    exp, args = _exported_spelling(name)
    _check(exp, args, route, grad=False)


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", list(POSITIVE))
def test_every_spelling_exported_is_rewritten(name, route):
    """Every positive spelling, exported, on both routes: value and gradient."""
    exp, args = _exported_spelling(name)
    atol = 2e-2 if "bf16" in name else 2e-5
    _check(exp, args, route, grad="bf16" not in name, atol=atol)


def test_constants_fold_without_a_trace():
    """A module whose only scale is ``sqrt`` of a splat: the folded scale is a
    literal of the lifted program, and lifting evaluates nothing inside its trace."""
    from flashpass.export.lift import prepare

    exp, _ = _exported_spelling("einsum_btnh")
    module = compat.parse_module(exp.mlir_module_serialized, compat.mlir_context())
    assert "stablehlo.sqrt" in exp.mlir_module()
    jaxpr = jax.make_jaxpr(prepare(module).function())(*exp.in_avals)
    assert "sqrt" not in str(jaxpr)  # folded: sqrt(8) is a constant of the lifted program


def _readme_attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_readme_attention_through_the_command_line(tmp_path, route):
    x = jax.ShapeDtypeStruct((1, 128, 2, 16), jnp.float32)
    exp = jax.export.export(jax.jit(_readme_attention))(x, x, x)
    src, dst = tmp_path / "model.bin", tmp_path / "flash.bin"
    src.write_bytes(exp.serialize())
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = ["rewrite", str(src), str(dst), "--kernel", "blockwise", "--route", route]
    proc = subprocess.run(
        [sys.executable, "-m", "flashpass", *args, "--vjp-order", "1"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 rewritten" in proc.stdout and f"route {route}" in proc.stdout, proc.stdout
    new = jax.export.deserialize(dst.read_bytes())
    q, k, v = (
        jnp.asarray(np.random.default_rng(i).standard_normal(x.shape), x.dtype) for i in range(3)
    )
    np.testing.assert_allclose(new.call(q, k, v), exp.call(q, k, v), atol=2e-5)


# ---------------------------------------------------------------- any op loads


def _attention_and_cumsum(q, k, v, lengths):
    # Positions from cumsum (reduce_window), the key mask from them: O(T) data.
    valid = jnp.arange(q.shape[1])[None, :] < lengths[:, None]
    positions = jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1
    keep = (positions[:, None, None, :] >= 0) & jnp.tril(jnp.ones((q.shape[1],) * 2, bool))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(keep, s, jnp.finfo(s.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return out + jnp.cumsum(q, axis=1) * 0.5  # a float cumsum, differentiated


@pytest.mark.parametrize(
    "grad", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["value", "grad"]
)
@pytest.mark.parametrize("route", ROUTES)
def test_cumsum_is_lifted_and_rewritten(route, grad):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 64, 2, 16)), jnp.float32) for _ in range(3))
    lengths = jnp.asarray([64, 40], jnp.int32)
    exp = jax.export.export(jax.jit(_attention_and_cumsum))(*_structs((q, k, v, lengths)))
    assert "reduce_window" in exp.mlir_module()
    new, report = _check(exp, (q, k, v, lengths), route, kernel=SMALL, grad=grad)
    assert not report.islands, str(report)  # reduce_window has a rule
    assert not _txs(new.mlir_module(), 64, 64), "a T×S type is left"


def test_reduce_window_pooling_is_lifted():
    """A max pool and its gradient (``select_and_scatter``, kept as an island
    with its regions) load; the pool is lifted with its rule."""

    def pool(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3), (1, 2), "SAME")

    def pool_grad(x):
        return jax.grad(lambda y: pool(y).sum())(x)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9)), jnp.float32)
    exp = jax.export.export(jax.jit(pool))(*_structs([x]))
    new, report = fx.rewrite_and_explain(exp)
    assert report.route == "lift" and not report.islands, str(report)
    np.testing.assert_array_equal(new.call(x), exp.call(x))
    np.testing.assert_array_equal(jax.grad(lambda y: new.call(y).sum())(x), pool_grad(x))

    exp = jax.export.export(jax.jit(pool_grad))(*_structs([x]))
    new, report = fx.rewrite_and_explain(exp)
    assert report.route == "lift", str(report)
    assert {i.op for i in report.islands} <= {"stablehlo.select_and_scatter"}, str(report)
    np.testing.assert_array_equal(new.call(x), exp.call(x))


def _scanned(x, w):
    def step(c, wi):
        return jnp.tanh(c @ wi), None

    return jax.lax.scan(step, x, w)[0]


def test_a_counted_while_is_a_scan_again():
    """``lax.scan`` lowers to a ``while`` counting to a constant: lifted as a
    scan, so the lifted program is reverse-differentiable (a while_loop is not)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 4, 4)), jnp.float32)
    exp = jax.export.export(jax.jit(_scanned))(*_structs([x, w]))
    assert "stablehlo.while" in exp.mlir_module()
    new, report = fx.rewrite_and_explain(exp)
    assert report.route == "lift" and not report.islands, str(report)
    new = jax.export.deserialize(new.serialize(vjp_order=1))
    np.testing.assert_allclose(new.call(x, w), exp.call(x, w), atol=1e-6)
    got = jax.grad(lambda w: new.call(x, w).sum())(w)
    np.testing.assert_allclose(got, jax.grad(lambda w: _scanned(x, w).sum())(w), atol=1e-5)


def test_scatter_is_lifted():
    def fn(x, i, u):
        return x.at[i].add(u), x.at[i].set(u)

    x, u = jnp.zeros((6, 3)), jnp.ones((2, 3))
    i = jnp.asarray([1, 7], jnp.int32)  # 7: out of bounds, dropped
    exp = jax.export.export(jax.jit(fn))(*_structs([x, i, u]))
    new, report = fx.rewrite_and_explain(exp)
    assert report.route == "lift" and not report.islands, str(report)
    for got, want in zip(new.call(x, i, u), exp.call(x, i, u), strict=True):
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- the cumsum Llama fixture


def _llama_inputs(exp):
    rng = np.random.default_rng(0)
    *weights, tokens, mask = exp.in_avals
    out = [jnp.asarray(rng.standard_normal(a.shape) * 0.2, a.dtype) for a in weights]
    t = tokens.shape[1]
    mask = np.ones(tokens.shape, np.int64)
    mask[1, : t // 3] = 0  # left padding in the second row
    return out, rng.integers(0, 128, tokens.shape).astype(np.int64), mask


@pytest.mark.parametrize(
    "grad", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["value", "grad"]
)
@pytest.mark.parametrize("route", ROUTES)
def test_cumsum_llama_fixture(route, grad):
    """A tiny Llama whose position ids come from ``cumsum`` (see
    make_fixtures.cumsum_llama), int64 tokens and an O(B·S) padding mask."""
    exp = fx.load((FIXTURES / "llama_cumsum_jax.mlirbc").read_bytes())
    assert "reduce_window" in exp.mlir_module()
    assert not compat.x64_enabled()
    new, report = fx.rewrite_and_explain(exp, route=route, kernel=SMALL)
    assert not compat.x64_enabled()
    assert report.route == route and len(report.rewrites) == 2, str(report)
    assert all(r.mask == "causal+key mask" for r in report.rewrites), str(report)
    assert report.needs_x64 and "x64 on" in str(report)
    t = exp.in_avals[-1].shape[1]
    assert _txs(exp.mlir_module(), t, t)
    assert not _txs(new.mlir_module(), t, t), "a T×S type is left where the mask is O(T)"
    weights, tokens, mask = _llama_inputs(exp)
    new = jax.export.deserialize(new.serialize(vjp_order=1 if grad else 0))
    with compat.x64_scope(True):  # int64 arguments, as for the original
        got = jax.jit(new.call)(*weights, tokens, mask)
        want = exp.call(*weights, tokens, mask)
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)
    if grad:
        _llama_gradient(exp, new, weights, tokens, mask)
    # Without x64 an int64 argument arrives as int32: refused as by the original.
    with pytest.raises(ValueError, match="expected int64"):
        new.call(*weights, jnp.asarray(tokens), jnp.asarray(mask))


def _llama_gradient(exp, new, weights, tokens, mask):
    from flashpass.export.lift import prepare

    with compat.x64_scope(True):
        # The gradient in the weights, against the fixture lifted unrewritten.
        module = compat.parse_module(exp.mlir_module_serialized, compat.mlir_context())
        original = prepare(module).function()

        def loss(call):
            return jax.grad(lambda ws: jnp.sum(call(*ws, tokens, mask)[0] ** 2) * 1e-3)

        g_new = loss(lambda *a: (new.call(*a),))(weights)
        g_old = loss(original)(weights)
    for g, w in zip(g_new, g_old, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------- the splice route on its own


def test_splice_finds_sites_where_the_lift_route_keeps_the_module():
    """A module the lift route cannot lift whole (an int4 weight, a type the
    lifter has no aval for) is still spliced: each candidate product's own
    ops are lifted, and every other op is left as written."""

    def fn(w4, x, q, k, v):
        proj = x @ w4.astype(jnp.float32)
        return _readme_attention(q, k, v), proj

    rng = np.random.default_rng(0)
    w4 = jnp.asarray(rng.integers(-8, 8, (16, 16)), jnp.int4)
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 128, 2, 16)), jnp.float32) for _ in range(3))
    args = (w4, x, q, k, v)
    exp = jax.export.export(jax.jit(fn))(*_structs(args))
    lifted, kept = fx.rewrite_and_explain(exp, kernel="blockwise", backward="lifted")
    assert lifted is exp and kept.route == "kept" and "i4" in kept.kept_reason, str(kept)
    new, report = fx.rewrite_and_explain(exp, route="splice", kernel="blockwise", backward="lifted")
    assert report.route == "splice" and len(report.rewrites) == 1, str(report)
    (site,) = report.sites
    assert site.route == "splice" and "found in its own block" in site.why, str(report)
    assert "i4" in site.why and "site at" in str(report)
    for got, want in zip(new.call(*args), exp.call(*args), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)
    # Its derivative would be the lift route's, which keeps the module: it says so.
    with pytest.raises(ValueError, match="no derivative"):
        new.serialize(vjp_order=1)


def test_splice_in_a_loop_body():
    """A site inside a ``scan`` (a ``while`` body) is not a value of the lifted
    function: it is found again in its own block and spliced there.  JAX 0.10
    puts the body in a function (``@closed_call``); JAX 0.12 writes it in the
    ``while`` body and hoists its constants (the softmax's ``-inf`` init, the
    scale) out of the loop: they are lifted with the cut as constants."""
    exp, args = _exported_spelling("scan_layers")
    new, report = fx.rewrite_and_explain(exp, route="splice", kernel="blockwise", backward="lifted")
    assert report.route == "splice" and len(report.rewrites) == 1, str(report)
    (site,) = report.sites
    assert "found in its own block" in site.why and not report.splice_notes, str(report)
    text = new.mlir_module()
    body = text[text.index("stablehlo.while") :]
    assert "call @_flashpass_splice0_" in body  # the call is in the loop body
    np.testing.assert_allclose(new.call(*args), exp.call(*args), atol=2e-5)


def test_splice_with_an_island():
    """An island (popcnt, no rule) next to a site no longer keeps the splice route."""

    def fn(q, k, v, n):
        return _readme_attention(q, k, v), jax.lax.population_count(n)

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 128, 2, 16)), jnp.float32) for _ in range(3))
    n = jnp.arange(4, dtype=jnp.int32)
    exp = jax.export.export(jax.jit(fn))(*_structs((q, k, v, n)))
    new, report = fx.rewrite_and_explain(exp, route="splice", kernel="blockwise", backward="lifted")
    assert report.route == "splice" and len(report.rewrites) == 1, str(report)
    assert "stablehlo.popcnt" in new.mlir_module()  # left as written
    for got, want in zip(new.call(q, k, v, n), exp.call(q, k, v, n), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


# ---------------------------------------------------------------- called as the original


@pytest.mark.parametrize("route", ROUTES)
def test_int64_inputs_both_routes(route):
    from test_load import _int64_tokens_export

    exp = _int64_tokens_export()
    new, report = fx.rewrite_and_explain(exp, route=route, kernel="blockwise")
    assert report.route == route and report.needs_x64, str(report)
    assert report.to_dict()["needs_x64"] is True
    assert new.in_avals == exp.in_avals and new.out_avals == exp.out_avals
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, (1, 128)).astype(np.int64)
    weights = [rng.standard_normal(s).astype(np.float32) for s in ((50, 16), (16, 16), (16, 16))]
    with compat.x64_scope(True):
        got, want = new.call(tokens, *weights), exp.call(tokens, *weights)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    assert got[1].dtype == want[1].dtype == jnp.int64
    with pytest.raises(ValueError, match="expected int64"):
        new.call(jnp.asarray(tokens), *weights)


def test_a_32_bit_artifact_does_not_need_x64():
    exp, _ = _exported_spelling("einsum_btnh")
    report = fx.explain(exp, kernel="blockwise")
    assert not report.needs_x64 and "x64" not in str(report)


@pytest.mark.parametrize("route", ROUTES)
def test_multi_platform_with_a_sqrt_scale(route):
    x = jax.ShapeDtypeStruct((1, 128, 2, 16), jnp.float32)
    exp = jax.export.export(jax.jit(_readme_attention), platforms=("cpu", "tpu"))(x, x, x)
    new, report = fx.rewrite_and_explain(exp, route=route, kernel="blockwise")
    assert report.route == route and new.platforms == ("cpu", "tpu"), str(report)
    assert all(len(r.rewrites) == 1 for r in report.by_platform.values()), str(report)
    q, k, v = (
        jnp.asarray(np.random.default_rng(i).standard_normal(x.shape), x.dtype) for i in range(3)
    )
    np.testing.assert_allclose(new.call(q, k, v), exp.call(q, k, v), atol=2e-5)
