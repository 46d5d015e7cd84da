"""The splice route: only the sites' ops are replaced, the rest of the module is kept."""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from variants import NEGATIVES, VARIANTS

import flashpass.export as fx
from flashpass import compat
from flashpass.kernels.blockwise import BlockwiseKernel

from jax_versions import requires_triton

KERNEL = BlockwiseKernel(block_q=64, block_k=64)
BY_NAME = {v.name: v for v in VARIANTS}
T = S = 256


def _functions(text: str) -> dict:
    """Each ``func.func``'s text, by name, without locations (their aliases,
    ``#loc12``, are numbered afresh each time a module is printed)."""
    out, name, lines = {}, None, []
    for line in text.splitlines():
        line = re.sub(r" loc\((#loc\d*|\"[^\"]*\"|unknown)\)", "", line)
        found = re.match(r"\s*func\.func (?:public |private )?@([\w.$-]+)", line)
        if found:
            name, lines = found.group(1), []
        if name is not None:
            lines.append(line)
            if line.startswith("  }"):
                out[name], name = "\n".join(lines), None
    return out


def _ops(function_text: str) -> list:
    """``(op, types)`` of each op line, without SSA names or locations."""
    out = []
    for line in function_text.splitlines()[1:]:
        found = re.match(r"\s*(?:%[\w#:, ]+ = )?\"?([a-z_]+\.[a-z_]+|call|return)\b", line)
        if found:
            types = line.split(" : ")[-1].split(" loc(")[0] if " : " in line else ""
            out.append((found.group(1), types))
    return out


def _txs(ops) -> list:
    return [op for op in ops if f"{T}x{S}x" in op[1]]


def _is_subsequence(small, big) -> bool:
    it = iter(big)
    return all(any(x == y for y in it) for x in small)


@pytest.mark.parametrize("name", ["plain", "causal", "gqa", "bias", "padding"])
def test_splice_variants(name):
    variant = BY_NAME[name]
    exp = jax.export.export(jax.jit(variant.fn))(*variant.structs())
    new, report = fx.rewrite_and_explain(exp, backward="lifted", route="splice", kernel=KERNEL)
    assert report.route == "splice" and len(report.rewrites) == 1, str(report)
    assert report.rewrites[0].kernel == "blockwise"
    new = jax.export.deserialize(new.serialize())
    assert new.in_avals == exp.in_avals and new.out_avals == exp.out_avals
    assert new.platforms == exp.platforms and new.in_tree == exp.in_tree

    args = variant.args()
    np.testing.assert_allclose(
        np.asarray(new.call(*args), np.float32),
        np.asarray(exp.call(*args), np.float32),
        atol=variant.tol,
        rtol=0,
    )
    before, after = _functions(exp.mlir_module()), _functions(new.mlir_module())
    main = _ops(after["main"])
    assert "call @_flashpass_splice0_" in after["main"]
    assert any("blockwise" in f for f in after), list(after)
    # The original's T×S products and exponentials are gone from its functions.
    assert _txs(_ops(before["main"])), "the original holds T×S ops"
    assert not _txs(main if not variant.dense_input else [op for op in main if op[0] != "call"])
    # What remains of main is the original's, in order, around one call.
    kept = [op for op in main if op[0] != "call"]
    assert _is_subsequence(kept, _ops(before["main"]))
    assert Counter(op for op, _ in main)["call"] == 1


def _two_layers(x, wq, wk, wv, wo):
    """Projections around two attention layers, the second reading the first."""

    @jax.jit
    def project(x, w):  # a function of its own in the module: kept byte for byte
        return jnp.tanh(x @ w)

    def attend(h):
        q, k, v = (project(h, w).reshape(1, T, 2, 16) for w in (wq, wk, wv))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
        return o.reshape(1, T, 32) @ wo

    return attend(attend(x)) + x


def _two_layer_args():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, T, 32)).astype(np.float32)
    ws = [rng.standard_normal((32, 32)).astype(np.float32) * 0.2 for _ in range(4)]
    return x, *ws


def test_surroundings_are_kept_byte_for_byte():
    args = _two_layer_args()
    exp = jax.export.export(jax.jit(_two_layers))(
        *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    )
    new, report = fx.rewrite_and_explain(exp, backward="lifted", route="splice", kernel=KERNEL)
    assert report.route == "splice" and len(report.rewrites) == 2, str(report)
    np.testing.assert_allclose(new.call(*args), exp.call(*args), atol=1e-4, rtol=0)
    before, after = _functions(exp.mlir_module()), _functions(new.mlir_module())
    spliced = {f for f in after if f.startswith("_flashpass_splice")}
    assert {f[: len("_flashpass_spliceN")] for f in spliced} == {
        "_flashpass_splice0",
        "_flashpass_splice1",
    }
    for name, text in before.items():  # every function but main, textually unchanged
        if name != "main":
            assert after[name] == text, name
    assert set(after) - spliced == set(before)
    old_main, new_main = _ops(before["main"]), _ops(after["main"])
    assert (
        Counter(op for op, _ in new_main)["call"] == Counter(op for op, _ in old_main)["call"] + 2
    )
    kept = [op for op in new_main if not (op[0] == "call" and op not in old_main)]
    assert _is_subsequence(kept, old_main)
    assert not _txs(new_main) and _txs(old_main)
    # The projections and the output products outside the sites are all still there.
    outside = [
        op for op in old_main if op[0] == "stablehlo.dot_general" and f"{T}x{S}" not in op[1]
    ]
    assert [op for op in new_main if op[0] == "stablehlo.dot_general"] == outside


def test_a_site_that_cannot_be_spliced_is_kept_and_noted(monkeypatch):
    """Of two sites, one whose export fails (simulated) is kept as written and
    listed in ``splice_notes``; the other is spliced, and the result still
    computes the original."""
    args = _two_layer_args()
    exp = jax.export.export(jax.jit(_two_layers))(
        *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    )
    real, calls = jax.export.export, []

    def export(fn, **kw):
        calls.append(kw)
        if len(calls) == 1:  # the first site spliced (the downstream one)
            raise NotImplementedError("simulated")
        return real(fn, **kw)

    monkeypatch.setattr(jax.export, "export", export)
    new, report = fx.rewrite_and_explain(exp, backward="lifted", route="splice", kernel=KERNEL)
    monkeypatch.undo()
    assert report.route == "splice" and len(report.rewrites) == 1, str(report)
    assert len(report.splice_notes) == 1 and "simulated" in report.splice_notes[0]
    assert "not spliced (kept as written)" in str(report)
    main = _functions(new.mlir_module())["main"]
    assert "_flashpass_splice0_" in main and "_flashpass_splice1_" not in main  # one call
    assert _txs(_ops(main))  # the kept site's T x S ops are still there
    np.testing.assert_allclose(new.call(*args), exp.call(*args), atol=1e-4, rtol=0)


def test_no_site_is_returned_unchanged():
    variant = NEGATIVES[0]
    exp = jax.export.export(jax.jit(variant.fn))(*variant.structs())
    new, report = fx.rewrite_and_explain(exp, backward="lifted", route="splice", kernel=KERNEL)
    assert new is exp
    assert report.route == "kept" and "no attention site" in report.kept_reason, str(report)
    assert "kept unchanged" in str(report)


def test_multi_platform_each_platform_gets_its_kernel():
    """A ("cpu", "tpu") artifact: the call passes the platform index to a joined
    export, whose TPU branch holds the Pallas kernel's custom call."""
    shape = (1, T, 2, 128)
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    causal = BY_NAME["causal"].fn
    exp = jax.export.export(jax.jit(causal), platforms=("cpu", "tpu"))(x, x, x)
    new, report = fx.rewrite_and_explain(
        exp, backward="lifted", route="splice", kernel=["splash", "blockwise"]
    )
    assert report.route == "splice", str(report)
    assert report.by_platform["tpu"].kernels == ["splash"], str(report)
    assert report.by_platform["cpu"].kernels == ["blockwise"], str(report)
    # The derivative (the lift route's) has TPU's kernel backward too.
    vjp = jax.export.deserialize(new.serialize(vjp_order=1)).vjp()
    assert "tpu_custom_call" in vjp.mlir_module()
    new = jax.export.deserialize(new.serialize())
    assert new.platforms == ("cpu", "tpu") and new.in_avals == exp.in_avals
    text = new.mlir_module()
    assert "stablehlo.custom_call @tpu_custom_call" in text
    assert "tpu_custom_call" not in exp.mlir_module()
    before, after = _functions(exp.mlir_module()), _functions(text)
    main = after["main"]
    assert "call @_flashpass_splice0_main(%arg0, %arg1, %arg2, %arg3)" in main
    assert not _txs(_ops(main)) and _txs(_ops(before["main"]))
    assert "stablehlo.case" not in main  # the platform cases around the products went too
    # tril and _where, called only by the cut's ops, went with them (tril's
    # T×S types too); any other function is kept as it was.
    assert "tril" in before and "tril" not in after
    for name, body in before.items():
        if name != "main" and name in after:
            assert after[name] == body, name
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    np.testing.assert_allclose(jax.jit(new.call)(q, k, v), causal(q, k, v), atol=2e-5)


@requires_triton
def test_a_platform_this_host_cannot_emit_keeps_the_site():
    """Pallas GPU's Triton call cannot be exported (no compatibility guarantee):
    the site is kept, and the report says why."""
    x = jax.ShapeDtypeStruct((1, T, 2, 128), jnp.float32)
    exp = jax.export.export(jax.jit(BY_NAME["causal"].fn), platforms=("cpu", "cuda"))(x, x, x)
    new, report = fx.rewrite_and_explain(
        exp, backward="lifted", route="splice", kernel=["pallas_gpu", "blockwise"]
    )
    assert new is exp and report.route == "kept", str(report)
    assert "cuda kernel cannot be exported from this host" in report.kept_reason


def test_an_export_failure_for_one_platform_keeps_the_site(monkeypatch):
    """Whatever the kernel, a cut whose export fails for one platform (on JAX
    0.11.1+ no kernel of this host's fails for cuda, so it is simulated) keeps
    the site on every platform, with the error in the reason."""
    x = jax.ShapeDtypeStruct((1, T, 2, 128), jnp.float32)
    exp = jax.export.export(jax.jit(BY_NAME["causal"].fn), platforms=("cpu", "cuda"))(x, x, x)
    real = jax.export.export

    def export(fn, *, platforms=None, **kw):
        if platforms == ("cuda",):
            raise NotImplementedError("no cuda lowering here")
        return real(fn, platforms=platforms, **kw)

    monkeypatch.setattr(jax.export, "export", export)
    new, report = fx.rewrite_and_explain(exp, backward="lifted", route="splice", kernel="blockwise")
    assert new is exp and report.route == "kept", str(report)
    assert "cuda kernel cannot be exported from this host" in report.kept_reason
    assert "no cuda lowering here" in report.kept_reason


@pytest.mark.parametrize("name", ["causal", "gqa"])
def test_the_derivative_is_the_lift_routes(name):
    """``serialize(vjp_order=1)`` ships the lift route's VJP of the same
    function: ``jax.grad`` matches the original's, with no T×S array."""
    from txs import txs_shapes

    variant = BY_NAME[name]
    exp = jax.export.export(jax.jit(variant.fn))(*variant.structs())
    new = jax.export.deserialize(
        fx.rewrite(exp, backward="lifted", route="splice", kernel=KERNEL).serialize(vjp_order=1)
    )
    assert new.has_vjp() and "call @_flashpass_splice0_" in new.mlir_module()
    args = variant.args()

    def loss(f):
        return lambda *a: jnp.sum(f(*a) ** 2)

    grad_new = jax.jit(jax.grad(loss(new.call), argnums=(0, 1, 2)))
    want = jax.grad(loss(variant.fn), argnums=(0, 1, 2))(*args)
    for g, w in zip(grad_new(*args), want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)
    assert not txs_shapes(grad_new.lower(*args).compile().as_text(), variant.t, variant.s)


def test_int64_artifacts_are_spliced_too():
    """64-bit types are kept (the x64 scope of the lift route applies to splice)."""

    def fn(tokens, table):
        x = table[tokens][:, :, None, :]
        s = jnp.einsum("bqhd,bkhd->bhqk", x, x) * 0.25
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), x), tokens.sum()

    structs = (jax.ShapeDtypeStruct((1, T), jnp.int64), jax.ShapeDtypeStruct((50, 16), jnp.float32))
    with compat.x64_scope(True):
        exp = jax.export.export(jax.jit(fn))(*structs)
    new, report = fx.rewrite_and_explain(exp, backward="lifted", route="splice", kernel=KERNEL)
    assert report.route == "splice", str(report)
    assert new.in_avals == exp.in_avals and new.out_avals == exp.out_avals
    tokens = np.arange(T, dtype=np.int64).reshape(1, T) % 50
    table = np.random.default_rng(0).standard_normal((50, 16)).astype(np.float32)
    with compat.x64_scope(True):
        got, want = new.call(tokens, table), exp.call(tokens, table)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    assert got[1] == want[1]


def test_unknown_route():
    variant = BY_NAME["plain"]
    exp = jax.export.export(jax.jit(variant.fn))(*variant.structs())
    with pytest.raises(ValueError, match="route"):
        fx.rewrite(exp, backward="lifted", route="graft")
