"""Equinox: ``eqx.nn.MultiheadAttention`` (per-head code under ``jax.vmap``),
called per example and vmapped over the batch, as Equinox models do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip("equinox")

B, T, S, D_MODEL, HEADS = 2, 16, 24, 32, 4
WHERE = "equinox/nn/_attention.py"


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _split_mha():
    mha = eqx.nn.MultiheadAttention(num_heads=HEADS, query_size=D_MODEL, key=jax.random.PRNGKey(0))
    return eqx.partition(mha, eqx.is_inexact_array)


def test_mha_self(check_model):
    params, static = _split_mha()

    def fn(params, x):
        mha = eqx.combine(params, static)
        return jax.vmap(lambda x: mha(x, x, x))(x)

    check_model(
        fn,
        params,
        _normal(0, (B, T, D_MODEL)),
        library="equinox",
        case="nn.MultiheadAttention self (vmap over batch and heads)",
        sites=1,
        where=WHERE,
    )


def test_mha_causal(check_model):
    params, static = _split_mha()

    def fn(params, x):
        mha = eqx.combine(params, static)
        mask = jnp.tril(jnp.ones((T, T), bool))
        return jax.vmap(lambda x: mha(x, x, x, mask=mask))(x)

    report = check_model(
        fn,
        params,
        _normal(0, (B, T, D_MODEL)),
        library="equinox",
        case="nn.MultiheadAttention causal (tril mask)",
        sites=1,
        where=WHERE,
    )
    assert all(r.causal for r in report.rewrites), str(report)


def test_mha_cross_padding(check_model):
    params, static = _split_mha()
    keep = jnp.asarray(np.arange(S)[None, :] < np.array([S, 13])[:, None])

    def fn(params, x, y, keep):
        mha = eqx.combine(params, static)
        return jax.vmap(lambda x, y, k: mha(x, y, y, mask=jnp.broadcast_to(k, (T, S))))(x, y, keep)

    check_model(
        fn,
        params,
        _normal(0, (B, T, D_MODEL)),
        _normal(1, (B, S, D_MODEL)),
        keep,
        library="equinox",
        case="nn.MultiheadAttention cross (T != S, key padding)",
        sites=1,
        where=WHERE,
    )
