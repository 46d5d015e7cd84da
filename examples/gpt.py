"""A GPT-style decoder-only transformer in plain JAX (no Flax, no Haiku).

Written the way model code usually is, with nothing arranged for flashpass:
token + position embeddings, pre-LayerNorm blocks, causal multi-head
self-attention (q/k/v projections, ``[B, T, H, Dh]`` heads, ``einsum`` scores,
``jnp.tril`` mask filled with ``finfo.min``, ``jax.nn.softmax``), a GELU MLP,
a final LayerNorm and a tied (or untied) output head.

Parameters are a plain pytree of arrays.  `forward` applies the layers with a
Python loop over ``params["blocks"]`` (a list of per-layer dicts);
`forward_scan` applies them with ``lax.scan`` over the same blocks stacked on
a leading layer axis (`stack_blocks`), as large models do to keep compile
time flat in depth.

The attention output projection ``wo`` is stored as ``[H, Dh, D]`` (as in
T5X/Gemma-style code), so the head count travels with the parameters and
``forward(params, tokens)`` needs no config argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 1024
    d_model: int = 256
    n_heads: int = 8
    n_layers: int = 4
    max_len: int = 2048
    dtype: Any = jnp.float32
    mlp_ratio: int = 4
    tied: bool = True  # output head shares the token embedding

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# --------------------------------------------------------------------------- parameters


class _Init(NamedTuple):
    """How to initialise one parameter: ``normal * std``, or a constant when std is None."""

    shape: tuple
    std: float | None = None
    const: float = 0.0


def _layer_norm_init(d):
    return {"scale": _Init((d,), const=1.0), "bias": _Init((d,))}


def _block_init(cfg: GPTConfig) -> dict:
    d, h, dh = cfg.d_model, cfg.n_heads, cfg.head_dim
    f = cfg.mlp_ratio * d
    # Residual-branch outputs scaled down with depth (GPT-2 style).
    out = 1 / math.sqrt(2 * cfg.n_layers)
    return {
        "ln1": _layer_norm_init(d),
        "attn": {
            "wq": _Init((d, d), d**-0.5),
            "wk": _Init((d, d), d**-0.5),
            "wv": _Init((d, d), d**-0.5),
            "bq": _Init((d,)),
            "bk": _Init((d,)),
            "bv": _Init((d,)),
            "wo": _Init((h, dh, d), d**-0.5 * out),
            "bo": _Init((d,)),
        },
        "ln2": _layer_norm_init(d),
        "mlp": {
            "w1": _Init((d, f), d**-0.5),
            "b1": _Init((f,)),
            "w2": _Init((f, d), f**-0.5 * out),
            "b2": _Init((d,)),
        },
    }


def init_params(key, cfg: GPTConfig) -> dict:
    """Random parameters: ``{"wte", "wpe", "blocks": [per-layer dicts], "ln_f"[, "head"]}``.

    All weights come from one ``jax.random.normal`` draw, sliced: a handful of
    separate draws per layer would take seconds to compile under ``jit``.
    """
    d = cfg.d_model
    specs = {
        "wte": _Init((cfg.vocab, d), 0.02),
        "wpe": _Init((cfg.max_len, d), 0.01),
        "blocks": [_block_init(cfg) for _ in range(cfg.n_layers)],
        "ln_f": _layer_norm_init(d),
    }
    if not cfg.tied:
        specs["head"] = _Init((d, cfg.vocab), d**-0.5)
    leaves, tree = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, _Init))
    total = sum(math.prod(s.shape) for s in leaves if s.std is not None)
    noise = jax.random.normal(key, (total,), jnp.float32)
    params, offset = [], 0
    for s in leaves:
        if s.std is None:
            params.append(jnp.full(s.shape, s.const, cfg.dtype))
            continue
        n = math.prod(s.shape)
        params.append((noise[offset : offset + n].reshape(s.shape) * s.std).astype(cfg.dtype))
        offset += n
    return jax.tree_util.tree_unflatten(tree, params)


def stack_blocks(params: dict) -> dict:
    """``params`` with ``blocks`` stacked on a leading layer axis (for `forward_scan`)."""
    blocks = params["blocks"]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *blocks)
    return {**params, "blocks": stacked}


# --------------------------------------------------------------------------- model


def layer_norm(x, p, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def attention(x, p):
    """Causal multi-head self-attention over ``x [B, T, D]``."""
    B, T, _ = x.shape
    H, Dh, _ = p["wo"].shape
    q = (x @ p["wq"] + p["bq"]).reshape(B, T, H, Dh)
    k = (x @ p["wk"] + p["bk"]).reshape(B, T, H, Dh)
    v = (x @ p["wv"] + p["bv"]).reshape(B, T, H, Dh)

    s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(jnp.asarray(Dh, x.dtype))
    mask = jnp.tril(jnp.ones((T, T), dtype=bool))
    s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
    w = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", w, v)
    return jnp.einsum("bthd,hdm->btm", o, p["wo"]) + p["bo"]


def mlp(x, p):
    return jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def block(x, p):
    x = x + attention(layer_norm(x, p["ln1"]), p["attn"])
    return x + mlp(layer_norm(x, p["ln2"]), p["mlp"])


def _embed(params, tokens):
    T = tokens.shape[1]
    if T > params["wpe"].shape[0]:
        raise ValueError(f"sequence length {T} exceeds max_len {params['wpe'].shape[0]}")
    return params["wte"][tokens] + params["wpe"][:T]


def _head(params, x):
    x = layer_norm(x, params["ln_f"])
    if "head" in params:
        return x @ params["head"]
    return x @ params["wte"].T


def forward(params, tokens):
    """Logits ``[B, T, vocab]`` for ``tokens [B, T]`` (layers in a Python loop)."""
    x = _embed(params, tokens)
    for p in params["blocks"]:
        x = block(x, p)
    return _head(params, x)


def forward_scan(params, tokens):
    """`forward` with the layers applied by ``lax.scan`` over stacked blocks.

    ``params["blocks"]`` is a single dict whose leaves have a leading layer
    axis (see `stack_blocks`).
    """
    x = _embed(params, tokens)

    def body(x, p):
        return block(x, p), None

    x, _ = lax.scan(body, x, params["blocks"])
    return _head(params, x)


def cross_entropy(logits, targets):
    """Mean next-token negative log-likelihood."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)


def loss_fn(params, tokens):
    """Next-token cross entropy: predict ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
    return cross_entropy(forward(params, tokens[:, :-1]), tokens[:, 1:])


def loss_fn_scan(params, tokens):
    """`loss_fn` for stacked parameters (`forward_scan`)."""
    return cross_entropy(forward_scan(params, tokens[:, :-1]), tokens[:, 1:])
