"""The cuDNN adapter: checks, tracing and lowering without a GPU.

cuDNN cannot run here.  Its checks run under `compat.assume_cudnn` (which
answers JAX's "which cuDNN?" question while tracing); its forward and gradient
are traced and lowered for CUDA to the cuDNN custom calls; its transforms are
checked numerically through the XLA implementation of the same call in
test_conformance.py (``cudnn_xla``), and on a GPU for real (``cudnn``).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import (
    BF16,
    F32,
    XLA_ATTENTION_BF16_OUT_TOL,
    bias_op,
    fast_jit,
    has_gpu,
    mask_op,
    normal,
    requires_gpu,
    run_and_compare,
)
from kernel_testing import spec_of as _spec_of

from flashpass import compat
from flashpass.kernels import Causal, CheckContext, Mask, Scale, Softcap, get_kernel
from flashpass.kernels.cudnn import CudnnKernel, _plan, _window_empty
from flashpass.spec import KvLengths, Window

KERNEL = get_kernel("cudnn")


def _run_xla(spec, extras=()):
    """JAX's XLA attention through the adapter (cuDNN's stand-in on CPU) against
    the float64 reference, forward and gradients."""
    run_and_compare(
        CudnnKernel(implementation="xla"),
        spec,
        extras,
        tol=3e-2,
        bf16_out_tol=XLA_ATTENTION_BF16_OUT_TOL,
    )


GPU = CheckContext(platform="gpu")


def spec_of(**kwargs):
    kwargs.setdefault("dtype", BF16)
    return _spec_of(**kwargs)


def _shapes(spec):
    return [
        jax.ShapeDtypeStruct(spec.q_shape, spec.q_dtype),
        jax.ShapeDtypeStruct(spec.k_shape, spec.k_dtype),
        jax.ShapeDtypeStruct(spec.v_shape, spec.v_dtype),
        *[jax.ShapeDtypeStruct(e.shape, e.dtype) for e in spec.extras],
    ]


def test_attributes_and_platforms():
    assert isinstance(KERNEL, CudnnKernel)
    assert (KERNEL.platforms, KERNEL.interpret_platforms, KERNEL.grad) == (
        ("gpu",),
        (),
        True,
    )
    spec = spec_of(ops=[Scale(0.125)])
    for platform in ("cpu", "tpu"):
        for interpret in (False, True):
            (reason,) = KERNEL.check(spec, CheckContext(platform=platform, interpret=interpret))
            assert f"runs on gpu, not {platform}" in reason
    with compat.assume_cudnn():
        assert KERNEL.check(spec, GPU) == []
    with pytest.raises(ValueError, match="no interpret mode"):
        KERNEL.apply(spec, None, None, None, interpret=True)


@pytest.mark.skipif(compat.cudnn_version() is not None, reason="this jaxlib has cuDNN")
def test_without_cudnn_the_reason_says_how_to_get_it():
    (reason,) = KERNEL.check(spec_of(ops=[Scale(0.125)]), GPU)
    assert "cuDNN is not available" in reason and "jax[cuda" in reason


def test_plan():
    p = _plan(spec_of(t=21, s=33, d=20, dv=12, ops=[Scale(0.1), Causal(12, -1e9)]))
    # causal with an offset is a mask; masks want even lengths; head dims to 8s.
    assert (p.is_causal, p.q_len, p.kv_len, p.head_dim) == (False, 22, 34, 24)
    # Odd lengths are padded even without a mask (JAX's forward rule counts its
    # placeholder for no bias as a bias): the padded key is cuDNN's padding.
    p = _plan(spec_of(t=21, ops=[Scale(0.1), Causal(0, -1e9)]))
    assert (p.is_causal, p.q_len, p.kv_len, p.seq_lengths) == (True, 22, 22, True)
    p = _plan(spec_of(t=21, s=32, ops=[Scale(0.1)]))  # no padded key
    assert (p.q_len, p.kv_len, p.seq_lengths) == (22, 32, False)


_m, _me = mask_op(0, (1, 1, 16, 16), fill=-10.0)
REJECTED = {
    "float32": (spec_of(dtype=F32, ops=[Scale(0.25)]), "float16/bfloat16"),
    "float32_softmax": (spec_of(p_dtype=F32, out_dtype=F32), "p_dtype=float32"),
    "softcap": (spec_of(ops=[Scale(0.25), Softcap(20.0)]), "soft-capping"),
    "head_dim": (spec_of(d=136), "limit of"),
    "fill": (spec_of(ops=[_m], extras=[_me]), "does not exclude"),
    "float64": (spec_of(dtype=np.float64, compute=np.float64), "float64"),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_check_rejects_with_reason(name):
    spec, needle = REJECTED[name]
    if name == "head_dim" and has_gpu() and compat.gpu_compute_capability() >= (9, 0):
        pytest.skip("Hopper takes head dims up to 256")
    with compat.assume_cudnn():
        reasons = KERNEL.check(spec, GPU)
    assert reasons and any(needle in r for r in reasons), reasons
    with pytest.raises(ValueError, match="cudnn cannot run"):
        KERNEL.apply(spec, None, None, None)


def _everything():
    b, be = bias_op(0, (1, 4, 21, 33), BF16)
    m, me = mask_op(1, (2, 1, 1, 33))
    return spec_of(
        h=4,
        hkv=2,
        t=21,
        s=33,
        d=20,
        dv=12,
        ops=[Scale(0.3), b, Mask(1, me.shape, -1e9), Causal(12, -1e9)],
        extras=[be, me],
    )


def test_traces_and_lowers_for_gpu_without_one():
    """GQA, odd lengths and head dims, a bias, a key mask, bottom-right causal:
    forward and gradient (incl. the bias) trace and lower to cuDNN fused attention."""
    spec = _everything()
    shapes = _shapes(spec)

    def fwd(q, k, v, bias, keep):
        return KERNEL.apply(spec, q, k, v, (bias, keep))

    def grad(q, k, v, bias, keep):
        loss = lambda *a: fwd(*a, keep).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)

    def targets(fn):
        module = compat.parse_stablehlo(compat.lower_for_gpu(fn, *shapes))
        return [t for _, _, t in compat.stablehlo_ops(module) if t]

    with compat.assume_cudnn():
        out = jax.eval_shape(fwd, *shapes)
        assert (out.shape, out.dtype) == (spec.out_shape, spec.out_dtype)
        grads = jax.eval_shape(grad, *shapes)
        assert [g.shape for g in grads] == [s.shape for s in shapes[:4]]
        fwd_targets, grad_targets = targets(fwd), targets(grad)
    assert len(fwd_targets) == 1 and fwd_targets[0].startswith("__cudnn$fmha")
    assert any(t.startswith("__cudnn$fmha") and "Backward" in t for t in grad_targets)


def test_xla_implementation_checks_the_transforms():
    """The same adapter on jax.nn.dot_product_attention's XLA implementation."""
    with compat.assume_cudnn():
        spec = _everything()
        assert KERNEL.check(spec, GPU) == []
    keep = np.ones((2, 1, 1, 33), bool)
    keep[1, ..., :20] = False  # with the causal offset 12: rows 0..7 of example 1 are empty
    bias = normal(spec.extras[0].shape, 3, BF16)
    _run_xla(spec, [bias, jnp.asarray(keep)])


@requires_gpu
def test_runs_on_gpu():
    spec = _everything()
    keep = np.ones((2, 1, 1, 33), bool)
    keep[1, ..., :20] = False
    bias = normal(spec.extras[0].shape, 3, BF16)
    run_and_compare(KERNEL, spec, [bias, jnp.asarray(keep)], tol=3e-2, interpret=False)


# --------------------------------------------------------------------------- local windows


def _ws(ops, *, t=16, s=None, extras=()):
    return spec_of(t=t, s=s, ops=[Scale(0.25), *ops], extras=extras)


#: Windows cuDNN takes natively: ``(spec, local_window_size)``.
NATIVE_WINDOWS = {
    "causal_then_window": (_ws([Causal(0, -1e9), Window(5, None, -1e9)]), (5, 0)),
    "window_right_0": (_ws([Window(5, 0, -1e9)]), (5, 0)),
    # The window's right bound 0 implies a causal mask with any offset >= 0.
    "causal_offset_within_window": (_ws([Causal(3, -1e9), Window(4, 0, -1e9)]), (4, 0)),
    "causal_bounds_window": (_ws([Window(4, 6, -1e9), Causal(0, -1e9)]), (4, 0)),
    "two_windows_intersect": (_ws([Window(9, 0, -1e9), Window(4, 2, -1e9)]), (4, 0)),
    # A window reaching every earlier key is the causal mask alone.
    "wide_window_is_causal": (_ws([Causal(0, -1e9), Window(15, None, -1e9)]), None),
}


@pytest.mark.parametrize("name", list(NATIVE_WINDOWS))
def test_native_windows(name):
    spec, window = NATIVE_WINDOWS[name]
    with compat.assume_cudnn():
        assert KERNEL.check(spec, GPU) == []
    plan = _plan(spec)
    assert plan.is_causal and plan.window == window


_wm, _wme = mask_op(0, (2, 1, 1, 16))
_wm_inf, _wme_inf = mask_op(0, (2, 1, 1, 16), fill=float("-inf"))
WINDOW_REJECTED = {
    "bidirectional": _ws([Window(3, 3, -1e9)]),
    "unbounded_right": _ws([Window(3, None, -1e9)]),
    "causal_offset_right": _ws([Causal(2, -1e9), Window(3, None, -1e9)]),
    "cross_attention": _ws([Causal(0, -1e9), Window(3, None, -1e9)], s=24),
}


@pytest.mark.parametrize("name", list(WINDOW_REJECTED))
def test_windows_cudnn_cannot_take_are_rejected(name):
    with compat.assume_cudnn():
        reasons = KERNEL.check(WINDOW_REJECTED[name], GPU)
    assert any("causal sliding window" in r and "'blockwise'" in r for r in reasons), reasons
    with pytest.raises(ValueError, match="cudnn cannot run"):
        KERNEL.apply(WINDOW_REJECTED[name], None, None, None)


def test_window_with_a_mask_needs_one_fill():
    """A mask can empty a window row; the reference weighs its keys by their
    fills, the mean of v is its result only for one shared fill."""
    ops = [_wm_inf, Causal(0, -1e9), Window(4, None, -1e9)]
    with compat.assume_cudnn():
        reasons = KERNEL.check(_ws(ops, extras=[_wme_inf]), GPU)
        assert any("one fill" in r for r in reasons), reasons
        ops = [_wm, Causal(0, -1e9), Window(4, None, -1e9)]
        assert KERNEL.check(_ws(ops, extras=[_wme]), GPU) == []


def _window_with_masks(mask_shape):
    """GQA, odd length (padded by one for the mask and bias), a bias, a mask,
    a causal sliding window: rows the mask and the window empty together."""
    t = 21
    b, be = bias_op(0, (1, 4, t, t), BF16)
    m, me = mask_op(1, mask_shape)
    ops = [Scale(0.3), b, m, Causal(0, -1e9), Window(3, None, -1e9)]
    spec = spec_of(h=4, hkv=2, t=t, d=20, dv=12, ops=ops, extras=[be, me])
    keep = np.ones(mask_shape, bool)
    keep[0, ..., 5:12] = False  # rows 8..11 of example 0 see no key of their window
    keep[1] = False  # a fully masked example
    if mask_shape[2] > 1:
        keep[0, :, 17, :] = False  # and a fully masked query row
    return spec, [normal(be.shape, 3, BF16), jnp.asarray(keep)]


@pytest.mark.parametrize("left", [0, 1, 3, 20, 40])
def test_window_empty_rows(left):
    """The rows a mask empties within the causal window ``[i - left, i]``:
    key masks by prefix counts, other masks by a T x S pass, both against
    brute force.  (XLA's implementation masks a window's keys like the
    mask's, so the numerics alone barely see these rows; cuDNN skips them.)"""
    t = 21
    spec = spec_of(t=t, ops=[Causal(0, -1e9), Window(left, None, -1e9)])
    rng = np.random.default_rng(left)
    rows, cols = np.arange(t)[:, None], np.arange(t)[None, :]
    band = (cols >= rows - left) & (cols <= rows)
    for shape in ((2, 3, 1, t), (2, 1, t, t)):
        keep = rng.random(shape) < 0.25
        expected = ~np.any(keep & band, axis=-1, keepdims=True)
        got = _window_empty(spec, jnp.asarray(keep), left)
        assert got.shape == (*shape[:2], t, 1)
        np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize(
    "mask_shape",
    [(2, 1, 1, 21), pytest.param((2, 1, 21, 21), marks=pytest.mark.slow)],
    ids=["key_mask", "query_mask"],
)
def test_xla_implementation_window_with_masks(mask_shape):
    spec, extras = _window_with_masks(mask_shape)
    with compat.assume_cudnn():
        assert KERNEL.check(spec, GPU) == []
    assert _plan(spec).window == (3, 0)
    _run_xla(spec, extras)


def test_window_traces_and_lowers_for_gpu_without_one():
    """Forward and gradient of a causal sliding window lower to cuDNN fused
    attention (``local_window_size`` becomes its sliding window)."""
    spec = spec_of(
        b=2, h=4, t=128, d=64, ops=[Scale(0.125), Causal(0, -1e9), Window(31, None, -1e9)]
    )
    shapes = _shapes(spec)

    def fwd(q, k, v):
        return KERNEL.apply(spec, q, k, v)

    def grad(q, k, v):
        return jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    with compat.assume_cudnn():
        fwd_hlo = compat.lower_for_gpu(fwd, *shapes)
        grad_hlo = compat.lower_for_gpu(grad, *shapes)
    assert "__cudnn$fmha" in fwd_hlo and "Backward" in grad_hlo
    # cuDNN's window is (pos - length, pos]: length = left + 1, with its causal mask.
    for hlo in (fwd_hlo, grad_hlo):
        config = hlo.replace("\\22", '"')  # the backend config's escaped quotes
        assert re.search(r'"sliding_window_length": 32\b', config)
        assert re.search(r'"mask_type": "CAUSAL"', config)


@requires_gpu
def test_window_runs_on_gpu():
    spec, extras = _window_with_masks((2, 1, 1, 21))
    run_and_compare(KERNEL, spec, extras, tol=3e-2, interpret=False)


# --------------------------------------------------------------------------- kv lengths


def _kv(n, *, fill=-1e9, shift=0, heads=1, dtype="int32", b=3):
    """A `KvLengths` op on extra ``n`` with its `ExtraSpec` pair."""
    shape = (b, heads, 1, 1)
    return KvLengths(n, shape, fill, shift), (shape, dtype)


def _lengths(values, heads=1):
    return jnp.asarray(np.asarray(values, np.int32).reshape(len(values), heads, 1, 1))


_k0, _k0e = _kv(0)
_kb, _kbe = _kv(1)
_b, _be = bias_op(0, (1, 2, 24, 24), BF16)
_km, _kme = mask_op(1, (3, 1, 1, 24))
#: How the `KvLengths` ops run: cuDNN's own kv lengths where no other mask
#: array exists, else the key mask ``j < n`` ANDed into the mask.
LENGTH_PLANS = {
    "alone": (spec_of(b=3, t=2, s=40, ops=[Scale(0.25), _k0], extras=[_k0e]), "native"),
    "causal": (
        spec_of(b=3, t=24, ops=[Scale(0.25), Causal(0, -1e9), _k0], extras=[_k0e]),
        "native",
    ),
    "causal_offset": (
        spec_of(b=3, t=8, s=24, ops=[Scale(0.25), Causal(16, -1e9), _k0], extras=[_k0e]),
        "mask",
    ),
    "bias": (spec_of(b=3, t=24, ops=[Scale(0.25), _b, _kb], extras=[_be, _kbe]), "mask"),
    "key_mask": (
        spec_of(b=3, t=24, ops=[Scale(0.25), _k0, _km], extras=[_k0e, _kme]),
        "mask",
    ),
    "window": (
        spec_of(
            b=3, t=24, ops=[Scale(0.25), Causal(0, -1e9), Window(3, None, -1e9), _k0], extras=[_k0e]
        ),
        "mask",
    ),
}


@pytest.mark.parametrize("name", list(LENGTH_PLANS))
def test_kv_lengths_plans(name):
    spec, lengths = LENGTH_PLANS[name]
    with compat.assume_cudnn():
        assert KERNEL.check(spec, GPU) == []
    assert _plan(spec).lengths == lengths


_inf, _infe = _kv(0, fill=float("-inf"))
LENGTHS_REJECTED = {
    # cuDNN takes one length per batch row.
    "per_head": (
        spec_of(b=3, ops=[Scale(0.25), _kv(0, heads=2)[0]], extras=[_kv(0, heads=2)[1]]),
        "vary over heads",
    ),
    # A length of 0 empties the row: -inf causal and -1e9 length fills weigh its
    # keys differently, which the mean of v is not.
    "two_fills": (
        spec_of(b=3, ops=[Scale(0.25), Causal(0, float("-inf")), _k0], extras=[_k0e]),
        "one fill",
    ),
    "fill": (spec_of(b=3, ops=[Scale(0.25), _kv(0, fill=-10.0)[0]], extras=[_k0e]), "exclude"),
    "unsigned": (
        spec_of(
            b=3, ops=[Scale(0.25), _kv(0, dtype="uint32")[0]], extras=[_kv(0, dtype="uint32")[1]]
        ),
        "signed integer",
    ),
    "narrow": (
        spec_of(
            b=3, s=200, ops=[Scale(0.25), _kv(0, dtype="int8")[0]], extras=[_kv(0, dtype="int8")[1]]
        ),
        "signed integer",
    ),
    "missing_extra": (spec_of(b=3, ops=[Scale(0.25), _k0]), "lacks"),
    "not_per_row": (
        spec_of(
            b=3,
            ops=[Scale(0.25), KvLengths(0, (3, 1, 16, 1), -1e9)],
            extras=[((3, 1, 16, 1), "int32")],
        ),
        "[B|1, H|1, 1, 1]",
    ),
}


@pytest.mark.parametrize("name", list(LENGTHS_REJECTED))
def test_kv_lengths_rejected_with_reason(name):
    spec, needle = LENGTHS_REJECTED[name]
    with compat.assume_cudnn():
        reasons = KERNEL.check(spec, GPU)
    assert any(needle in r for r in reasons), reasons
    with pytest.raises(ValueError, match="cudnn cannot run"):
        KERNEL.apply(spec, None, None, None)


def _kv_case(name):
    """``(spec, extras)``: kv lengths with 0 (an empty row: the mean of v), a
    shift, lengths past S and below 0 (clipped), with each other op cuDNN takes."""
    if name == "causal_gqa_shift":  # native; odd head dims; j <= L: shift 1
        op, e = _kv(0, shift=1, b=4)
        ops = [Scale(0.3), Causal(0, -1e9), op]
        spec = spec_of(b=4, h=4, hkv=2, t=21, d=20, dv=12, ops=ops, extras=[e])
        return spec, [_lengths([-1, 0, 6, 30])]  # valid: 0, 1, 7, 21
    if name == "decode_two_ops":  # native; two ops: the shorter length
        a, ae = _kv(0)
        b, be = KvLengths(1, (1, 1, 1, 1), -1e9, -2), ((1, 1, 1, 1), "int32")
        spec = spec_of(b=3, t=3, s=33, ops=[Scale(0.25), a, b], extras=[ae, be])
        return spec, [_lengths([0, 9, 40]), _lengths([30])]  # valid: 0, 9, 28
    if name == "bias_key_mask":  # folded into the mask: rows the two empty together
        bias, biase = bias_op(0, (1, 2, 21, 21), BF16)
        m, me = mask_op(1, (3, 1, 1, 21))
        op, e = _kv(2)
        ops = [Scale(0.25), bias, m, op]
        spec = spec_of(b=3, t=21, ops=ops, extras=[biase, me, e])
        keep = np.ones(me.shape, bool)
        keep[2, ..., :5] = False  # length 5: nothing left
        return spec, [normal(biase.shape, 7, BF16), jnp.asarray(keep), _lengths([0, 13, 5])]
    if name == "window":  # folded into the mask: rows i - 3 >= n are empty
        op, e = _kv(0)
        ops = [Scale(0.25), Causal(0, -1e9), Window(3, None, -1e9), op]
        spec = spec_of(b=3, t=24, ops=ops, extras=[e])
        return spec, [_lengths([0, 7, 24])]
    if name == "causal_offset":  # folded: bottom-right causal on cross-attention
        op, e = _kv(0)
        spec = spec_of(b=3, t=8, s=24, ops=[Scale(0.25), Causal(16, -1e9), op], extras=[e])
        return spec, [_lengths([0, 5, 24])]
    raise KeyError(name)


@pytest.mark.parametrize(
    "name",
    [
        "causal_gqa_shift",
        "bias_key_mask",
        pytest.param("decode_two_ops", marks=pytest.mark.slow),
        pytest.param("window", marks=pytest.mark.slow),
        pytest.param("causal_offset", marks=pytest.mark.slow),
    ],
)
def test_xla_implementation_kv_lengths(name):
    """Forward and gradients (q, k, v, bias) against the float64 reference,
    rows of length 0 included (the mean of v: the reference's for one fill)."""
    spec, extras = _kv_case(name)
    with compat.assume_cudnn():
        assert KERNEL.check(spec, GPU) == []
    native = name in ("causal_gqa_shift", "decode_two_ops")
    assert _plan(spec).lengths == ("native" if native else "mask")
    _run_xla(spec, extras)


def test_kv_lengths_minus_inf_rows_are_the_mean_of_v():
    """A ``-inf`` fill: the reference's row of length 0 is NaN, the adapter's
    the mean of v, as for every library kernel's fully masked rows (docs)."""
    spec = spec_of(b=3, t=2, s=10, ops=[Scale(0.25), _inf], extras=[_infe], dtype=BF16)
    with compat.assume_cudnn():
        assert KERNEL.check(spec, GPU) == []
    q, k, v = (
        normal(shape, i, BF16) for i, shape in enumerate((spec.q_shape, spec.k_shape, spec.v_shape))
    )
    kernel = CudnnKernel(implementation="xla")
    out = fast_jit(lambda *a: kernel.apply(spec, *a[:3], a[3:]))(q, k, v, _lengths([0, 4, 10]))
    mean = jnp.mean(v[0].astype(jnp.float32), axis=1, keepdims=True)
    np.testing.assert_allclose(
        np.asarray(out[0], np.float32), np.broadcast_to(mean, out[0].shape), rtol=1e-2, atol=1e-2
    )
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_kv_lengths_lower_to_cudnn_padding_without_a_mask():
    """Native kv lengths: forward and gradient lower to cuDNN's padding mask
    (with its causal mask: PADDING_CAUSAL), no bias operand (no T x S array);
    the forward also under vmap (JAX's batching rule reshapes the lengths)."""
    spec, _ = _kv_case("causal_gqa_shift")
    shapes = _shapes(spec)

    def fwd(q, k, v, n):
        return KERNEL.apply(spec, q, k, v, (n,))

    def grad(q, k, v, n):
        loss = lambda *a: fwd(*a, n).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def batched(shape):
        return jax.ShapeDtypeStruct((2, *shape.shape), shape.dtype)

    with compat.assume_cudnn():
        hlos = [compat.lower_for_gpu(fn, *shapes) for fn in (fwd, grad)]
        hlos.append(compat.lower_for_gpu(jax.vmap(fwd), *map(batched, shapes)))
        hlos.append(
            compat.lower_for_gpu(
                jax.vmap(fwd, (0, 0, 0, None)), *map(batched, shapes[:3]), shapes[3]
            )
        )
    for hlo in hlos:
        targets = set(re.findall(r"__cudnn\$fmha\w*", hlo))
        assert targets and not any("Bias" in t for t in targets), targets
        config = hlo.replace("\\22", '"')
        assert re.search(r'"mask_type": "PADDING_CAUSAL"', config)
    assert any("Backward" in t for t in re.findall(r"__cudnn\$fmha\w*", hlos[1]))
    spec = LENGTH_PLANS["alone"][0]
    with compat.assume_cudnn():
        hlo = compat.lower_for_gpu(lambda *a: KERNEL.apply(spec, *a[:3], a[3:]), *_shapes(spec))
    assert re.search(r'"mask_type": "PADDING"', hlo.replace("\\22", '"'))


@requires_gpu
@pytest.mark.parametrize("name", ["causal_gqa_shift", "decode_two_ops", "bias_key_mask"])
def test_kv_lengths_run_on_gpu(name):
    spec, extras = _kv_case(name)
    run_and_compare(KERNEL, spec, extras, tol=3e-2, interpret=False)


# --------------------------------------------------------------------------- odd lengths


ODD = {
    "causal": spec_of(t=21, ops=[Scale(0.25), Causal(0, -1e9)]),
    "cross": spec_of(t=11, s=41, hkv=1, ops=[Scale(0.25)]),
}


@pytest.mark.parametrize("name", list(ODD))
def test_odd_lengths_without_a_mask(name):
    """JAX's forward rule rejects odd lengths under a gradient even without a
    bias (it counts its placeholder as one): the adapter pads them, the padded
    key excluded by cuDNN's kv lengths (no mask array); forward and gradient
    lower to cuDNN and match the reference on the XLA implementation."""
    spec = ODD[name]
    shapes = _shapes(spec)

    def grad(q, k, v):
        loss = lambda *a: KERNEL.apply(spec, *a).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with compat.assume_cudnn():
        hlo = compat.lower_for_gpu(grad, *shapes)
    targets = set(re.findall(r"__cudnn\$fmha\w*", hlo))
    assert any("Backward" in t for t in targets) and not any("Bias" in t for t in targets)
    assert re.search(r'"mask_type": "PADDING', hlo.replace("\\22", '"'))
    _run_xla(spec)
