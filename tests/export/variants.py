"""Attention programs exported from JAX for the StableHLO tests: each builds its inputs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

B, H, T, S, D = 1, 2, 256, 256, 32


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    fn: object
    shapes: tuple  # ((shape, dtype), ...)
    t: int = T
    s: int = S
    dense_input: bool = False  # an input is itself T×S (a dense bias)
    tol: float = 2e-5

    def structs(self):
        return [jax.ShapeDtypeStruct(s, d) for s, d in self.shapes]

    def args(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        out = []
        for shape, dtype in self.shapes:
            if np.dtype(dtype) == np.dtype(bool):
                x = rng.random(shape) < 0.8
                x[..., 0] = True  # every row keeps a key
                out.append(jnp.asarray(x))
            else:
                out.append(jnp.asarray(rng.standard_normal(shape), dtype))
        return out


def _softmax_attend(s, v, spec="bhqk,bkhd->bqhd"):
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum(spec, p.astype(v.dtype), v)


def _scores(q, k, scale=D**-0.5):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale


def plain(q, k, v):
    return _softmax_attend(_scores(q, k), v)


def causal(q, k, v):
    s = _scores(q, k)
    mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    return _softmax_attend(jnp.where(mask, s, -jnp.inf), v)


def padding(q, k, v, keep):
    s = _scores(q, k)
    return _softmax_attend(jnp.where(keep[:, None, None, :], s, -1e9), v)


def bias(q, k, v, b):
    return _softmax_attend(_scores(q, k) + b, v)


def gqa(q, k, v):
    g = q.shape[2] // k.shape[2]
    qg = q.reshape(q.shape[0], q.shape[1], k.shape[2], g, q.shape[3])
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) * D**-0.5
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v)
    return o.reshape(q.shape)


def scaled_q(q, k, v):
    return _softmax_attend(jnp.einsum("bqhd,bkhd->bhqk", q * 0.3, k), v)


def softcap(q, k, v):
    s = _scores(q, k)
    return _softmax_attend(jnp.tanh(s / 30.0) * 30.0, v)


def window(q, k, v):
    s = _scores(q, k)
    i = lax.broadcasted_iota(jnp.int32, (q.shape[1], k.shape[1]), 0)
    j = lax.broadcasted_iota(jnp.int32, (q.shape[1], k.shape[1]), 1)
    mask = (j <= i) & (i - j < 64)
    return _softmax_attend(jnp.where(mask, s, -jnp.inf), v)


def heads_first(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(D)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def nn_dot_product(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def bf16_causal(q, k, v):
    return causal(q, k, v)


F32 = jnp.float32
QKV = ((B, T, H, D), F32)
VARIANTS = [
    Variant("plain", plain, (QKV, QKV, QKV)),
    Variant("causal", causal, (QKV, QKV, QKV)),
    Variant("padding", padding, (QKV, QKV, QKV, ((B, S), jnp.bool_))),
    Variant("bias", bias, (QKV, QKV, QKV, ((B, H, T, S), F32)), dense_input=True),
    Variant("gqa", gqa, (((B, T, 4, D), F32), ((B, S, 1, D), F32), ((B, S, 1, D), F32))),
    Variant(
        "cross",
        plain,
        (((B, 128, H, D), F32), ((B, 512, H, D), F32), ((B, 512, H, D), F32)),
        t=128,
        s=512,
    ),
    Variant(
        "bf16",
        bf16_causal,
        (((B, T, H, D), jnp.bfloat16),) * 3,
        tol=3e-2,
    ),
    Variant("scaled_q", scaled_q, (QKV, QKV, QKV)),
    Variant("softcap", softcap, (QKV, QKV, QKV)),
    Variant("window", window, (QKV, QKV, QKV)),
    Variant("heads_first", heads_first, ((((B, H, T, D), F32),) * 3)),
    Variant("nn_dot_product", nn_dot_product, (QKV, QKV, QKV)),
]


# --------------------------------------------------------------------------- negatives


def softmax_over_queries(q, k, v):
    s = _scores(q, k)
    p = jax.nn.softmax(s, axis=-2)  # normalised over queries: not attention
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def unnormalised(q, k, v):
    s = _scores(q, k)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - s.max(-1, keepdims=True)), v)


NEGATIVES = [
    Variant("softmax_over_queries", softmax_over_queries, (QKV, QKV, QKV)),
    Variant("unnormalised", unnormalised, (QKV, QKV, QKV)),
]
