"""Score axes that reshapes move or split: one query; heads mixed.

* One query (``T = 1``: a decode step, a class token attending to the
  patches): PyTorch's ``bmm`` on ``[B·H, 1, D]`` operands, viewed back as
  ``[B, H, 1, S]``.  A reshape places the size-1 query axis anywhere (or
  nowhere); the regrouping keeps its role (patterns/regroup.py), while real
  axes are still regrouped by roles only.
* Talking-heads attention (CaiT) mixes heads before the softmax: kept, and
  the report says so.

Every positive case: rewritten on its first call under ``jax.jit``, forward
and gradient equal to the original's; every near miss kept, with its reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.testing import assert_same_function

B, H, D = 2, 3, 8
S = 20
NEG = float(jnp.finfo(jnp.float32).min)


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _matmul4(x, y):
    """``torch.matmul`` on 4-D operands as PyTorch decomposes it."""
    b, h = x.shape[:2]
    out = jnp.matmul(x.reshape(b * h, *x.shape[2:]), y.reshape(b * h, *y.shape[2:]))
    return out.reshape(b, h, *out.shape[1:])


# --------------------------------------------------------------------------- one query


def decode_step(q, k_cache, v_cache, position):
    # Hugging Face eager attention, one generated token over a static cache:
    # GQA keys repeated to the query heads, the cache slots past the position hidden.
    b, kv, s, d = k_cache.shape
    rep = q.shape[1] // kv
    k = jnp.broadcast_to(k_cache[:, :, None], (b, kv, rep, s, d)).reshape(b, kv * rep, s, d)
    v = jnp.broadcast_to(v_cache[:, :, None], (b, kv, rep, s, d)).reshape(b, kv * rep, s, d)
    mask = jnp.where(jnp.arange(s)[None, :] <= position, 0.0, NEG)[None, None]
    w = _matmul4(q, jnp.swapaxes(k, 2, 3)) * d**-0.5 + mask
    p = jax.nn.softmax(w.astype(jnp.float32), axis=-1).astype(q.dtype)
    return _matmul4(p, v)


def _decode(rng):
    hkv = 1 if H % 2 else 2
    return (
        _normal(rng, B, H, 1, D),
        _normal(rng, B, hkv, S, D),
        _normal(rng, B, hkv, S, D),
        jnp.asarray(11, jnp.int32),
    )


def class_attention(x, wq, wk, wv):
    # timm's ClassAttn (CaiT, XCiT, VOLO) through torchax's SDPA reference: the
    # class token is the only query, a zeros(1, N) bias, matmul decomposed.
    b, n, c = x.shape
    q = (x[:, 0] @ wq)[:, None].reshape(b, 1, H, c // H).transpose(0, 2, 1, 3)
    k = (x @ wk).reshape(b, n, H, c // H).transpose(0, 2, 1, 3)
    v = (x @ wv).reshape(b, n, H, c // H).transpose(0, 2, 1, 3)
    w = _matmul4(q, jnp.swapaxes(k, -1, -2)) * (c // H) ** -0.5 + jnp.zeros((1, n), x.dtype)
    out = _matmul4(jax.nn.softmax(w, axis=-1), v)
    return out.transpose(0, 2, 1, 3).reshape(b, 1, c)


def _tokens(rng):
    return (_normal(rng, B, S, H * D), *(_normal(rng, H * D, H * D) / 4 for _ in range(3)))


def query_squeezed(q, k, v):
    # The one query axis squeezed by a reshape ([B·H, 1, S] -> [B, H, S]) and
    # never given back: a matrix-vector P·V.
    s = jnp.matmul(q.reshape(B * H, 1, D), jnp.swapaxes(k.reshape(B * H, S, D), 1, 2))
    p = jax.nn.softmax(s.reshape(B, H, S) * 0.3, axis=-1)
    return jnp.einsum("bhs,bhsd->bhd", p, v)


def query_moved(q, k, v):
    # Scores laid out [B, H, S, 1] (the unit query axis last), viewed as
    # [B, H, 1, S] for the decomposed matmul with v.
    s = jnp.einsum("bhtd,bhsd->bhst", q, k) * 0.3
    p = jax.nn.softmax(s, axis=2).reshape(B, H, 1, S)
    return _matmul4(p, v)


def _bhsd(rng, t=1):
    return _normal(rng, B, H, t, D), _normal(rng, B, H, S, D), _normal(rng, B, H, S, D)


POSITIVE = {
    "decode_step": (decode_step, _decode, 3),
    "class_attention": (class_attention, _tokens, 4),
    "query_squeezed": (query_squeezed, _bhsd, 3),
    "query_moved": (query_moved, _bhsd, 3),
}


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_rewritten_on_the_first_call_under_jit(name, rng):
    fn, make, n = POSITIVE[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    got = jax.jit(opt)(*args)  # the first call
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    np.testing.assert_allclose(got, fn(*args), rtol=2e-5, atol=2e-5)
    assert_same_function(fn, flashpass.optimize(fn, kernel="blockwise"), *args, argnums=range(n))


# --------------------------------------------------------------------------- near misses


def one_query_keys_merged_with_heads(q, k, v):
    # One query, the scores viewed as [B, H·S]: the softmax normalises over
    # every head's keys together. Not attention per head.
    s = jnp.matmul(q.reshape(B * H, 1, D), jnp.swapaxes(k.reshape(B * H, S, D), 1, 2))
    p = jax.nn.softmax(s.reshape(B, H * S), axis=-1).reshape(B * H, 1, S)
    return jnp.matmul(p, v.reshape(B * H, S, D))


def two_queries_merged_with_heads(q, k, v):
    # Two queries (not one) viewed merged with the heads and back: a real
    # regrouping of the query axis, which only size-1 axes may undergo.
    s = jnp.matmul(q.reshape(B * H, 2, D), jnp.swapaxes(k.reshape(B * H, S, D), 1, 2))
    s = s.reshape(B, H * 2, S) * 0.3
    p = jax.nn.softmax(s, axis=-1).reshape(B * H, 2, S)
    return jnp.matmul(p, v.reshape(B * H, S, D))


def talking_heads(x, wqkv, wl, ww):
    # CaiT's TalkingHeadAttn: the scores mixed across heads by a linear layer
    # before the softmax (and the weights after it).
    b, n, c = x.shape
    qkv = (x @ wqkv).reshape(b, n, 3, H, c // H).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv[0] * (c // H) ** -0.5, qkv[1], qkv[2]
    attn = _matmul4(q, jnp.swapaxes(k, -1, -2))
    attn = jnp.einsum("...a,ba->...b", attn.transpose(0, 2, 3, 1), wl).transpose(0, 3, 1, 2)
    attn = jax.nn.softmax(attn, axis=-1)
    attn = jnp.einsum("...a,ba->...b", attn.transpose(0, 2, 3, 1), ww).transpose(0, 3, 1, 2)
    return _matmul4(attn, v).transpose(0, 2, 1, 3).reshape(b, n, c)


def _talking(rng):
    c = H * D
    return (
        _normal(rng, B, S, c),
        _normal(rng, c, 3 * c) / 4,
        _normal(rng, H, H),
        _normal(rng, H, H),
    )


NEGATIVE = {
    "one_query_keys_merged_with_heads": (
        one_query_keys_merged_with_heads,
        _bhsd,
        "made out of several score axes",
    ),
    "two_queries_merged_with_heads": (
        two_queries_merged_with_heads,
        lambda r: _bhsd(r, 2),
        "regroups the query axis with other axes",
    ),
    "talking_heads": (talking_heads, _talking, "mixed across heads before the softmax"),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_near_miss_is_kept(name, rng):
    fn, make, reason = NEGATIVE[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert not report.rewrites, str(report)
    reasons = " | ".join(f.reason for f in report.fallbacks)
    assert report.fallbacks and reason in reasons, str(report)
    np.testing.assert_allclose(jax.jit(opt)(*args), fn(*args), rtol=1e-5, atol=1e-5)
