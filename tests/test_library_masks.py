"""Masks as real libraries write them reach the kernel as descriptors (#28).

For every form of `library_masks.FORMS` (additive biases, int masks combined
arithmetically, keras-hub / flax / Hugging Face Flax / gemma / MaxText
helpers), at T = S = 1024, first call under ``jax.jit``:

* the site is rewritten with exactly the expected descriptors;
* no kernel operand, captured constant or value outside the kernel call has
  ``T x S`` elements (`t_by_s`, with the original as the positive control);
* forward and gradient equal the original's.

Near misses keep a dense operand (or the site) and say why; a whole training
step runs for a few forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import library_masks as lib
import numpy as np
import pytest
import test_structured_masks
from jax import lax
from library_masks import NEG, T, W
from t_by_s import assert_no_t_by_s, jaxpr_shapes

import flashpass
from flashpass import compat
from flashpass.testing import assert_same_function


def _described(spec: dict) -> list[str]:
    return sorted(test_structured_masks._described(spec))


def _outside_kernels(closed) -> list:
    """Shapes of every value of a rewritten jaxpr but a kernel's insides: its
    inputs, constants, equation outputs, and each kernel call's operands."""
    jaxpr = getattr(closed, "jaxpr", closed)
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in (*jaxpr.invars, *jaxpr.constvars)]
    for eqn in jaxpr.eqns:
        name = eqn.params.get("name")
        if isinstance(name, str) and name.startswith("flashpass_"):
            shapes += [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
            continue
        shapes += [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        for sub in compat.subjaxprs_of_params(eqn.params):
            shapes += _outside_kernels(sub)
    return shapes


def _args(name, rng):
    fn, make, want = lib.FORMS[name]
    return fn, (*lib.qkv(rng), *make(rng)), want


#: One form per mechanism runs by default; the rest with ``-m slow``.
FAST = {
    "add_where_finfo_min",
    "add_one_minus_int",
    "add_lax_select",
    "add_maxtext_fill",
    "int_segments_product",
    "keras_hub_causal",
    "hf_flax_buffer",
}


def _marked(names, fast):
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in sorted(names)]


def _assert_o_t(fn, opt, args):
    control = jaxpr_shapes(jax.make_jaxpr(fn)(*args))
    assert_no_t_by_s(_outside_kernels(opt.rewritten_jaxpr(*args)), T, T, control=control)


@pytest.mark.parametrize("name", _marked(lib.FORMS, FAST))
def test_library_form_becomes_descriptors(name, rng):
    fn, args, want = _args(name, rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert_same_function(fn, jax.jit(opt), *args)  # first call under jit
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert _described(report.rewrites[0].spec) == sorted(want), str(report)
    assert not report.rewrites[0].dense
    _assert_o_t(fn, opt, args)


# --------------------------------------------------------------------------- near misses


def _i_j():
    return jnp.arange(T)[:, None], jnp.arange(T)[None, :]


def _strictly_causal_additive(q, k, v):
    # row 0 keeps no key: s + fill there is not a masked row (it still reads s)
    i, j = _i_j()
    return lib._out(lib._scores(q, k) + jnp.where(j < i, 0.0, NEG), v)


def _traced_fill(q, k, v, fill):
    i, j = _i_j()
    return lib._out(lib._scores(q, k) + jnp.where(j <= i, 0.0, fill), v)


def _soft_fill(q, k, v):
    # -10 does not exclude keys: a real bias, kept whole
    i, j = _i_j()
    return lib._out(lib._scores(q, k) + jnp.where(j <= i, 0.0, -10.0), v)


def _or_of_ints(q, k, v):
    # maximum of two 0/1 masks is an OR: no conjunction of descriptors
    i, j = _i_j()
    m = jnp.maximum((j <= i).astype(jnp.int32), (j < 4).astype(jnp.int32))
    return lib._out(lib._scores(q, k) + (1 - m) * NEG, v)


def _padding_additive(q, k, v, pad):
    # a per-example key mask (an input) with causality, additive, finite fill:
    # a fully padded row reads s + fill; the bias stays dense (another issue)
    i, j = _i_j()
    keep = (j <= i)[None, None] & pad[:, None, None, :]
    return lib._out(lib._scores(q, k) + jnp.where(keep, 0.0, NEG), v)


def _two_id_arrays_additive(q, k, v, q_ids, kv_ids):
    keep = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    return lib._out(lib._scores(q, k) + jnp.where(keep, 0.0, NEG), v)


def _window_off_by_one_additive(q, k, v):
    # j <= i + 1 and i - j < W: a window one key past the diagonal, read exactly
    i, j = _i_j()
    m = (j <= i + 1).astype(jnp.int32) * (i - j < W).astype(jnp.int32)
    return lib._out(lib._scores(q, k) + (1 - m) * NEG, v)


def _pad(rng):
    pad = np.ones((lib.B, T), bool)
    pad[:, :10] = False  # left padding: rows 0..9 keep no key
    return (jnp.asarray(pad),)


def _two_ids(rng):
    q_ids = np.sort(rng.integers(0, 4, (lib.B, T)), axis=1).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 4, (lib.B, T)), axis=1).astype(np.int32)
    return jnp.asarray(q_ids), jnp.asarray(kv_ids)


NEAR_MISSES = {
    # name: (fn, extra args, descriptors, words of the dense reason or None)
    "strictly_causal": (_strictly_causal_additive, lambda r: (), ["Bias(float32)"], "no key"),
    "traced_fill": (_traced_fill, lambda r: (jnp.float32(NEG),), ["Bias(float32)"], None),
    "soft_fill": (_soft_fill, lambda r: (), ["Bias(float32)"], None),
    "or_of_ints": (_or_of_ints, lambda r: (), ["Bias(float32)"], None),
    "padding": (_padding_additive, _pad, ["Bias(float32)"], "dense array"),
    "two_id_arrays": (_two_id_arrays_additive, _two_ids, ["Bias(float32)"], "segment ids"),
    "window_off_by_one": (
        _window_off_by_one_additive,
        lambda r: (),
        ["Causal(1)", f"Window({W - 1}, None)"],
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_miss_keeps_a_dense_operand(name, rng):
    fn, make, want, reason = NEAR_MISSES[name]
    args = (*lib.qkv(rng), *make(rng))
    report = flashpass.optimize(fn, kernel="blockwise").explain(*args)
    assert len(report.rewrites) == 1, str(report)
    assert _described(report.rewrites[0].spec) == sorted(want), str(report)
    notes = report.rewrites[0].dense
    if reason is None:
        assert not notes, notes
    else:
        assert len(notes) == 1 and reason in notes[0], notes
        assert "masks kept as dense arrays" in str(report)


@pytest.mark.parametrize("name", _marked(NEAR_MISSES, {"strictly_causal", "padding"}))
def test_near_miss_computes_the_original(name, rng):
    fn, make, _, _ = NEAR_MISSES[name]
    args = (*lib.qkv(rng), *make(rng))
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert_same_function(fn, jax.jit(opt), *args, argnums=(0, 1, 2))


def test_fully_masked_row_keeps_the_original_values(rng):
    """Left padding with a -1e9 additive fill: rows 0..9 keep no key, and the
    original's values there (softmax of s - 1e9, not uniform) are kept."""
    q, k, v = lib.qkv(rng)
    q = q * 40.0  # scores far from 0: s - 1e9 rounds differently per key
    (pad,) = _pad(rng)
    opt = jax.jit(flashpass.optimize(_padding_additive, kernel="blockwise"))
    want = np.asarray(_padding_additive(q, k, v, pad))
    got = np.asarray(opt(q, k, v, pad))
    np.testing.assert_allclose(got[:, :, :10], want[:, :, :10], rtol=2e-5, atol=2e-5)
    mean = np.asarray(v).mean(axis=2, keepdims=True)
    assert not np.allclose(want[:, :, :10], mean, atol=1e-3)  # the row is not uniform


# --------------------------------------------------------------------------- training


def _train_step(attend):
    def loss(p, x, *extra):
        q, k, v = (jnp.einsum("bhtd,de->bhte", x, p[n]) for n in "qkv")
        return jnp.mean(jnp.square(attend(q, k, v, *extra)))

    def step(p, x, *extra):
        value, grads = jax.value_and_grad(loss)(p, x, *extra)
        return value, jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, p, grads)

    return step


@pytest.mark.parametrize(
    "name",
    _marked(
        ["add_one_minus_int", "add_window_sinks", "hf_flax_buffer", "maxtext_packed"],
        {"add_one_minus_int"},
    ),
)
def test_training_step(name, rng):
    fn, args, _ = _args(name, rng)
    x, extra = args[0], args[3:]
    params = {n: jnp.asarray(rng.standard_normal((lib.D, lib.D)) * 0.3, jnp.float32) for n in "qkv"}
    step = _train_step(fn)
    opt = flashpass.optimize(step, kernel="blockwise")
    got = jax.jit(opt)(params, x, *extra)
    want = step(params, x, *extra)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    report = opt.explain(params, x, *extra)
    assert report.rewrites and not report.fallbacks, str(report)
    assert all(r.backward and not r.dense for r in report.rewrites), str(report)
    control = jaxpr_shapes(jax.make_jaxpr(step)(params, x, *extra))
    assert_no_t_by_s(
        _outside_kernels(opt.rewritten_jaxpr(params, x, *extra)), T, T, control=control
    )


def test_long_additive_causal_is_read_symbolically(rng):
    """At T = S = 16384 the causal bias is too big to fold: read symbolically."""
    t = 16384
    q = k = v = jax.ShapeDtypeStruct((1, 1, t, 8), jnp.float32)

    def fn(q, k, v):
        i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
        m = lax.convert_element_type(j <= i, jnp.float32)
        return lib._out(jnp.einsum("bhtd,bhsd->bhts", q, k) + (1.0 - m) * NEG, v)

    report = flashpass.optimize(fn, kernel="blockwise").explain(q, k, v)
    assert len(report.rewrites) == 1, str(report)
    assert _described(report.rewrites[0].spec) == ["Causal(0)"], str(report)


def test_bfloat16_additive_window(rng):
    """A bfloat16 bias (``-1e9`` rounds to ``-999817216``) is read in its dtype.
    The bfloat16 original's own softmax is off by ~0.09 here: both are held to
    the float32 computation."""

    def fn(q, k, v):
        i, j = _i_j()
        m = ((j <= i) & (i - j < W)).astype(q.dtype)
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) + (1 - m) * jnp.asarray(NEG, q.dtype)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)

    args = lib.qkv(rng, jnp.bfloat16)
    opt = flashpass.optimize(fn, kernel="blockwise")
    want = np.asarray(fn(*(a.astype(jnp.float32) for a in args)))
    got = jax.jit(opt)(*args)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2)
    report = opt.explain(*args)
    assert _described(report.rewrites[0].spec) == ["Causal(0)", f"Window({W - 1}, None)"]
