"""Terms added into one static block of the scores (patterns/block_bias.py).

MViTv2 (timm) adds decomposed relative positions, computed from q, to every
score but the class token's row and column: ``attn[:, :, 1:, 1:] =
(attn[:, :, 1:, 1:].view(B, H, qh, qw, kh, kw) + rel_h + rel_w).view(...)``,
a ``scatter`` through torchax.  A write into a static block at constant
starts is ``s + pad(b)``: each term is a `Bias` padded when the kernel reads
it (`flashpass.terms.Padded`), so the gradient reaches q through it.

Every positive case: rewritten on its first call under ``jax.jit``, forward
and gradient (to q, k, v and the relative-position tables) equal to the
original's; also inside a training step.  Every near miss is kept, with its
reason, and computes what it did.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from no_silent import assert_kept

import flashpass
from flashpass.terms import Padded
from flashpass.testing import assert_same_function

B, H, D = 2, 2, 8
QH, QW = 4, 4
T = S = 1 + QH * QW  # a class token and a 4 x 4 grid: 17


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _scores(q, k):
    # timm's MViTv2 scales q before the product (and computes the terms from
    # the unscaled q): the kernel reads ``q * scale``, the terms ``q``.
    return jnp.einsum("bhtd,bhsd->bhts", q * D**-0.5, k)


def _out(s, v):
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def _relpos(q, rh, rw):
    """timm's ``cal_rel_pos_type`` terms: ``[B, H, qh, qw, kh]`` and
    ``[B, H, qh, qw, kw]``, einsums of the grid queries with the tables."""
    r_q = q[:, :, 1:].reshape(B, H, QH, QW, D)
    return jnp.einsum("byhwc,hkc->byhwk", r_q, rh), jnp.einsum("byhwc,wkc->byhwk", r_q, rw)


def _block_plus_rel(block, q, rh, rw):
    """MViTv2's ``(block.view(B, H, qh, qw, kh, kw) + rel_h[..., None] +
    rel_w[..., None, :]).view(B, H, qh·qw, kh·kw)``."""
    rel_h, rel_w = _relpos(q, rh, rw)
    split = block.reshape(B, H, QH, QW, QH, QW) + rel_h[..., None] + rel_w[..., None, :]
    return split.reshape(B, H, QH * QW, QH * QW)


def at_add(q, k, v, rh, rw):
    s = _scores(q, k)
    rel_h, rel_w = _relpos(q, rh, rw)
    rel = (rel_h[..., None] + rel_w[..., None, :]).reshape(B, H, QH * QW, QH * QW)
    return _out(s.at[..., 1:, 1:].add(rel), v)


def at_set(q, k, v, rh, rw):
    # MViTv2 as written: the block's own scores plus the terms, set back.
    s = _scores(q, k)
    return _out(s.at[..., 1:, 1:].set(_block_plus_rel(s[..., 1:, 1:], q, rh, rw)), v)


def update_slice(q, k, v, rh, rw):
    s = _scores(q, k)
    block = _block_plus_rel(s[..., 1:, 1:], q, rh, rw)
    return _out(lax.dynamic_update_slice(s, block, (0, 0, 1, 1)), v)


def whole_block(q, k, v, rh, rw):
    # torchax's form without a class token: the block is all of the scores,
    # read as the scores themselves (no slice), written back by a `scatter`.
    s = _scores(q[:, :, 1:], k[:, :, 1:])
    return _out(s.at[:, :, 0:, 0:].set(_block_plus_rel(s, q, rh, rw)), v[:, :, 1:])


def key_bias_broadcast(q, k, v, rh, rw):
    # A term broadcast over batch, heads and queries: padded along the keys only.
    s = _scores(q, k)
    return _out(s.at[..., 1:].add(rw[0, :, 0].sum() * jnp.arange(S - 1.0)), v)


def _args(rng):
    q, k, v = (_normal(rng, B, H, T, D) for _ in range(3))
    return q, k, v, _normal(rng, QH, QH, D) / 3, _normal(rng, QW, QW, D) / 3


POSITIVE = {
    "at_add": at_add,
    "at_set": at_set,
    "update_slice": update_slice,
    "whole_block": whole_block,
    "key_bias_broadcast": key_bias_broadcast,
}


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_rewritten_on_the_first_call_under_jit(name, rng):
    fn, args = POSITIVE[name], _args(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    got = jax.jit(opt)(*args)  # the first call
    report = opt.reports[-1]
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert "bias" in report.rewrites[0].pattern, str(report)
    np.testing.assert_allclose(got, fn(*args), rtol=2e-5, atol=2e-5)
    # The gradient to q reaches it through the padded terms too.
    assert_same_function(fn, opt, *args)


def test_the_terms_are_padded_biases(rng):
    # Two terms of the set, each its own Bias read through `Padded`; a term
    # broadcast along axes the block covers whole stays broadcast there.
    (site,) = flashpass.optimize(at_set, kernel="reference").explain(*_args(rng)).rewrites
    assert [op["op"] for op in site.spec["score_ops"]] == ["bias", "bias"], site.spec
    assert [e["shape"] for e in site.spec["extras"]] == [[B, H, T, S]] * 2, site.spec
    report = flashpass.optimize(key_bias_broadcast, kernel="reference").explain(*_args(rng))
    assert report.rewrites[0].spec["extras"][0]["shape"] == [1, 1, 1, S], str(report)


def test_padded_transform_pads_only_what_it_must():
    x = jnp.arange(3.0)  # a term along the keys, broadcast over the queries
    pad = Padded((None, 0), (1, 1), (4, 3), (5, 4))
    assert pad.carried() == (True, True)
    want = np.zeros((5, 4), np.float32)
    want[1:, 1:] = np.arange(3.0)
    np.testing.assert_array_equal(pad.apply(x), want)
    whole = Padded((None, 0), (0, 1), (5, 3), (5, 4), negate=True)
    assert whole.carried() == (False, True)
    np.testing.assert_array_equal(whole.apply(x), [[0.0, -0.0, -1.0, -2.0]])


def test_under_a_training_step(rng):
    args = _args(rng)

    def loss(q, k, v, rh, rw):
        return jnp.sum(at_set(q, k, v, rh, rw) ** 2)

    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    opt = flashpass.optimize(step, kernel="blockwise")
    value, grads = jax.jit(opt)(*args)
    report = opt.reports[-1]
    assert report.rewrites and not report.fallbacks, str(report)
    assert report.rewrites[0].passes == "forward+backward", str(report)
    want_value, want = step(*args)
    np.testing.assert_allclose(value, want_value, rtol=2e-5)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- kept


def set_constant(q, k, v, rh, rw):
    # A block set to a fill: a mask over the block, no bias.
    return _out(_scores(q, k).at[..., 1:, 1:].set(-1e9), v)


def other_array(q, k, v, rh, rw):
    s, other = _scores(q, k), _scores(k, q)
    return _out(s.at[..., 1:, 1:].set(_block_plus_rel(other[..., 1:, 1:], q, rh, rw)), v)


def traced_start(q, k, v, rh, rw, i):
    s = _scores(q, k)
    block = lax.dynamic_slice(s, (0, 0, i, i), (B, H, T - 1, S - 1))
    return _out(lax.dynamic_update_slice(s, _block_plus_rel(block, q, rh, rw), (0, 0, i, i)), v)


def strided(q, k, v, rh, rw):
    s = _scores(q, k)
    return _out(s.at[..., 1::2, 1:].add(rw.sum() * jnp.ones((B, H, QH * QW // 2, S - 1))), v)


def another_batch_row(q, k, v, rh, rw):
    # Batch row 0's block, plus the terms, written into row 1.
    s = _scores(q, k)
    return _out(s.at[1:, :, 1:, 1:].set(s[:1, :, 1:, 1:] + rw.sum()), v)


def per_row_positions(q, k, v, rh, rw):
    # A scatter per batch row (operand_batching_dims): row b's block starts at b.
    s = _scores(q, k)
    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2, 3),
        inserted_window_dims=(),
        scatter_dims_to_operand_dims=(2, 3),
        operand_batching_dims=(0,),
        scatter_indices_batching_dims=(0,),
    )
    starts = jnp.asarray([[0, 0], [1, 1]], jnp.int32)
    updates = jnp.broadcast_to(rw.sum(), (B, H, T - 1, S - 1))
    return _out(lax.scatter_add(s, starts, updates, dn, mode="promise_in_bounds"), v)


def block_doubled(q, k, v, rh, rw):
    s = _scores(q, k)
    return _out(s.at[..., 1:, 1:].set(s[..., 1:, 1:] * 2.0), v)


def block_applied(q, k, v, rh, rw):
    # A function of the block (a `scatter` whose combiner is the function).
    return _out(_scores(q, k).at[..., 1:, 1:].apply(jnp.tanh), v)


NEGATIVE = {
    "set_constant": (set_constant, "a constant (a fill)"),
    "other_array": (other_array, "of another array"),
    "traced_start": (traced_start, "computed at run time"),
    "strided": (strided, "windows at gathered positions"),
    "another_batch_row": (another_batch_row, "at another block"),
    "per_row_positions": (per_row_positions, "writes per batch row (operand_batching_dims"),
    "block_doubled": (block_doubled, "`mul`"),
    "block_applied": (block_applied, "applies a function to a block"),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_kept_with_the_reason(name, rng):
    fn, reason = NEGATIVE[name]
    args = _args(rng)
    if name == "traced_start":
        args = (*args, jnp.asarray(1, jnp.int32))
    assert_kept(fn, args, reason)
