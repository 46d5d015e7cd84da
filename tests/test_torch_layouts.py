"""PyTorch's attention layouts as torchax lowers them, written in JAX.

PyTorch decomposes a 4-D ``torch.matmul`` into a reshape of each operand to
``[B·H, T, D]``, a ``bmm`` and a view of the result as ``[B, H, T, S]``;
attention code (diffusers' ``AttnProcessor``, ``nn.MultiheadAttention``)
calls ``bmm``/``baddbmm`` on merged ``[B·H, T, D]`` operands directly, with
``beta``/``alpha`` folding a mask and the scale in.  The score product then has
one batch axis of size ``B·H`` that the chain splits by sizes (and merges back
before ``P·V``): each split and merge is proven by sizes and roles
(patterns/regroup.py), and the near misses next to them stay kept.

Each spelling here reproduces the equations torchax emits (checked against the
real lowering in tests/models/test_torchax_models.py); batch 2, so the merged
axis is not a head axis alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from t_by_s import assert_no_t_by_s, jaxpr_shapes

import flashpass

B, H, T, D = 2, 3, 24, 8
NEG = float(jnp.finfo(jnp.float32).min)


def _bmm(x, y):
    """``torch.bmm`` as torchax lowers it: ``x @ y`` on 3-D operands."""
    return jnp.matmul(x, y)


def _matmul4(x, y):
    """``torch.matmul`` on 4-D operands, as PyTorch decomposes it: expand,
    reshape to ``[B·H, ., .]``, ``bmm``, view the result back as 4-D."""
    b, h = x.shape[:2]
    out = _bmm(x.reshape(b * h, *x.shape[2:]), y.reshape(b * h, *y.shape[2:]))
    return out.reshape(b, h, *out.shape[1:])


def _causal_bias(t, s):
    return jnp.where(jnp.tril(jnp.ones((t, s), bool)), 0.0, NEG)


def hf_eager_matmul(q, k, v):
    # Hugging Face eager attention (Llama, GPT-2, BERT) on [B, H, T, D]:
    # matmul(q, kᵀ) * scale + causal mask, softmax in float32, matmul(p, v).
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) * D**-0.5
    s = s + _causal_bias(q.shape[2], k.shape[2])[None, None]
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.swapaxes(_matmul4(p, v), 1, 2)


def hf_eager_softcap(q, k, v):
    # Gemma 2's eager attention: scores soft-capped (tanh(s / cap) * cap) after
    # the split, then the causal mask.
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) * D**-0.5
    s = jnp.tanh(s / 50.0) * 50.0 + _causal_bias(q.shape[2], k.shape[2])
    return _matmul4(jax.nn.softmax(s, axis=-1), v)


def hf_eager_padding(q, k, v, keep):
    # The same with a [B, 1, 1, S] padding bias, and the scale on the query.
    s = _matmul4(q * D**-0.5, jnp.swapaxes(k, 2, 3))
    s = s + jnp.where(keep, 0.0, NEG)[:, None, None, :]
    return _matmul4(jax.nn.softmax(s, axis=-1), v)


def _key_padding_bias(keep, fill):
    # nn.MultiheadAttention's key padding: [B, S] as a fill, viewed [B, 1, 1, S],
    # expanded over heads and viewed as [B·H, 1, S] (merged with attn_mask),
    # then back as [B, H, 1, S] for SDPA.
    b, s = keep.shape
    bias = jnp.broadcast_to(jnp.where(keep, 0.0, fill).reshape(b, 1, 1, s), (b, H, 1, s))
    return bias.reshape(b * H, 1, s)


def mha_key_padding(q, k, v, keep):
    # Read through the merge undone; torch's safe softmax zeroes all -inf rows.
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) * D**-0.5
    s = s + _key_padding_bias(keep, -jnp.inf).reshape(B, H, 1, -1)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.all(s == -jnp.inf, axis=-1, keepdims=True), 0.0, p)
    return _matmul4(p, v)


def mha_key_padding_heads_major(q, k, v, keep):
    # The merged bias viewed heads-major ([H, B]) and transposed back: rows of
    # other batch elements, so a dense bias, not the padding.
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) * D**-0.5
    bias = _key_padding_bias(keep, NEG).reshape(H, B, 1, -1).transpose(1, 0, 2, 3)
    return _matmul4(jax.nn.softmax(s + bias, axis=-1), v)


def _heads_to_batch(x):
    # diffusers' head_to_batch_dim: [B, T, H·D] -> [B·H, T, D]
    b, t, _ = x.shape
    return x.reshape(b, t, H, D).transpose(0, 2, 1, 3).reshape(b * H, t, D)


def diffusers_baddbmm(x_q, x_k, x_v):
    # diffusers AttnProcessor: baddbmm(empty, q, kᵀ, beta=0, alpha=scale) (PyTorch
    # drops the beta=0 term), softmax, bmm(p, v), batch_to_head_dim.
    q, k, v = (_heads_to_batch(x) for x in (x_q, x_k, x_v))
    s = _bmm(q, jnp.swapaxes(k, 1, 2)) * D**-0.5
    out = _bmm(jax.nn.softmax(s, axis=-1), v)
    b, t, _ = x_q.shape
    return out.reshape(b, H, t, D).transpose(0, 2, 1, 3).reshape(b, t, H * D)


def diffusers_baddbmm_mask(x_q, x_k, x_v, keep):
    # With a mask: baddbmm(mask, q, kᵀ, beta=1, alpha=scale) = mask + scale·(q·kᵀ),
    # the mask [B·H, 1, S] from prepare_attention_mask (repeat_interleave over heads).
    q, k, v = (_heads_to_batch(x) for x in (x_q, x_k, x_v))
    mask = jnp.repeat(jnp.where(keep, 0.0, -10000.0)[:, None, :], H, axis=0)
    s = mask + D**-0.5 * _bmm(q, jnp.swapaxes(k, 1, 2))
    return _bmm(jax.nn.softmax(s, axis=-1), v)


def split_softmax_merged_pv(q, k, v):
    # Scores from one [B·H] product viewed as [B, H, T, S] for the softmax, the
    # probabilities merged back for a bmm with v reshaped to [B·H, S, D].
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) / jnp.sqrt(jnp.float32(D))
    p = jax.nn.softmax(s + _causal_bias(T, T), axis=-1)  # (B, H, T, T)
    return _bmm(p.reshape(B * H, T, T), v.reshape(B * H, T, D))


def split_then_transposed(q, k, v):
    # [B·H, T, S] scores viewed as [B, H, T, S], transposed to [B, T, H, S] for
    # the softmax, transposed back and merged for the bmm with v; q and k come
    # transposed from [B, T, H, D] on the other side of the product.
    qm = q.transpose(0, 2, 1, 3).reshape(B * H, T, D)  # q given as [B, T, H, D]
    km = k.transpose(0, 2, 3, 1).reshape(B * H, D, T)  # kᵀ from [B, T, H, D]
    s = _bmm(qm, km).reshape(B, H, T, T).transpose(0, 2, 1, 3) * 0.3
    p = jax.nn.softmax(s, axis=-1).transpose(0, 2, 1, 3).reshape(B * H, T, T)
    return _bmm(p, v.reshape(B * H, T, D))


def torchax_sdpa(q, k, v):
    # torchax's scaled_dot_product_attention(is_causal=True): a zeros(L, S) bias
    # masked to -inf above the diagonal, q @ kᵀ * scale + bias, softmax, @ v.
    bias = jnp.where(jnp.tril(jnp.ones((T, T), bool)), jnp.zeros((T, T)), -jnp.inf)
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) * D**-0.5 + bias
    return _matmul4(jax.nn.softmax(s, axis=-1), v)


def torchax_sdpa_no_mask(q, k, v):
    # torchax's SDPA without a mask still adds its zeros(L, S) bias: no bias.
    bias = jnp.zeros((q.shape[2], k.shape[2]), q.dtype)
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) * D**-0.5 + bias
    return _matmul4(jax.nn.softmax(s, axis=-1), v)


def constant_bias(q, k, v):
    # A constant bias that is not zero everywhere stays a bias.
    bias = jnp.zeros((q.shape[2], k.shape[2]), q.dtype).at[0, 1].set(0.5)
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) * D**-0.5 + bias
    return _matmul4(jax.nn.softmax(s, axis=-1), v)


def _bhtd(rng, t=T):
    return [jnp.asarray(rng.standard_normal((B, H, t, D)), jnp.float32) for _ in range(3)]


def _btc(rng, t=T):
    return [jnp.asarray(rng.standard_normal((B, t, H * D)), jnp.float32) for _ in range(3)]


def _keep(rng, t=T):
    keep = rng.random((B, t)) < 0.7
    keep[:, 0] = True
    return jnp.asarray(keep)


#: name -> (function, arguments(rng, t), (mask, bias) of the rewrite).  A finite
#: fill (finfo.min, -10000) is an additive bias, exact as such.
POSITIVE = {
    "hf_eager_matmul": (hf_eager_matmul, _bhtd, ("causal", False)),
    "hf_eager_softcap": (hf_eager_softcap, _bhtd, ("causal", False)),
    "hf_eager_padding": (
        hf_eager_padding,
        lambda r, t=T: (*_bhtd(r, t), _keep(r, t)),
        ("key mask", False),  # a key mask and EmptyRows (a fully padded row reads s + fill)
    ),
    "diffusers_baddbmm": (diffusers_baddbmm, _btc, ("none", False)),
    "diffusers_baddbmm_mask": (
        diffusers_baddbmm_mask,
        lambda r, t=T: (*_btc(r, t), _keep(r, t)),
        ("none", True),
    ),
    "mha_key_padding": (
        mha_key_padding,
        lambda r, t=T: (*_bhtd(r, t), _keep(r, t)),
        ("key mask", False),
    ),
    "mha_key_padding_heads_major": (
        mha_key_padding_heads_major,
        lambda r, t=T: (*_bhtd(r, t), _keep(r, t)),
        ("none", True),  # rows of other batch elements: a [B, H, 1, S] bias, not a key mask
    ),
    "split_softmax_merged_pv": (split_softmax_merged_pv, _bhtd, ("causal", False)),
    "split_then_transposed": (
        split_then_transposed,
        lambda r: [x.transpose(0, 2, 1, 3) for x in _bhtd(r)[:2]] + _bhtd(r)[2:],
        ("none", False),
    ),
    "torchax_sdpa": (torchax_sdpa, _bhtd, ("causal", False)),
    "torchax_sdpa_no_mask": (torchax_sdpa_no_mask, _bhtd, ("none", False)),
    "constant_bias": (constant_bias, _bhtd, ("none", True)),
}


def _loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(*a)))


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_torch_layout_is_rewritten(name, rng):
    fn, make, mask = POSITIVE[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    # The first call is under jax.jit, forward and gradient.
    got = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert (report.rewrites[0].mask, report.rewrites[0].bias) == mask, str(report)
    np.testing.assert_allclose(got, fn(*args), atol=2e-5)
    n = 3
    g_opt = jax.jit(jax.grad(_loss(flashpass.optimize(fn, kernel="blockwise")), range(n)))(*args)
    g_ref = jax.grad(_loss(fn), range(n))(*args)
    for a, b in zip(g_opt, g_ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("name", ["hf_eager_matmul", "hf_eager_softcap", "diffusers_baddbmm_mask"])
def test_training_step_leaves_no_t_by_s(name, rng):
    # value_and_grad inside the traced step: autodiff's backward through the
    # merged layout is the kernel's (patterns/backward.py), no T×S array left.
    fn, make, _ = POSITIVE[name]
    args = make(rng)

    def step(*a):
        return jax.value_and_grad(_loss(fn), argnums=(0, 1, 2))(*a)

    opt = flashpass.optimize(step, kernel="blockwise")
    (val, grads) = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    want_val, want_grads = step(*args)
    np.testing.assert_allclose(val, want_val, rtol=1e-5)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
    # Traced only, at a length above the kernel's tiles (at T = 24 one tile is
    # the whole score matrix); with a dense bias the kernel loops over heads,
    # one [1, 1, T, S] tile at a time, hence two copies (the original holds B·H).
    t = 1024
    args = jax.eval_shape(lambda: make(np.random.default_rng(0), t))
    control = jaxpr_shapes(jax.make_jaxpr(step)(*args))
    rewritten = flashpass.optimize(step, kernel="blockwise").rewritten_jaxpr(*args)
    assert_no_t_by_s(jaxpr_shapes(rewritten), t, t, copies=2, control=control)


# --------------------------------------------------------------------------- near misses


def split_mismatched_merge(q, k, v):
    # [B·H] scores split as [B, H], the probabilities regrouped as [H, B] (sizes
    # that are not the split's roles) for a P·V on v viewed the same way.
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) * 0.3
    p = jax.nn.softmax(s, axis=-1).reshape(H, B, T, T)
    return jnp.einsum("hbts,hbsd->hbtd", p, v.reshape(H, B, T, D))


def merged_heads_major(q, k, v):
    # [B, H] scores merged heads-major ([H·B]) before the bmm with v: the merged
    # axis is out of the score product's order, pairing other (batch, head)s.
    s = _matmul4(q, jnp.swapaxes(k, 2, 3)) * 0.3
    p = jax.nn.softmax(s, axis=-1).transpose(1, 0, 2, 3).reshape(H * B, T, T)
    return _bmm(p, v.reshape(B * H, T, D))


def split_mixes_query(q, k, v):
    # A [B·H, T, S] score "view" as [B, H·T, S] then [B, H, T, S]: the query
    # axis is regrouped with the heads.
    s = _bmm(q.reshape(B * H, T, D), jnp.swapaxes(k.reshape(B * H, T, D), 1, 2))
    s = s.reshape(B, H * T, T).reshape(B, H, T, T)
    return _matmul4(jax.nn.softmax(s, axis=-1), v)


def softmax_over_split_batch(q, k, v):
    # The split batch axis is the softmax axis: not attention.
    s = _matmul4(q, jnp.swapaxes(k, 2, 3))
    p = jax.nn.softmax(s, axis=1)
    return _matmul4(p, v)


NEGATIVE = {
    "split_mismatched_merge": (split_mismatched_merge, "into sizes that are not its roles"),
    "merged_heads_major": (merged_heads_major, "out of the score product's axis order"),
    "split_mixes_query": (split_mixes_query, "regroups the query axis with other axes"),
    "softmax_over_split_batch": (softmax_over_split_batch, "softmax"),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_near_miss_is_kept(name, rng):
    fn, reason = NEGATIVE[name]
    args = _bhtd(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert not report.rewrites, str(report)
    reasons = " | ".join(f.reason for f in report.fallbacks)
    assert reason in reasons, str(report)
    np.testing.assert_allclose(jax.jit(opt)(*args), fn(*args), rtol=1e-5, atol=1e-6)
