"""Flax: ``linen.dot_product_attention``, ``linen.MultiHeadDotProductAttention``
(self, causal, padding, cross), a scanned + rematerialised linen stack, and
``nnx.MultiHeadAttention``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

B, T, S, D_MODEL, HEADS = 2, 16, 24, 32, 4
LINEN = "flax/linen/attention.py"
NNX = "flax/nnx/nn/attention.py"
STACK_TOL = 5e-5  # two layers deep (measured error: at most 3e-6)


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _lengths_mask(lengths, size):
    return jnp.asarray(np.arange(size)[None, :] < np.asarray(lengths)[:, None])


# --------------------------------------------------------------------------- functional


def test_dot_product_attention(check_model):
    q, k, v = (_normal(i, (B, T, HEADS, 8)) for i in range(3))
    check_model(
        lambda qkv: nn.dot_product_attention(*qkv),
        (q, k, v),
        library="flax.linen",
        case="dot_product_attention",
        sites=1,
        where=LINEN,
    )


def test_dot_product_attention_bias_and_mask(check_model):
    q, k, v = (_normal(i, (B, T, HEADS, 8)) for i in range(3))
    bias = _normal(3, (1, HEADS, T, T))
    keep = _lengths_mask([T, 11], T)[:, None, None, :]
    mask = jnp.logical_and(keep, nn.make_causal_mask(jnp.ones((B, T))))
    check_model(
        lambda p, m: nn.dot_product_attention(p[0], p[1], p[2], bias=p[3], mask=m),
        (q, k, v, bias),
        mask,
        library="flax.linen",
        case="dot_product_attention (bias + causal & padding mask)",
        sites=1,
        where=LINEN,
    )


# ------------------------------------------------------------ MultiHeadDotProductAttention


def _mha():
    return nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D_MODEL)


def test_mha_self(check_model, random_params):
    m, x = _mha(), _normal(0, (B, T, D_MODEL))
    params = random_params(m.init, jax.random.PRNGKey(0), x)
    check_model(
        lambda p, x: m.apply(p, x),
        params,
        x,
        library="flax.linen",
        case="MultiHeadDotProductAttention self",
        sites=1,
        where=LINEN,
    )


def test_mha_causal(check_model, random_params):
    m, x = _mha(), _normal(0, (B, T, D_MODEL))
    params = random_params(m.init, jax.random.PRNGKey(0), x)
    report = check_model(
        lambda p, x: m.apply(p, x, mask=nn.make_causal_mask(x[..., 0])),
        params,
        x,
        library="flax.linen",
        case="MultiHeadDotProductAttention causal (make_causal_mask)",
        sites=1,
        where=LINEN,
    )
    assert all(r.causal for r in report.rewrites), str(report)


def test_mha_padding(check_model, random_params):
    m, x = _mha(), _normal(0, (B, T, D_MODEL))
    params = random_params(m.init, jax.random.PRNGKey(0), x)
    keep = _lengths_mask([T, 9], T)
    mask = nn.make_attention_mask(keep, keep)
    check_model(
        lambda p, x, mask: m.apply(p, x, mask=mask),
        params,
        x,
        mask,
        library="flax.linen",
        case="MultiHeadDotProductAttention padding (make_attention_mask)",
        sites=1,
        where=LINEN,
    )


def test_mha_cross(check_model, random_params):
    m, x, y = _mha(), _normal(0, (B, T, D_MODEL)), _normal(1, (B, S, D_MODEL))
    params = random_params(m.init, jax.random.PRNGKey(0), x, y)
    mask = nn.make_attention_mask(jnp.ones((B, T), bool), _lengths_mask([S, 13], S))
    check_model(
        lambda p, x, y, mask: m.apply(p, x, y, mask=mask),
        params,
        x,
        y,
        mask,
        library="flax.linen",
        case="MultiHeadDotProductAttention cross (T != S, key padding)",
        sites=1,
        where=LINEN,
    )


# --------------------------------------------------------------------------- nn.scan + nn.remat


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        causal = nn.make_causal_mask(x[..., 0])
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(nn.LayerNorm()(x), mask=causal)
        h = nn.Dense(2 * D_MODEL)(nn.LayerNorm()(x))
        return x + nn.Dense(D_MODEL)(nn.gelu(h)), None


class _ScannedStack(nn.Module):
    layers: int = 2

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            nn.remat(_Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        return stack()(x, None)[0]


def test_scan_remat_stack(check_model, random_params):
    m, x = _ScannedStack(), _normal(0, (B, T, D_MODEL))
    params = random_params(m.init, jax.random.PRNGKey(0), x)
    # Two layers, one attention site: the scanned body is traced once.
    check_model(
        m.apply,
        params,
        x,
        library="flax.linen",
        case="nn.scan(nn.remat(block)) x 2 layers",
        sites=1,
        where=LINEN,
        scope="remat",
        tol=STACK_TOL,
    )


# --------------------------------------------------------------------------- nnx


def _nnx_mha():
    mha = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=D_MODEL, decode=False, rngs=nnx.Rngs(0)
    )
    return nnx.split(mha)


def test_nnx_mha_self(check_model):
    graphdef, state = _nnx_mha()
    check_model(
        lambda st, x: nnx.merge(graphdef, st)(x),
        state,
        _normal(0, (B, T, D_MODEL)),
        library="flax.nnx",
        case="nnx.MultiHeadAttention self",
        sites=1,
        where=NNX,
    )


def test_nnx_mha_causal(check_model):
    graphdef, state = _nnx_mha()
    report = check_model(
        lambda st, x: nnx.merge(graphdef, st)(x, mask=nn.make_causal_mask(x[..., 0])),
        state,
        _normal(0, (B, T, D_MODEL)),
        library="flax.nnx",
        case="nnx.MultiHeadAttention causal",
        sites=1,
        where=NNX,
    )
    assert all(r.causal for r in report.rewrites), str(report)
