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
    fn, make, want = {**lib.FORMS, **lib.PADDED_FORMS}[name]
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


def _window_off_by_one_additive(q, k, v):
    # j <= i + 1 and i - j < W: a window one key past the diagonal, read exactly
    i, j = _i_j()
    m = (j <= i + 1).astype(jnp.int32) * (i - j < W).astype(jnp.int32)
    return lib._out(lib._scores(q, k) + (1 - m) * NEG, v)


def _dense_factor_additive(q, k, v, keep):
    # a factor that is itself a T x S input: nothing to save, the bias stays whole
    i, j = _i_j()
    return lib._out(lib._scores(q, k) + jnp.where((j <= i) & keep, 0.0, NEG), v)


def _dense_keep(rng):
    return (jnp.asarray(rng.random((T, T)) < 0.9),)


def _two_padding_masks(q, k, v, pad_a, pad_b):
    # two additive masks that may each empty a row: the first is descriptors
    # and an EmptyRows op, the second stays a dense bias (one EmptyRows a site)
    i, j = _i_j()
    s = lib._scores(q, k) + jnp.where((j <= i) & (pad_a[:, None, None, :] > 0), 0.0, NEG)
    keep_b = (j <= i + 4) & (pad_b[:, None, None, :] > 0)
    return lib._out(s + jnp.where(keep_b, 0.0, NEG), v)


def _int_input_product(q, k, v, attention_mask):
    # an int mask from an input may hold 2 (or -1): (1 - causal * m) * -1e9 is
    # then no 0/fill bias, so no mask is read from it
    i, j = _i_j()
    m = (j <= i).astype(jnp.int32)[None, None] * attention_mask[:, None, None, :]
    return lib._out(lib._scores(q, k) + (1 - m) * NEG, v)


def _two_pads(rng):
    (pad,) = lib.left_padding(rng)
    return pad, jnp.roll(pad, 3, axis=1)


NEAR_MISSES = {
    # name: (fn, extra args, descriptors, words of the dense reason or None)
    "traced_fill": (_traced_fill, lambda r: (jnp.float32(NEG),), ["Bias(float32)"], None),
    "soft_fill": (_soft_fill, lambda r: (), ["Bias(float32)"], None),
    "or_of_ints": (_or_of_ints, lambda r: (), ["Bias(float32)"], None),
    "dense_factor": (_dense_factor_additive, _dense_keep, ["Bias(float32)"], "dense array"),
    "int_input_product": (_int_input_product, lib.left_padding, ["Bias(float32)"], None),
    "two_additive_masks": (
        _two_padding_masks,
        _two_pads,
        ["Bias(float32)", "Bias(float32)"],
        ("second additive mask", "with another bias"),
    ),
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
        words = (reason,) if isinstance(reason, str) else reason
        assert len(notes) == len(words), notes
        assert all(w in n and " at " in n for w, n in zip(words, notes, strict=True)), notes
        assert "masks kept as dense arrays" in str(report)


@pytest.mark.parametrize("name", _marked(NEAR_MISSES, {"dense_factor", "two_additive_masks"}))
def test_near_miss_computes_the_original(name, rng):
    fn, make, _, _ = NEAR_MISSES[name]
    args = (*lib.qkv(rng), *make(rng))
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert_same_function(fn, jax.jit(opt), *args, argnums=(0, 1, 2))


# --------------------------------------------------------------------------- empty rows

#: Additive masks with a finite fill whose rows may keep no key: the
#: descriptors and an `EmptyRows` op, no dense bias.
EMPTY = {
    **lib.PADDED_FORMS,
    # j < i: row 0 keeps no key (the strict diagonal is read as per-row lengths)
    "strictly_causal": (
        _strictly_causal_additive,
        lambda rng: (),
        ["KvLengths(0)", lib._empty(1, NEG)],
    ),
}


@pytest.mark.parametrize("name", _marked(EMPTY, {"hf_flax_padding", "packed_two_id_arrays"}))
def test_rows_a_padding_mask_may_empty(name, rng):
    fn, make, want = EMPTY[name]
    args = (*lib.qkv(rng), *make(rng))
    opt = flashpass.optimize(fn, kernel="blockwise")
    # q scaled up: in an empty row s + fill rounds differently per key, so the
    # original's values there are not the uniform weights a mask would give.
    args = (args[0] * 40.0, *args[1:])
    assert_same_function(fn, jax.jit(opt), *args, argnums=(0, 1, 2))  # first call under jit
    report = opt.explain(*args)
    assert len(report.rewrites) == 1 and not report.fallbacks, str(report)
    assert _described(report.rewrites[0].spec) == sorted(want), str(report)
    assert not report.rewrites[0].dense, str(report)
    _assert_o_t(fn, opt, args)


def test_fully_masked_row_keeps_the_original_values(rng):
    """Left padding with a -1e9 additive fill: rows 0..9 keep no key, and the
    original's values there (softmax of s - 1e9, not uniform) are kept."""
    q, k, v = lib.qkv(rng)
    q = q * 40.0  # scores far from 0: s - 1e9 rounds differently per key
    (pad,) = lib.left_padding_bool(rng)
    fn = lib.int_causal_padding
    opt = jax.jit(flashpass.optimize(fn, kernel="blockwise"))
    want = np.asarray(fn(q, k, v, pad))
    got = np.asarray(opt(q, k, v, pad))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    mean = np.asarray(v).mean(axis=2, keepdims=True)
    assert not np.allclose(want[:, :, :10], mean, atol=1e-3)  # the row is not uniform


def test_no_empty_row_skips_the_second_call(rng):
    """Right padding under causality leaves no row empty: the output is the
    descriptors' alone (a mask's uniform rows would differ where rows were
    empty, so equality to the original proves the branch is right either way)."""
    q, k, v = lib.qkv(rng)
    mask = np.ones((lib.B, T), bool)
    mask[:, -100:] = False
    fn = lib.int_causal_padding
    opt = jax.jit(flashpass.optimize(fn, kernel="blockwise"))
    np.testing.assert_allclose(
        np.asarray(opt(q, k, v, mask)), np.asarray(fn(q, k, v, mask)), rtol=2e-5, atol=2e-5
    )


def test_empty_rows_split_into_two_kernel_specs():
    from flashpass.kernels import empty_rows
    from flashpass.spec import AttentionSpec, Causal, EmptyRows, ExtraSpec, Mask, Scale

    spec = AttentionSpec(
        1, 2, 2, 8, 8, 4, 4, *["float32"] * 6,
        score_ops=(
            Scale(0.5), Causal(0, NEG), Mask(0, (1, 1, 1, 8), NEG), EmptyRows(2, NEG, "float32"),
        ),
        extras=(ExtraSpec((1, 1, 1, 8), "bool"),),
    )  # fmt: skip
    parts = empty_rows.split(spec)
    assert parts.masked.score_ops == spec.score_ops[:3]
    (scale, bias) = parts.filled.score_ops
    assert scale == Scale(0.5) and bias.index == 1 and bias.shape == (1, 1, 1, 1)
    assert parts.filled.extras[1] == ExtraSpec((1, 1, 1, 1), np.dtype("float32"))
    assert empty_rows.split(parts.masked) is None
    keys = jnp.asarray([[[[0, 0, 0, 1, 1, 1, 1, 1]]]], bool)
    empty = empty_rows.empty_rows(spec, parts.group, (keys,))
    np.testing.assert_array_equal(np.asarray(empty)[0, 0], [True] * 3 + [False] * 5)
    bad = spec.with_ops((Scale(0.5), EmptyRows(1, NEG, "float32")))
    with pytest.raises(ValueError, match="key-excluding"):
        empty_rows.split(bad)


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
        [
            "add_one_minus_int",
            "add_window_sinks",
            "hf_flax_buffer",
            "maxtext_packed",
            "hf_flax_padding",
            "packed_two_id_arrays",
        ],
        {"add_one_minus_int", "hf_flax_padding"},
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
