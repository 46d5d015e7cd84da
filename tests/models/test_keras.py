"""Keras 3 with the JAX backend: ``keras.layers.MultiHeadAttention`` through
``stateless_call`` (the functional form JAX training loops use).

Keras takes two paths: without attention dropout it calls
``ops.dot_product_attention`` (keras/src/backend/jax/nn.py); with
``dropout > 0`` (here in inference, where dropout is the identity) it spells
attention out with einsums and its masked ``Softmax`` layer.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover - conftest sets KERAS_BACKEND
    pytest.skip("keras is not using the JAX backend", allow_module_level=True)

B, T, S, D_MODEL, HEADS = 2, 16, 24, 32, 4
WHERE = "keras/src/"


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _layer(dropout=0.0, kv_len=T):
    layer = keras.layers.MultiHeadAttention(
        num_heads=HEADS, key_dim=D_MODEL // HEADS, dropout=dropout, seed=0
    )
    layer.build((B, T, D_MODEL), (B, kv_len, D_MODEL))
    rng = np.random.default_rng(0)
    params = [
        jnp.asarray(rng.standard_normal(v.shape) / np.sqrt(v.shape[0]), jnp.float32)
        if len(v.shape) >= 2
        else jnp.asarray(0.1 * rng.standard_normal(v.shape), jnp.float32)
        for v in layer.trainable_variables
    ]
    state = [v.value for v in layer.non_trainable_variables]
    return layer, params, state


def _padding(kv_len=T):
    keep = np.arange(kv_len)[None, :] < np.array([kv_len, 9])[:, None]
    return jnp.asarray(np.repeat(keep[:, None, :], T, axis=1))  # [B, T, S]


def _check(check_model, case, *, dropout=0.0, causal=False, mask=None, kv_len=T):
    layer, params, state = _layer(dropout, kv_len)
    x, y = _normal(0, (B, T, D_MODEL)), _normal(1, (B, kv_len, D_MODEL))

    def fn(params, x, y, *mask):
        out, _ = layer.stateless_call(
            params,
            state,
            x,
            y,
            attention_mask=mask[0] if mask else None,
            use_causal_mask=causal,
            training=False,
        )
        return out

    return check_model(
        fn,
        params,
        x,
        y,
        *(() if mask is None else (mask,)),
        library="keras",
        case=case,
        sites=1,
        where=WHERE,
    )


def test_mha_self(check_model):
    _check(check_model, "MultiHeadAttention self")


def test_mha_causal(check_model):
    report = _check(check_model, "MultiHeadAttention use_causal_mask", causal=True)
    assert all(r.causal for r in report.rewrites), str(report)


def test_mha_padding(check_model):
    _check(check_model, "MultiHeadAttention padding mask", mask=_padding())


def test_mha_cross(check_model):
    _check(check_model, "MultiHeadAttention cross (T != S)", kv_len=S)


def test_mha_dropout_inference_self(check_model):
    _check(check_model, "MultiHeadAttention dropout=0.1, inference, self", dropout=0.1)


def test_mha_dropout_inference_causal(check_model):
    _check(
        check_model,
        "MultiHeadAttention dropout=0.1, inference, use_causal_mask",
        dropout=0.1,
        causal=True,
    )


def test_mha_dropout_inference_padding(check_model):
    _check(
        check_model,
        "MultiHeadAttention dropout=0.1, inference, padding mask",
        dropout=0.1,
        mask=_padding(),
    )
