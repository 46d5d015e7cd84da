"""Mask spellings the model zoo found (benchmarks/zoo/repros/torch_gaps.py).

* PyTorch's boolean ``attn_mask`` made additive (torchax's SDPA reference:
  ``zeros(T, S).masked_fill_(~mask, -inf)`` added to the scores) is read like
  ``where(mask, s, -inf)``: causal and key-mask descriptors, no ``T x S``
  operand;
* a floor ``max(s, c)`` on the scores (XGLM's ``max(s + mask, finfo.min)``)
  is read into the masks before it when the kernels' semantics reproduce it,
  value and gradient, also in the rows a padding mask leaves with no key;
  a floor that may clip a real score keeps the site;
* keras-hub's decoder mask, ``minimum(int(expand_dims(padding)), int(causal))``
  cast to bool: read as causal + key mask when the padding vector is boolean;
  from an int padding input (whose values are not known to be 0 or 1), as a
  `BandSelect` of two key masks.

Each: rewritten with the expected descriptors, forward and gradient equal to
the original's, nothing ``T x S`` outside the kernel; near misses say why.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_structured_masks
from t_by_s import assert_no_t_by_s, jaxpr_shapes
from test_library_masks import _outside_kernels

import flashpass
from flashpass.testing import assert_same_function

B, H, T, D = 2, 2, 256, 16
F32_MIN = float(np.finfo(np.float32).min)
DENSE = "a mask factor no descriptor reads is passed as a dense T x S array"


def _qkv(rng):
    return tuple(jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32) for _ in range(3))


def _padding(left: bool, dtype=jnp.int32):
    """``[B, T]`` 0/1: row 1 padded, at the end (or, ``left``, at the start:
    under causality its first rows keep no key)."""
    keep = np.ones((B, T), bool)
    if left:
        keep[1, :40] = False
    else:
        keep[1, T - 37 :] = False
    return jnp.asarray(keep, dtype)


def _scores(q, k):
    return jnp.matmul(q, jnp.swapaxes(k, -1, -2)) * D**-0.5


def _out(s, v):
    return jnp.matmul(jax.nn.softmax(s, axis=-1), v)


def _hf_mask(padding, causal=True):
    """transformers' ``sdpa_mask``: ``[B, 1, T, S]`` from index vectors,
    ``kv <= q`` and ``padding[b, kv]`` (a gather), and-ed."""
    b = jnp.arange(B)[:, None, None, None]
    q_idx = jnp.arange(T)[None, None, :, None]
    kv_idx = jnp.arange(T)[None, None, None, :]
    pad = padding.astype(bool)[b, kv_idx]
    return (kv_idx <= q_idx) & pad if causal else jnp.broadcast_to(pad, (B, 1, T, T))


def _check(fn, args, want, rng_argnums=(0, 1, 2)):
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert_same_function(fn, jax.jit(opt), *args, argnums=rng_argnums)
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    got = sorted(test_structured_masks._described(report.rewrites[0].spec))
    assert got == sorted(want), str(report)
    assert not report.rewrites[0].dense, str(report)
    control = jaxpr_shapes(jax.make_jaxpr(fn)(*args))
    assert_no_t_by_s(_outside_kernels(opt.rewritten_jaxpr(*args)), T, T, control=control)
    return report


# --------------------------------------------------------------------------- -inf bias


def sdpa_bool_as_inf_bias(q, k, v, padding):
    bias = jnp.where(jnp.logical_not(_hf_mask(padding)), -jnp.inf, jnp.zeros((T, T), q.dtype))
    return _out(_scores(q, k) + bias, v)


def sdpa_encoder_as_inf_bias(q, k, v, padding):
    mask = _hf_mask(padding, causal=False)
    bias = jnp.where(jnp.logical_not(mask), -jnp.inf, jnp.zeros((T, T), q.dtype))
    return _out(_scores(q, k) + bias, v)


#: An additive ``-inf`` key mask may leave a row with no key: NaN there, with a
#: NaN gradient for q and k that a ``where`` mask would not give
#: (tests/test_minus_inf_empty_rows.py).
INF_ROWS = "EmptyRows(2, -inf, float32)"


def test_sdpa_bool_mask_as_inf_bias(rng):
    report = _check(
        sdpa_bool_as_inf_bias,
        (*_qkv(rng), _padding(left=False)),
        ["Causal(0)", "Mask", INF_ROWS],
    )
    assert report.rewrites[0].mask == "causal+key mask", str(report)


def test_sdpa_encoder_mask_as_inf_bias(rng):
    report = _check(
        sdpa_encoder_as_inf_bias,
        (*_qkv(rng), _padding(left=False)),
        ["Mask", INF_ROWS.replace("(2,", "(1,")],
    )
    assert report.rewrites[0].mask == "key mask", str(report)


def scores_masked_fill(q, k, v, padding):
    """``s.masked_fill(~mask, -inf)``: the scores kept where ``~mask`` is False."""
    return _out(jnp.where(jnp.logical_not(_hf_mask(padding)), -jnp.inf, _scores(q, k)), v)


def test_masked_fill_of_negated_mask(rng):
    _check(scores_masked_fill, (*_qkv(rng), _padding(left=False)), ["Causal(0)", "Mask"])


def _dense_inf_bias(q, k, v, keep):
    bias = jnp.where(~keep, -jnp.inf, jnp.zeros((T, T), q.dtype))
    return _out(_scores(q, k) + bias, v)


def test_dense_inf_bias_is_reported(rng):
    """A ``T x S`` boolean input made additive: nothing to read, a dense
    operand, and the report says so."""
    keep = jnp.asarray(rng.random((T, T)) < 0.9).at[:, 0].set(True)
    args = (*_qkv(rng), keep)
    opt = flashpass.optimize(_dense_inf_bias, kernel="blockwise")
    assert_same_function(_dense_inf_bias, jax.jit(opt), *args, argnums=(0, 1, 2))
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, str(report)
    assert report.rewrites[0].mask == "dense", str(report)
    notes = report.rewrites[0].dense
    assert len(notes) == 1 and notes[0].startswith(DENSE) and " at " in notes[0], notes
    assert "masks kept as dense arrays" in str(report)


# --------------------------------------------------------------------------- floors


def xglm_clamp(q, k, v, padding):
    """XGLM: the additive mask, then ``max(s, finfo.min)``."""
    mask = jnp.where(_hf_mask(padding), 0.0, F32_MIN)
    s = jnp.maximum(_scores(q, k) + mask, jnp.asarray(F32_MIN, jnp.float32))
    return _out(s, v)


def clamp_after_inf_mask(q, k, v, padding):
    """A floor after a ``-inf`` mask lifts its fill: fully masked rows are
    then uniform, not NaN."""
    s = jnp.where(_hf_mask(padding), _scores(q, k), -jnp.inf)
    return _out(jnp.maximum(jnp.float32(F32_MIN), s), v)


def clamp_below_fill(q, k, v, padding):
    """A floor far below a moderate additive fill never binds."""
    mask = jnp.where(_hf_mask(padding), 0.0, -1e9)
    return _out(jnp.maximum(_scores(q, k) + mask, F32_MIN), v)


def _empty(grad=None, fill=F32_MIN, count=2):
    tail = "" if grad is None else f", {grad}"
    return f"EmptyRows({count}, {fill}, float32{tail})"


FLOORS = {
    # name: (fn, left padding, descriptors)
    "xglm_right_padded": (xglm_clamp, False, ["Causal(0)", _empty(0.5), "Mask"]),
    # rows 0..39 of example 1 keep no key: the tie halves their gradient
    "xglm_left_padded": (xglm_clamp, True, ["Causal(0)", _empty(0.5), "Mask"]),
    "after_inf_mask": (clamp_after_inf_mask, True, ["Causal(0)", "Mask"]),
    "below_fill": (clamp_below_fill, True, ["Causal(0)", _empty(fill=-1e9), "Mask"]),
}


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_floor_is_read_into_the_masks(name, rng):
    fn, left, want = FLOORS[name]
    q, k, v = _qkv(rng)
    _check(fn, (q * 4.0, k, v, _padding(left)), want)


def test_tied_floor_gradient_in_empty_rows(rng):
    """The rows left with no key: JAX's ``max`` gives a tie half the
    gradient, and so must the rewrite (unclamped, it would be twice the
    original's)."""
    q, k, v = _qkv(rng)
    args = (q, k, v, _padding(left=True))
    opt = flashpass.optimize(xglm_clamp, kernel="blockwise")

    def dq(f):
        return jax.grad(lambda q: jnp.sum(jnp.sin(f(q, *args[1:]))))(q)

    want, got = dq(xglm_clamp), dq(opt)
    assert float(jnp.max(jnp.abs(want[1, :, :40]))) > 1e-3  # the empty rows have a gradient
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _relu_scores(q, k, v):
    return _out(jnp.maximum(_scores(q, k), 0.0), v)


def _clip_at_moderate(q, k, v, padding):
    mask = jnp.where(_hf_mask(padding), 0.0, F32_MIN)
    return _out(jnp.maximum(_scores(q, k) + mask, -1e4), v)


def _clip_by_tensor(q, k, v, padding):
    floor = jnp.where(padding[:, None, None, :] > 0, -1.0, F32_MIN)
    return _out(jnp.maximum(_scores(q, k), floor), v)


def _floor_over_dense_bias(q, k, v, bias):
    return _out(jnp.maximum(_scores(q, k) + bias, F32_MIN), v)


def _floor_lifting_a_moderate_fill(q, k, v, padding):
    # a floor of -1e30 over a fill of -1e31 that leaves rows empty: s + fill
    # is no constant there (it does not swallow the scores)
    mask = jnp.where(_hf_mask(padding), 0.0, -1e31)
    return _out(jnp.maximum(_scores(q, k) + mask, -1e30), v)


CLAMP_MISSES = {
    # name: (fn, extra args, words of the reason)
    "relu": (_relu_scores, lambda r: (), "max(scores, 0) may clip a kept score"),
    "moderate_floor": (_clip_at_moderate, lambda r: (_padding(True),), "may clip a kept score"),
    "tensor_floor": (_clip_by_tensor, lambda r: (_padding(True),), "traced value or a tensor"),
    "dense_bias": (
        _floor_over_dense_bias,
        lambda r: (jnp.asarray(r.standard_normal((1, H, T, T)), jnp.float32),),
        "bias that stays an array",
    ),
    "unswallowed_fill": (
        _floor_lifting_a_moderate_fill,
        lambda r: (_padding(True),),
        "only a fill that swallows",
    ),
}


@pytest.mark.parametrize("name", sorted(CLAMP_MISSES))
def test_floor_near_miss_keeps_the_site(name, rng):
    fn, make, words = CLAMP_MISSES[name]
    args = (*_qkv(rng), *make(rng))
    opt = flashpass.optimize(fn, kernel="blockwise")
    report = opt.explain(*args)
    assert not report.rewrites and len(report.fallbacks) == 1, str(report)
    assert words in report.fallbacks[0].reason, str(report)
    np.testing.assert_allclose(opt(*args), fn(*args), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- keras-hub


def keras_hub_decoder(q, k, v, padding_mask):
    """keras-hub ``TransformerDecoder``: ``merge_padding_and_attention_mask``
    (``int32(expand_dims(padding, 1))``) ``minimum`` the int32 cast of
    ``compute_causal_mask`` (float iotas), cast to bool by
    ``MultiHeadAttention`` and applied by keras' ``dot_product_attention``
    (``where(ones & mask, s, large_negative)``)."""
    pad = jnp.expand_dims(padding_mask, axis=1).astype(jnp.int32)  # [B, 1, S]
    i = jnp.arange(T, dtype=jnp.float32)[:, None]
    j = jnp.arange(T, dtype=jnp.float32)
    causal = jnp.broadcast_to(jnp.expand_dims(i >= j, 0), (B, T, T)).astype(jnp.int32)
    mask = jnp.expand_dims(jnp.minimum(pad, causal), 1).astype(bool)  # [B, 1, T, S]
    logits = _scores(q, k)
    combined = jnp.logical_and(jnp.ones_like(logits, dtype=bool), mask)
    return _out(jnp.where(combined, logits, -0.7 * float(np.finfo(np.float32).max)), v)


def test_keras_hub_bool_padding_is_a_key_mask(rng):
    args = (*_qkv(rng), _padding(left=True, dtype=jnp.bool_))
    report = _check(keras_hub_decoder, args, ["Causal(0)", "Mask"])
    assert report.rewrites[0].mask == "causal+key mask", str(report)


def test_keras_hub_int_padding_is_a_band_select(rng):
    """An int32 padding input may hold -1 (``minimum(-1, 0) != 0`` keeps a
    masked key) or 2: no conjunction of causal and key mask is exact, but the
    mask is one key mask below the diagonal and another above it
    (tests/test_band_select.py): O(B·S) operands, exact for any values."""
    args = (*_qkv(rng), _padding(left=True))
    opt = flashpass.optimize(keras_hub_decoder, kernel="blockwise")
    assert_same_function(keras_hub_decoder, jax.jit(opt), *args, argnums=(0, 1, 2))
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, str(report)
    assert report.rewrites[0].mask == "band-select" and not report.rewrites[0].dense, str(report)
    # with a negative entry the original keeps a masked key: still computed exactly
    odd = args[3].at[0, 5].set(-1)
    np.testing.assert_allclose(opt(*args[:3], odd), keras_hub_decoder(*args[:3], odd), atol=2e-5)
