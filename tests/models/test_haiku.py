"""Haiku: ``hk.MultiHeadAttention`` (self, causal, padding) under ``hk.transform``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hk = pytest.importorskip("haiku")

B, T, D_MODEL, HEADS = 2, 16, 32, 4
WHERE = "haiku/_src/attention.py"


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _transformed(mask_fn=None):
    def forward(x, *mask_args):
        mha = hk.MultiHeadAttention(
            num_heads=HEADS,
            key_size=D_MODEL // HEADS,
            w_init=hk.initializers.VarianceScaling(1.0),
        )
        mask = mask_fn(*mask_args) if mask_fn is not None else None
        return mha(x, x, x, mask=mask)

    return hk.without_apply_rng(hk.transform(forward))


def _check(check_model, random_params, model, case, *mask_args):
    x = _normal(0, (B, T, D_MODEL))
    params = random_params(model.init, jax.random.PRNGKey(0), x, *mask_args)
    return check_model(
        model.apply,
        params,
        x,
        *mask_args,
        library="haiku",
        case=case,
        sites=1,
        where=WHERE,
    )


def test_mha_self(check_model, random_params):
    _check(check_model, random_params, _transformed(), "MultiHeadAttention self")


def test_mha_causal(check_model, random_params):
    model = _transformed(lambda: jnp.tril(jnp.ones((1, 1, T, T))))
    report = _check(check_model, random_params, model, "MultiHeadAttention causal (tril mask)")
    assert all(r.causal for r in report.rewrites), str(report)


def test_mha_padding(check_model, random_params):
    keep = jnp.asarray(np.arange(T)[None, :] < np.array([T, 9])[:, None])
    model = _transformed(lambda keep: keep[:, None, None, :])
    _check(check_model, random_params, model, "MultiHeadAttention padding mask", keep)
