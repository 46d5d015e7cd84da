"""Masks computed elementwise from diagonal patterns and an int padding vector.

keras-hub's decoders merge masks as ``minimum(int(padding)[:, None],
int(causal))`` (Mistral's also with a sliding window); an int32 padding input
need not hold only 0 and 1, so the mask is no conjunction of descriptors.
It is, exactly, one key mask per band of diagonals ``j - i`` (below the
diagonal and above it; inside and outside the window) (`BandSelect`,
patterns/band_select.py): each O(B·S), computed from the padding with the
query axis at size 1.

Every positive case: rewritten on the first call under ``jax.jit``, no
``T x S`` kernel operand, forward and gradient equal to the original's, also
with padding values other than 0 and 1 (-1 keeps a masked key in the
original, 2 keeps one like 1).  Near misses stay dense (and are reported),
still exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from t_by_s import assert_no_t_by_s, kernel_operand_shapes, optimized_step
from test_zoo_masks import keras_hub_decoder

import flashpass
from flashpass.ops import Positions
from flashpass.replay import Replayed, Step
from flashpass.spec import BandSelect
from flashpass.testing import assert_same_function

B, H, T, D = 2, 2, 256, 16
NEG = -0.7 * float(np.finfo(np.float32).max)


def _qkv(rng):
    return tuple(jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32) for _ in range(3))


def _padding(rng, odd: bool):
    """``[B, T]`` int32: row 1 left-padded by 40; with ``odd``, a few -1 and 2."""
    pad = np.ones((B, T), np.int32)
    pad[1, :40] = 0
    if odd:
        pad[0, 5], pad[1, 100], pad[1, 3], pad[0, 200] = -1, 2, -7, 3
    return jnp.asarray(pad)


def _scores(q, k):
    return jnp.einsum("bhtd,bhsd->bhts", q, k) * D**-0.5


def _out(s, v):
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def _causal_int():
    return jnp.tril(jnp.ones((T, T), jnp.int32))


def max_merged(q, k, v, pad):
    # An OR-like merge: a key is kept where the padding or the pattern is non-zero.
    mask = jnp.maximum(pad[:, None, None, :], _causal_int()) != 0
    return _out(jnp.where(mask, _scores(q, k), NEG), v)


def product_merged(q, k, v, pad):
    # (pad * causal) > 0, masked by keeping where False (fill where the test holds).
    drop = (pad[:, None, None, :] * _causal_int()) <= 0
    return _out(jnp.where(drop, NEG, _scores(q, k)), v)


def shifted_diagonal(q, k, v, pad):
    # A diagonal one key further (j <= i + 1) and a select between two ints.
    pattern = jnp.arange(T)[None, :] <= jnp.arange(T)[:, None] + 1
    merged = jnp.where(pattern, pad[:, None, None, :], jnp.zeros((), jnp.int32) - 1)
    return _out(jnp.where(merged > 0, _scores(q, k), NEG), v)


def causal_or_computed_lengths(q, k, v, pad):
    # A prefix-LM whose lengths are computed per key (no `PrefixLengths`):
    # causal, or every key below the row's length plus j // 512.
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    lengths = jnp.sum(pad > 0, axis=-1)
    extra = lengths[:, None, None, None] + j[None, None] // 512
    mask = (j <= i)[None, None] | (j[None, None] < extra)
    return _out(jnp.where(mask, _scores(q, k), NEG), v)


def compared_after_broadcast(q, k, v, pad):
    # keras-hub Gemma: the merged int mask broadcast over the heads, then
    # compared (`> 0`): the comparison's operand is still T x S.
    merged = jnp.minimum(pad[:, None, :], _causal_int())
    mask = jnp.broadcast_to(merged[:, None], (B, H, T, T)) > 0
    return _out(jnp.where(mask, _scores(q, k), NEG), v)


def window_and_causal(q, k, v, pad):
    # keras-hub Mistral: minimum(minimum(padding, causal), window) — three
    # bands of diagonals (outside the window, inside it, above the diagonal).
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    window = (i - j < 64).astype(jnp.int32)
    mask = jnp.minimum(jnp.minimum(pad[:, None, None, :], _causal_int()), window) > 0
    return _out(jnp.where(mask, _scores(q, k), NEG), v)


POSITIVE = {
    "causal_or_computed_lengths": causal_or_computed_lengths,
    "window_and_causal": window_and_causal,
    "compared_after_broadcast": compared_after_broadcast,
    "keras_hub_decoder": keras_hub_decoder,
    "max_merged": max_merged,
    "product_merged": product_merged,
    "shifted_diagonal": shifted_diagonal,
}


@pytest.mark.parametrize("odd", [False, True], ids=["zero_one", "other_values"])
@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_rewritten_with_two_key_masks(name, odd, rng):
    fn = POSITIVE[name]
    args = (*_qkv(rng), _padding(rng, odd))
    opt = flashpass.optimize(fn, kernel="blockwise")
    got = jax.jit(opt)(*args)  # the first call
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert report.rewrites[0].mask == "band-select", str(report)
    assert not report.rewrites[0].dense, str(report)
    np.testing.assert_allclose(got, fn(*args), rtol=2e-5, atol=2e-5)
    assert_no_t_by_s(
        kernel_operand_shapes(opt.rewritten_jaxpr(*args), constants=False, qkv=False), T, T
    )
    assert_same_function(fn, flashpass.optimize(fn, kernel="blockwise"), *args, argnums=(0, 1, 2))


def _training_step(fn, rng):
    """Run a value_and_grad step of ``fn`` optimized (first call under jit):
    value and gradients equal JAX's, nothing ``T x S`` outside the kernel.
    Returns the report."""
    args = (*_qkv(rng), _padding(rng, odd=True))
    report, rewritten, original = optimized_step(fn, args)
    assert_no_t_by_s(rewritten, T, T, control=original)
    return report


def test_training_step_leaves_no_t_by_s(rng):
    report = _training_step(keras_hub_decoder, rng)
    assert [r.passes for r in report.rewrites] == ["forward+backward"], str(report)


def test_the_op_keeps_its_definition_also_transposed():
    below = jnp.asarray(np.random.default_rng(0).random((2, 1, 1, 7)) > 0.5)
    above = jnp.asarray(np.random.default_rng(1).random((2, 1, 1, 7)) > 0.7)
    op = BandSelect((0, 1), (1,), (2, 1, 1, 7), -1e9)
    qi, kj = Positions((5, 7)).grid()
    keep = np.asarray(op.keep(qi, kj, [below, above]))
    for b, i, j in np.ndindex(2, 5, 7):
        want = below[b, 0, 0, j] if j <= i + 1 else above[b, 0, 0, j]
        assert keep[b, 0, i, j] == want
    qt, kt = Positions((7, 5), -jnp.arange(7), -jnp.arange(5), transposed=True).grid()
    kept_t = np.asarray(op.keep(qt, kt, [jnp.swapaxes(below, -1, -2), jnp.swapaxes(above, -1, -2)]))
    assert np.array_equal(np.swapaxes(kept_t, -1, -2), keep)


def test_a_replay_computes_in_the_programs_dtypes():
    # minimum(int32 pad, 0) != 0: -1 stays -1 (kept), as the program computes it.
    steps = (
        Step("convert_element_type", (("x",),), np.int32),
        Step("min", (("step", 0), ("value", np.zeros((1,), np.int32))), np.int32),
        Step("ne", (("step", 1), ("value", np.zeros((), np.int32))), np.bool_),
    )
    out = Replayed(steps).apply(jnp.asarray([1, 0, -1, 2], jnp.int32))
    assert out.tolist() == [False, False, True, False]


# --------------------------------------------------------------------------- near misses


def not_by_diagonal(q, k, v, pad):
    # A pattern that is not a function of j - i (query blocks of 64): no bands.
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    blocks = (i // 64 >= j // 64).astype(jnp.int32)
    mask = jnp.minimum(pad[:, None, None, :], blocks) > 0
    return _out(jnp.where(mask, _scores(q, k), NEG), v)


def query_side_data(q, k, v, pad):
    # The traced data varies along the queries: not key-side.
    mask = jnp.minimum(pad[:, None, :, None], _causal_int()) != 0
    return _out(jnp.where(mask, _scores(q, k), NEG), v)


@pytest.mark.parametrize("fn", [not_by_diagonal, query_side_data], ids=lambda f: f.__name__)
def test_near_misses_stay_dense_and_exact(fn, rng):
    args = (*_qkv(rng), _padding(rng, odd=True))
    opt = flashpass.optimize(fn, kernel="blockwise")
    got = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert all(r.mask != "band-select" for r in report.rewrites), str(report)
    np.testing.assert_allclose(got, fn(*args), rtol=2e-5, atol=2e-5)


def remasked_int_padding(q, k, v, pad):
    # keras' masked Softmax over keras-hub's int-merged mask: the probabilities
    # re-masked by the same mask; rows it empties are zeroed on the output.
    m = keras_mask(pad)
    s = jnp.where(m, _scores(q, k), NEG)
    return jnp.einsum("bhts,bhsd->bhtd", jnp.where(m, jax.nn.softmax(s, axis=-1), 0.0), v)


def keras_mask(pad):
    return jnp.minimum(pad[:, None, None, :], _causal_int()) != 0


def test_a_remasked_training_step_leaves_no_t_by_s(rng):
    # The rows the mask empties are found over blocks of keys (site.ROWS_BLOCK):
    # nothing T x S outside the kernel, forward or backward.
    report = _training_step(remasked_int_padding, rng)
    assert [r.mask for r in report.rewrites] == ["band-select"], str(report)
