"""The zoo harness: the classification of a mode that has no input to run, and
the export modes' gradient check against the original artifact's."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.zoo import harness
from benchmarks.zoo.model import Built, ZooModel


def _attention(params, x):
    s = jnp.einsum("btd,bsd->bts", x, x) / 4.0
    out = jax.nn.softmax(s, axis=-1) @ x
    # A host callback: jax.export refuses to serialize it.
    return jax.pure_callback(lambda y: y, jax.ShapeDtypeStruct(out.shape, out.dtype), out)


def _model():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 16)), jnp.float32)
    built = Built(forward=_attention, params={}, inputs=(x,), seq=(32, 32))
    return ZooModel("jax_native", "callback", "test", lambda: built, ("direct", "export"))


@pytest.mark.parametrize("mode", ["export_lift", "export_splice"])
def test_an_artifact_jax_cannot_export_is_unavailable_not_an_error(mode):
    (rec,) = harness.run_model(_model(), modes=[mode])
    assert rec["status"] == "unavailable", rec
    assert rec["error"].startswith("jax.export: "), rec["error"]
    (direct,) = harness.run_model(_model(), modes=["direct"])
    assert direct["status"] == "ok" and direct["rewritten"] == 1, direct


def _plain(params, x):
    s = jnp.einsum("btd,bsd->bts", x, x) / 4.0
    return jax.nn.softmax(s, axis=-1) @ x


def _broken(params, x):
    # What torchax raises for a model it cannot run ("mixed math" of torch and
    # torchax tensors): the original fails on its own, before flashpass.
    raise AssertionError("Expect a Tensor or a View but got <class 'torch.Tensor'>")


def _zoo(forward, modes):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 16)), jnp.float32)
    loss = lambda p, x: jnp.sum(forward(p, x))  # noqa: E731
    built = Built(forward=forward, params={}, inputs=(x,), loss=loss, seq=(32, 32))
    return ZooModel("jax_native", "plain", "test", lambda: built, modes)


@pytest.mark.parametrize("mode", ["direct", "jit", "train"])
def test_a_model_whose_original_fails_is_unavailable_not_an_error(mode):
    (rec,) = harness.run_model(_zoo(_broken, ("direct", "jit", "train")), modes=[mode])
    assert rec["status"] == "unavailable", rec
    assert "fails without flashpass: AssertionError" in rec["error"], rec["error"]


def test_a_pass_error_on_a_runnable_artifact_stays_an_error(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("a bug of the pass")

    monkeypatch.setattr(harness.flashpass.export, "rewrite_and_explain", boom)
    (rec,) = harness.run_model(_zoo(_plain, ("export",)), modes=["export_lift"])
    assert rec["status"] == "error" and "a bug of the pass" in rec["error"], rec


def test_a_pass_error_on_an_artifact_that_cannot_run_is_unavailable(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("CHLO => StableHLO failed")

    monkeypatch.setattr(harness.flashpass.export, "rewrite_and_explain", boom)
    monkeypatch.setattr(jax.export.Exported, "call", boom)
    (rec,) = harness.run_model(_zoo(_plain, ("export",)), modes=["export_lift"])
    assert rec["status"] == "unavailable", rec
    assert rec["error"].startswith("the original artifact fails without flashpass"), rec


def _weighted(params, x):
    q = x * params["w"]
    s = jnp.einsum("btd,bsd->bts", q, x) / 4.0
    return jax.nn.softmax(s, axis=-1) @ x


def _weighted_zoo():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 32, 16)), jnp.float32)
    params = {"w": jnp.asarray(rng.standard_normal((16,)), jnp.float32), "n": jnp.int32(3)}
    built = Built(forward=_weighted, params=params, inputs=(x,), seq=(32, 32))
    return ZooModel("jax_native", "weighted", "test", lambda: built, ("export",)), built


@pytest.mark.parametrize("mode", ["export_lift", "export_splice"])
def test_an_export_mode_compares_the_gradient_with_the_original_artifacts(mode):
    model, _ = _weighted_zoo()
    (rec,) = harness.run_model(model, modes=[mode])
    assert rec["status"] == "ok" and rec["rewritten"] == 1, rec
    assert rec["grad_err"] is not None and rec["grad_err"] < 1e-4, rec


def test_an_export_whose_gradient_differs_fails(monkeypatch):
    model, _ = _weighted_zoo()
    real = harness.flashpass.export.rewrite_and_explain

    def wrong_gradient(exp, **kwargs):
        # The rewritten artifact's values, half its gradient in the params:
        # the forward check alone would pass it.
        new, report = real(exp, **kwargs)

        @jax.custom_vjp
        def call(params, x):
            return new.call(params, x)

        def fwd(params, x):
            return call(params, x), (params, x)

        def bwd(res, g):
            gp, gx = jax.vjp(new.call, *res)[1](g)
            half = lambda t: t if t.dtype == jax.dtypes.float0 else 0.5 * t  # noqa: E731
            return jax.tree_util.tree_map(half, gp), gx

        call.defvjp(fwd, bwd)
        return types.SimpleNamespace(call=call, mlir_module=new.mlir_module), report

    monkeypatch.setattr(harness.flashpass.export, "rewrite_and_explain", wrong_gradient)
    (rec,) = harness.run_model(model, modes=["export_lift"])
    assert rec["fwd_err"] < 1e-5, rec
    assert rec["status"] == "fail" and "gradient numerics" in rec["problems"], rec


def _mlp(params, x):
    return jax.nn.gelu(x @ params["w"]) @ params["w"].T


def test_an_artifact_without_attention_keeps_nothing():
    # route "kept" (nothing rewritten) on a program with no site and no report
    # entry: no kept site to count (CoaT's factorised attention is no site)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 16)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((16, 16)), jnp.float32)
    built = Built(forward=_mlp, params={"w": w}, inputs=(x,), seq=(32, 32))
    model = ZooModel("jax_native", "mlp", "test", lambda: built, ("direct", "export"))
    for rec in harness.run_model(model, modes=["export_splice", "export_lift"]):
        assert rec["status"] == "ok" and rec["sites"] == 0 and not rec["kept"], rec


def _dense_mask(params, x):
    t = x.shape[1]
    s = jnp.einsum("btd,bsd->bts", x, x) / 4.0
    keep = jnp.tril(jnp.ones((t, t), bool)) | (x[:, :, :1] > 0)  # varies over data: dense
    return jax.nn.softmax(jnp.where(keep, s, -1e9), axis=-1) @ x


@pytest.mark.parametrize("mode", ["export_lift", "export_splice"])
def test_an_export_mode_measures_dense_kernel_operands(mode):
    """As the other modes do, from the kernel calls in the rewritten module."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 16)), jnp.float32)
    built = Built(forward=_dense_mask, params={}, inputs=(x,), seq=(32, 32))
    model = ZooModel("jax_native", "dense", "test", lambda: built, ("direct", "export"))
    (rec,) = harness.run_model(model, modes=[mode])
    assert rec["status"] == "ok" and rec["rewritten"] == 1, rec
    assert rec["dense_operands"] == [[2, 1, 32, 32]], rec  # the [B, H|1, T, S] mask
    (plain,) = harness.run_model(_zoo(_plain, ("export",)), modes=[mode])
    assert plain["dense_operands"] == [], plain
