"""A tiny Hugging Face Llama exported from PyTorch through torchax and through
torch_xla (SDPA and eager attention; tests/export/fixtures/make_fixtures.py),
rewritten here."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass.export as fx
from flashpass import compat
from flashpass.export.lift import prepare

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def _inputs(exp, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for a in exp.in_avals:
        if a.dtype == jnp.bool_:  # torch_xla lifts the True the causal mask is built from
            out.append(jnp.ones(a.shape, a.dtype))
        elif jnp.issubdtype(a.dtype, jnp.integer):
            out.append(jnp.asarray(rng.integers(0, 128, a.shape), a.dtype))
        else:
            out.append(jnp.asarray(rng.standard_normal(a.shape) * 0.2, a.dtype))
    return out


def _original(data):
    """The fixture lifted but not rewritten: the reference, value and gradient."""
    module = compat.parse_module(data, compat.mlir_context())
    return prepare(module).function()


@pytest.mark.parametrize("export_route", ["lift", "splice"])
@pytest.mark.parametrize("route", ["torchax", "torch_xla"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_llama_is_rewritten(route, impl, export_route):
    data = (FIXTURES / f"llama_{impl}_{route}.mlirbc").read_bytes()
    exp = fx.load(data)
    new, report = fx.rewrite_and_explain(exp, kernel="blockwise", route=export_route)
    assert report.route == export_route, str(report)
    assert len(report.rewrites) == 2 and not report.fallbacks, str(report)  # two layers
    if route == "torchax":  # torch_xla's eager mask reaches the scores as a dense bias
        assert all(r.mask == "causal" for r in report.rewrites), str(report)
    new = jax.export.deserialize(new.serialize(vjp_order=1))

    args = _inputs(exp)
    want = exp.call(*args)  # the artifact as PyTorch exported it
    np.testing.assert_allclose(jax.jit(new.call)(*args), want, atol=1e-4)
    if export_route == "splice":
        return  # its derivative is the lift route's, checked below for that route

    # Gradient in the weights (main's float inputs; torch_xla puts the tokens
    # among them) against the fixture lifted but not rewritten (a bare module
    # ships no derivative of its own).
    original = _original(data)
    floats = [i for i, a in enumerate(exp.in_avals) if jnp.issubdtype(a.dtype, jnp.floating)]

    def with_weights(w):
        full = list(args)
        for i, x in zip(floats, w, strict=True):
            full[i] = x
        return full

    def loss_new(w):
        return jnp.sum(new.call(*with_weights(w)) ** 2)

    def loss_original(w):
        (logits,) = original(*with_weights(w))
        return jnp.sum(logits**2)

    weights = [args[i] for i in floats]
    got = jax.jit(jax.grad(loss_new))(weights)
    expected = jax.grad(loss_original)(weights)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=2e-3, rtol=2e-3)
