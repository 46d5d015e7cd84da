"""Score axes that reshapes move or split: one query, and factored positions.

* One query (``T = 1``: a decode step, a class token attending to the
  patches): PyTorch's ``bmm`` on ``[B·H, 1, D]`` operands, viewed back as
  ``[B, H, 1, S]``.  A reshape places the size-1 query axis anywhere (or
  nowhere); the regrouping keeps its role (patterns/regroup.py), while real
  axes are still regrouped by roles only.
* Decomposed relative positions (SAM, ViTDet): the scores viewed as
  ``[B·H, qh, qw, kh, kw]`` get ``rel_h[..., None]`` and ``rel_w[..., None,
  :]`` added, and are viewed back as ``[B·H, T, S]``: each term is a bias of
  the merged shape (patterns/factored.py), gradient to the terms included.
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


# --------------------------------------------------------------------------- factored positions

QH, QW = 4, 5  # the query and key grids (T = S = 20)


def sam_relpos(q, k, v, rh, rw):
    # keras-hub's / segment-anything's MultiHeadAttentionWithRelativePE on
    # merged [B·H, T, D] heads: the rel-pos terms from q, added to the scores
    # viewed as [B·H, qh, qw, kh, kw].
    bh = q.shape[0]
    s = (q * D**-0.5) @ jnp.swapaxes(k, 1, 2)
    r_q = q.reshape(bh, QH, QW, D)
    rel_h = jnp.einsum("bhwc,hkc->bhwk", r_q, rh)
    rel_w = jnp.einsum("bhwc,wkc->bhwk", r_q, rw)
    s = s.reshape(bh, QH, QW, QH, QW)
    s = s + rel_h[..., :, None]
    s = s + rel_w[..., None, :]
    s = s.reshape(bh, QH * QW, QH * QW)
    return jax.nn.softmax(s, axis=-1) @ v


def _sam(rng):
    bh = B * H
    return (
        _normal(rng, bh, QH * QW, D),
        _normal(rng, bh, QH * QW, D),
        _normal(rng, bh, QH * QW, D),
        _normal(rng, QH, QH, D) / 3,
        _normal(rng, QW, QW, D) / 3,
    )


def split_terms_inputs(q, k, v, rel_h, rel_w):
    # segment-anything's add_decomposed_rel_pos on [B, H, T, S] scores, the
    # terms given (their gradient is checked), one subtracted, the merge back
    # in one expression.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    s = (
        s.reshape(B, H, QH, QW, QH, QW) + rel_h[:, :, :, :, :, None] - rel_w[:, :, :, :, None, :]
    ).reshape(B, H, QH * QW, QH * QW)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def _terms(rng):
    q, k, v = (_normal(rng, B, H, QH * QW, D) for _ in range(3))
    return q, k, v, _normal(rng, B, H, QH, QW, QH), _normal(rng, 1, H, QH, QW, QW)


def key_grid_term(q, k, v, col):
    # A term that varies along the key grid only: a [.., 1, S] bias, no T×S.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    s = (s.reshape(B, H, QH * QW, QH, QW) + col[:, None, None, None, :]).reshape(B, H, -1, QH * QW)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def _col(rng):
    return (*(_normal(rng, B, H, QH * QW, D) for _ in range(3)), _normal(rng, B, QW))


POSITIVE = {
    "decode_step": (decode_step, _decode, 3),
    "class_attention": (class_attention, _tokens, 4),
    "query_squeezed": (query_squeezed, _bhsd, 3),
    "query_moved": (query_moved, _bhsd, 3),
    "sam_relpos": (sam_relpos, _sam, 5),
    "split_terms_inputs": (split_terms_inputs, _terms, 5),
    "key_grid_term": (key_grid_term, _col, 4),
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


def test_split_terms_are_biases_in_program_order(rng):
    args = _terms(rng)
    report = flashpass.optimize(split_terms_inputs, kernel="reference").explain(*args)
    (rewrite,) = report.rewrites
    assert [op["op"] for op in rewrite.spec["score_ops"]] == ["scale", "bias", "bias"]
    shapes = [e["shape"] for e in rewrite.spec["extras"]]
    t = QH * QW
    assert shapes == [[B, H, t, t], [1, H, t, t]]  # the second term has no batch axis


def test_a_key_grid_term_is_not_t_by_s(rng):
    report = flashpass.optimize(key_grid_term, kernel="reference").explain(*_col(rng))
    (extra,) = report.rewrites[0].spec["extras"]
    assert extra["shape"] == [B, 1, 1, QH * QW]


def test_training_step_with_split_terms(rng):
    # value_and_grad inside the traced step: the backward proof covers the
    # terms' gradient (the transform's transpose), and the kernel's backward
    # replaces autodiff's.
    args = _terms(rng)

    def step(*a):
        return jax.value_and_grad(lambda *x: jnp.sum(jnp.sin(split_terms_inputs(*x))), range(5))(*a)

    opt = flashpass.optimize(step, kernel="blockwise")
    val, grads = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert report.rewrites[0].passes == "forward+backward", str(report)
    want_val, want_grads = step(*args)
    np.testing.assert_allclose(val, want_val, rtol=1e-5)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


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


def split_factors_transposed(q, k, v, rel_h, rel_w):
    # The query grid transposed (qh <-> qw) while split: the merge back permutes
    # the queries, so the sum is no bias of the scores.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    s = s.reshape(B, H, QH, QW, QH, QW).transpose(0, 1, 3, 2, 4, 5)
    s = s + rel_h.transpose(0, 1, 3, 2, 4)[..., None]
    s = s.reshape(B, H, QH * QW, QH * QW)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def split_not_merged_back(q, k, v, rel_h, rel_w):
    # Split, a term added, merged into [.., qh, qw·kh·kw]: the softmax then
    # normalises over query columns and keys together.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    s = s.reshape(B, H, QH, QW, QH, QW) + rel_h[..., None]
    p = jax.nn.softmax(s.reshape(B, H, QH, QW * QH * QW), axis=-1)
    return jnp.einsum("bhts,bhsd->bhtd", p.reshape(B, H, QH * QW, QH * QW), v)


def split_scaled_by_a_term(q, k, v, rel_h, rel_w):
    # A term multiplied while split: no additive bias.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    s = (s.reshape(B, H, QH, QW, QH, QW) * rel_h[..., None]).reshape(B, H, QH * QW, QH * QW)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def split_term_from_the_scores(q, k, v, rel_h, rel_w):
    # The added term is read from the split scores themselves.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    x = s.reshape(B, H, QH, QW, QH, QW)
    s = (x + x[..., :1]).reshape(B, H, QH * QW, QH * QW)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


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


def conv_talking_heads(q, k, v, w):
    # EfficientFormerV2: the [B, H, T, S] scores through a 1x1 convolution whose
    # channels are the heads (NCHW), before the softmax.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    s = jax.lax.conv_general_dilated(s, w, (1, 1), "VALID")
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def conv_neighbours(q, k, v, w):
    # A depthwise 3x3 convolution: each score mixes its neighbours'.
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5
    s = jax.lax.conv_general_dilated(s, w, (1, 1), "SAME", feature_group_count=H)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


NEGATIVE = {
    "conv_talking_heads": (
        conv_talking_heads,
        lambda r: (*_bhsd(r, 4), _normal(r, H, H, 1, 1)),
        "mixes the scores of other heads",
    ),
    "conv_neighbours": (
        conv_neighbours,
        lambda r: (*_bhsd(r, 4), _normal(r, H, 1, 3, 3)),
        "mixes the scores of other neighbouring queries and keys",
    ),
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
    "split_factors_transposed": (split_factors_transposed, _terms, "several score axes"),
    "split_not_merged_back": (split_not_merged_back, _terms, "several score axes"),
    "split_scaled_by_a_term": (split_scaled_by_a_term, _terms, "several score axes"),
    "split_term_from_the_scores": (split_term_from_the_scores, _terms, "computed from the scores"),
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
