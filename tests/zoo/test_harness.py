"""The zoo harness's classification of a mode that has no input to run."""

from __future__ import annotations

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
