"""The Pallas TPU flash-attention adapter, run in TPU interpret mode on CPU.

Forward and reverse-mode gradients are compared with `reference_attention`
in float64 (on the same, already rounded, inputs).  Interpret mode is slow
(mostly compile time), so shapes are the smallest the kernel's 128-wide
blocks allow.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import run_and_compare

from flashpass import compat
from flashpass.kernels import (
    AttentionSpec,
    Bias,
    Causal,
    CheckContext,
    ExtraSpec,
    Mask,
    Scale,
    Softcap,
    get_kernel,
)
from flashpass.kernels.pallas_tpu import PallasTpuKernel, _plan
from flashpass.kernels.reference import reference_attention
from flashpass.spec import Segments, Window

KERNEL = get_kernel("pallas_tpu")
#: 128-wide blocks, so small shapes take the kernel's multi-block paths (online
#: softmax across key blocks, causal block skipping, several query blocks).
SMALL_BLOCKS = PallasTpuKernel(max_block=128)
F32 = jnp.float32
BF16 = jnp.bfloat16
F32_TOL = 1e-5  # observed ~1e-6 (float32 accumulation vs the float64 oracle)
BF16_TOL = 2e-2
CPU_INTERPRET = CheckContext(platform="cpu", interpret=True)
#: Interpret mode's cost is XLA:CPU compile time; -O0 roughly halves it.
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def make_spec(
    *,
    b=1,
    h=2,
    hkv=None,
    t=128,
    s=None,
    d=64,
    dv=None,
    ops=(),
    extras=(),
    dtype=F32,
    compute=F32,
    p_dtype=None,
    out_dtype=None,
):
    return AttentionSpec(
        batch=b,
        heads=h,
        kv_heads=hkv or h,
        q_len=t,
        kv_len=s or t,
        head_dim=d,
        v_head_dim=dv or d,
        q_dtype=dtype,
        k_dtype=dtype,
        v_dtype=dtype,
        out_dtype=out_dtype or dtype,
        compute_dtype=compute,
        p_dtype=p_dtype or dtype,
        score_ops=tuple(ops),
        extras=tuple(extras),
    )


def bias_op(index, shape, dtype=F32):
    return Bias(index, shape, dtype), ExtraSpec(shape, dtype)


def mask_op(index, shape, fill=-1e9):
    return Mask(index, shape, fill), ExtraSpec(shape, jnp.bool_)


def qkv(spec, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, spec.q_shape, F32).astype(spec.q_dtype),
        jax.random.normal(kk, spec.k_shape, F32).astype(spec.k_dtype),
        jax.random.normal(kv, spec.v_shape, F32).astype(spec.v_dtype),
    )


def rel_err(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def oracle(spec, *arrays):
    """float64 `reference_attention` of (q, k, v, *extras)."""
    with jax.enable_x64(True):
        wide = [a if a.dtype == jnp.bool_ else jnp.asarray(a, jnp.float64) for a in arrays]
        q, k, v, *extras = wide
        return reference_attention(spec, q, k, v, extras, dtype=jnp.float64)


def run_kernel(spec, *arrays, kernel=KERNEL):
    q, k, v, *extras = arrays
    return kernel.apply(spec, q, k, v, extras, interpret=True)


def _value_and_vjp(fn, spec, arrays, cotangent):
    """``fn(spec, *arrays)`` and its vjp w.r.t. every non-boolean array."""
    diff = [i for i, a in enumerate(arrays) if a.dtype != jnp.bool_]

    def f(*d):
        full = list(arrays)
        for i, a in zip(diff, d, strict=True):
            full[i] = a
        return fn(spec, *full)

    out, vjp = jax.vjp(f, *[arrays[i] for i in diff])
    return out, vjp(cotangent.astype(out.dtype))


def assert_matches(spec, extras=(), *, tol=F32_TOL, grad=True, seed=0, kernel=KERNEL):
    """Forward, and gradients w.r.t. q, k, v and every float extra, vs the oracle."""
    arrays = (*qkv(spec, seed), *extras)
    run = functools.partial(run_kernel, kernel=kernel)
    if not grad:
        out = fast_jit(lambda *a: run(spec, *a))(*arrays)
        assert out.shape == spec.out_shape and out.dtype == spec.out_dtype
        assert rel_err(out, oracle(spec, *arrays)) < tol, "forward"
        return out
    cotangent = jax.random.normal(jax.random.key(seed + 1), spec.out_shape, F32)
    # One jit for forward and backward: interpret mode's cost is compilation.
    out, grads = fast_jit(lambda *a: _value_and_vjp(run, spec, a, cotangent))(*arrays)
    assert out.shape == spec.out_shape and out.dtype == spec.out_dtype
    with jax.enable_x64(True):
        expected, ref_grads = _value_and_vjp(oracle, spec, arrays, cotangent)
    assert rel_err(out, expected) < tol, "forward"
    names = ["q", "k", "v"] + [f"extra{i}" for i, e in enumerate(extras) if e.dtype != jnp.bool_]
    for name, g, ref in zip(names, grads, ref_grads, strict=True):
        assert g.shape == ref.shape
        assert rel_err(g, ref) < tol, f"d{name}"
    return out


# --------------------------------------------------------------------------- numerics


def test_plain_scale():
    assert_matches(make_spec(ops=[Scale(1 / 8)]))


def test_causal():
    spec = make_spec(t=256, ops=[Scale(1 / 8), Causal(0, -1e9)])
    assert (_plan(spec, 128).block_q, _plan(spec, 128).block_k) == (128, 128)
    assert_matches(spec, kernel=SMALL_BLOCKS)


@pytest.mark.parametrize("scale", [1 / 8, 0.3], ids=["pow2", "non_pow2"])
def test_scale_then_bias(scale):
    """The trap: the kernel adds its bias before scaling, the spec after."""
    shape = (1, 2, 128, 128)
    op, extra = bias_op(0, shape)
    spec = make_spec(ops=[Scale(scale), op], extras=[extra])
    bias = 3.0 * jax.random.normal(jax.random.key(7), shape, F32)
    # The non-power-of-two scale only changes the rounding of bias / scale.
    out = assert_matches(spec, [bias], grad=scale == 1 / 8)

    # Guard the guard: mis-ordering (bias scaled too) is far outside tolerance.
    wrong = oracle(make_spec(ops=[op, Scale(scale)], extras=[extra]), *qkv(spec), bias)
    assert rel_err(out, wrong) > 100 * F32_TOL


def test_bias_then_scale_broadcast_bias():
    """The kernel's native order, with a bias broadcast over batch and heads."""
    shape = (1, 1, 128, 128)
    op, extra = bias_op(0, shape)
    spec = make_spec(b=2, ops=[op, Scale(1 / 8)], extras=[extra])
    assert_matches(spec, [jax.random.normal(jax.random.key(7), shape, F32)], grad=False)


def test_bool_mask():
    shape = (1, 1, 128, 256)
    op, extra = mask_op(0, shape, fill=-1e9)
    spec = make_spec(s=256, ops=[Scale(1 / 8), op], extras=[extra])
    keep = jax.random.bernoulli(jax.random.key(3), 0.6, shape).at[..., -1].set(True)
    # Rows whose whole first key block is masked: the online softmax must drop it.
    keep = keep.at[:, :, :64, :128].set(False)
    assert_matches(spec, [keep], kernel=SMALL_BLOCKS)


def test_mask_with_bias_and_causal():
    """-inf bias entries and a key-padding mask before the scale; causal too."""
    bias_shape, mask_shape = (1, 2, 256, 256), (1, 1, 1, 256)
    b_op, b_extra = bias_op(0, bias_shape)
    m_op, m_extra = mask_op(1, mask_shape, fill=float("-inf"))
    spec = make_spec(
        t=256, ops=[m_op, Scale(1 / 8), b_op, Causal(0, -1e9)], extras=[b_extra, m_extra]
    )
    bias = jax.random.normal(jax.random.key(7), bias_shape, F32)
    bias = bias.at[:, :, :, 100:140].set(-jnp.inf)  # an additive mask in the bias
    keep = jnp.arange(256).reshape(mask_shape) % 5 != 3  # key 0 kept: no empty row
    assert_matches(spec, [bias, keep], kernel=SMALL_BLOCKS)


def test_fully_masked_row_finite_fill_is_uniform():
    """Documented: a row with no kept key averages v (equal to the spec here,
    where one finite fill replaces every score)."""
    shape = (1, 1, 128, 128)
    op, extra = mask_op(0, shape, fill=-1e9)
    spec = make_spec(ops=[Scale(1 / 8), op], extras=[extra])
    keep = jnp.ones(shape, bool).at[:, :, 5, :].set(False)
    assert_matches(spec, [keep], grad=False)


def test_gqa():
    assert_matches(make_spec(h=4, hkv=2, ops=[Scale(1 / 8), Causal(0, -1e9)]))


def test_padding_and_head_dims():
    """T and S not multiples of the blocks, Dv != D (padded and sliced)."""
    spec = make_spec(t=150, s=200, d=64, dv=48, ops=[Scale(0.125)])
    plan = _plan(spec, 128)
    assert (plan.q_len, plan.kv_len, plan.pad_keys, plan.head_dim) == (256, 256, True, 64)
    assert _plan(make_spec(t=72, s=100)).q_len == 80  # one query block: padded to 16
    assert_matches(spec, kernel=SMALL_BLOCKS)


def test_causal_offset_folded():
    """Bottom-right causal (offset S - T) is folded into the bias exactly."""
    spec = make_spec(t=64, s=128, ops=[Scale(1 / 8), Causal(64, -1e9)])
    assert _plan(spec).fold_offset == 64 and not _plan(spec).causal
    assert_matches(spec, grad=False)  # q/k/v gradients with a constant bias: test_bool_mask


def test_bf16():
    spec = make_spec(dtype=BF16, t=256, ops=[Scale(1 / 8), Causal(0, -1e9)])
    assert _plan(spec).kernel_dtype == BF16
    assert_matches(spec, tol=BF16_TOL)


def test_bf16_bias_keeps_bf16_ab():
    shape = (1, 2, 128, 128)
    op, extra = bias_op(0, shape, BF16)
    spec = make_spec(dtype=BF16, ops=[Scale(1 / 8), op], extras=[extra])
    assert _plan(spec).ab_dtype == BF16
    bias = jax.random.normal(jax.random.key(7), shape, F32).astype(BF16)
    assert_matches(spec, [bias], tol=BF16_TOL)


def test_bf16_inputs_f32_output_stay_f32_precise():
    """bf16 q/k/v with float32 compute, p and output: no hidden bf16 rounding."""
    spec = make_spec(dtype=BF16, compute=F32, p_dtype=F32, out_dtype=F32, ops=[Scale(1 / 8)])
    assert _plan(spec).kernel_dtype == F32
    assert_matches(spec, grad=False)


def test_runs_with_x64_enabled():
    # The kernel's causal index maps fail under x64 unless the adapter turns it off.
    spec = make_spec(ops=[Scale(1 / 8), Causal(0, -1e9)])
    q, k, v = qkv(spec)
    with jax.enable_x64(True):
        out, dq = fast_jit(
            jax.value_and_grad(lambda q: KERNEL.apply(spec, q, k, v, interpret=True).sum())
        )(q)
        ref, ref_dq = jax.value_and_grad(lambda q: oracle(spec, q, k, v).sum())(q)
    assert rel_err(out, ref) < F32_TOL and rel_err(dq, ref_dq) < F32_TOL


@pytest.fixture
def only_with_m_slow(request):
    # pyproject says slow tests run "with -m slow"; nothing deselects them otherwise.
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("heavy interpret-mode test: run with -m slow")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_everything_at_once(dtype, only_with_m_slow):
    """GQA, padding on both axes, Dv != D, several query and key blocks,
    a broadcast bias after a non-power-of-two scale, a mask and causal."""
    t, s = 300, 400
    b_op, b_extra = bias_op(0, (2, 1, t, s), dtype)
    m_op, m_extra = mask_op(1, (2, 1, 1, s), fill=-1e30)
    spec = make_spec(
        b=2,
        h=4,
        hkv=2,
        t=t,
        s=s,
        d=96,
        dv=64,
        dtype=dtype,
        ops=[Scale(0.1), b_op, m_op, Causal(0, -1e9)],
        extras=[b_extra, m_extra],
    )
    bias = jax.random.normal(jax.random.key(7), b_extra.shape, F32).astype(dtype)
    keep = jax.random.bernoulli(jax.random.key(8), 0.8, m_extra.shape).at[..., 0].set(True)
    assert_matches(
        spec, [bias, keep], tol=F32_TOL if dtype == F32 else BF16_TOL, kernel=SMALL_BLOCKS
    )


# --------------------------------------------------------------------------- interpret mode


def test_interpret_applies_at_trace_time_incl_backward():
    """A jaxpr traced with interpret=True runs and differentiates outside any
    interpret context (the context is read when pallas_call is traced)."""
    spec = make_spec(ops=[Scale(1 / 8)])
    q, k, v = qkv(spec)
    closed = jax.make_jaxpr(lambda q, k, v: KERNEL.apply(spec, q, k, v, interpret=True))(q, k, v)
    fn = compat.jaxpr_as_fun(closed)
    out, dq = fast_jit(jax.value_and_grad(lambda q: fn(q, k, v)[0].sum()))(q)
    with jax.enable_x64(True):
        ref, ref_dq = jax.value_and_grad(lambda q: oracle(spec, q, k, v).sum())(q)
    assert rel_err(out, ref) < F32_TOL and rel_err(dq, ref_dq) < F32_TOL


def test_without_interpret_cpu_cannot_lower():
    spec = make_spec(ops=[Scale(1 / 8)])
    with pytest.raises(Exception, match="interpret"):
        jax.block_until_ready(KERNEL.apply(spec, *qkv(spec)))


# --------------------------------------------------------------------------- TPU lowering


def _shapes(spec):
    return [
        jax.ShapeDtypeStruct(spec.q_shape, spec.q_dtype),
        jax.ShapeDtypeStruct(spec.k_shape, spec.k_dtype),
        jax.ShapeDtypeStruct(spec.v_shape, spec.v_dtype),
        *[jax.ShapeDtypeStruct(e.shape, e.dtype) for e in spec.extras],
    ]


_b, _be = bias_op(0, (1, 4, 300, 1000), BF16)
_m, _me = mask_op(1, (1, 1, 1, 1000))
LOWERING_SPECS = {
    "causal_bf16_long": make_spec(
        b=2, h=4, t=2048, d=128, dtype=BF16, ops=[Scale(0.088), Causal(0, -1e9)]
    ),
    "gqa_odd_lengths_head_dims": make_spec(
        h=4, hkv=1, t=100, s=200, d=72, dv=40, dtype=BF16, ops=[Scale(0.1)]
    ),
    "single_query_causal": make_spec(t=1, s=300, dtype=BF16, ops=[Causal(0, float("-inf"))]),
    "wide_head_offset": make_spec(t=600, s=1000, d=192, ops=[Scale(0.1), Causal(400, -1e9)]),
    "bias_and_mask": make_spec(
        h=4, t=300, s=1000, dtype=BF16, ops=[Scale(1 / 8), _b, _m], extras=[_be, _me]
    ),
    "segments_and_key_mask": make_spec(
        b=2,
        t=300,
        dtype=BF16,
        ops=[Scale(1 / 8), Causal(0, -1e9), Segments(0, 1, -1e9), Mask(2, (2, 1, 1, 300), -1e9)],
        extras=[
            ExtraSpec((2, 1, 300, 1), np.int32),
            ExtraSpec((2, 1, 1, 300), np.int32),
            ExtraSpec((2, 1, 1, 300), np.bool_),
        ],
    ),
}


@pytest.mark.parametrize("name", list(LOWERING_SPECS))
def test_lowers_for_tpu(name):
    """Forward and gradient lower to Mosaic TPU custom calls (block shapes are
    validated by the Pallas TPU lowering) without a TPU."""
    spec = LOWERING_SPECS[name]
    shapes = _shapes(spec)
    n_diff = 3 + len(spec.ops_of(Bias))

    def fwd(q, k, v, *extras):
        return KERNEL.apply(spec, q, k, v, extras)

    def grad(*args):
        def loss(*diff):
            return fwd(*diff, *args[n_diff:]).astype(F32).sum()

        return jax.grad(loss, argnums=tuple(range(n_diff)))(*args[:n_diff])

    assert compat.lower_for_tpu(fwd, *shapes).count("tpu_custom_call") == 1
    # forward (with residuals), dK/dV and dQ (+ dBias) kernels
    assert compat.lower_for_tpu(grad, *shapes).count("tpu_custom_call") == 3


@pytest.mark.parametrize("t", [1, 7, 16, 100, 128, 129, 500, 513, 1000, 4096])
@pytest.mark.parametrize("s", [1, 100, 128, 129, 640, 4096])
@pytest.mark.parametrize("max_block", [128, 512])
def test_plan_blocks_are_valid(t, s, max_block):
    plan = _plan(make_spec(t=t, s=s, d=200, dv=64), max_block)
    assert plan.q_len >= t and plan.q_len % plan.block_q == 0 and plan.block_q % 16 == 0
    assert plan.kv_len >= s and plan.kv_len % plan.block_k == 0 and plan.block_k % 128 == 0
    assert plan.block_q <= max(max_block, 16) and plan.block_k <= max_block
    assert plan.kv_len - s < 128 and plan.head_dim == 256
    plan.block_sizes()  # BlockSizes validates itself


# --------------------------------------------------------------------------- check


def test_check_platforms():
    spec = make_spec(ops=[Scale(1 / 8)])
    reasons = KERNEL.check(spec, CheckContext(platform="cpu"))
    assert len(reasons) == 1 and "interpret" in reasons[0]
    assert KERNEL.check(spec, CPU_INTERPRET) == []
    assert KERNEL.check(spec, CheckContext(platform="tpu")) == []
    assert KERNEL.check(spec, CheckContext(platform="gpu", interpret=True))


def test_check_accepts_supported_ops():
    b, be = bias_op(0, (1, 4, 100, 77))
    m, me = mask_op(1, (1, 1, 1, 77), fill=float("-inf"))
    spec = make_spec(
        h=4,
        hkv=2,
        t=100,
        s=77,
        d=200,
        dv=96,
        ops=[Scale(0.1), b, m, Causal(3, -1e30)],
        extras=[be, me],
    )
    assert KERNEL.check(spec, CPU_INTERPRET) == []


_m_bad, _me_bad = mask_op(0, (1, 1, 128, 128), fill=-10.0)
_m_scaled, _me_scaled = mask_op(0, (1, 1, 128, 128), fill=-2000.0)
REJECTED = {
    "softcap": (make_spec(ops=[Scale(1 / 8), Softcap(30.0)]), "Softcap"),
    "mask_fill_not_excluding": (make_spec(ops=[_m_bad], extras=[_me_bad]), "fill"),
    "mask_fill_scaled_down": (
        make_spec(ops=[_m_scaled, Scale(0.125)], extras=[_me_scaled]),
        "after the ops that follow it",
    ),
    "causal_fill_not_excluding": (make_spec(ops=[Causal(0, -5.0)]), "fill"),
    "negative_causal_offset": (make_spec(ops=[Causal(-1, -1e9)]), "offset"),
    "zero_scale": (make_spec(ops=[Scale(0.0)]), "positive"),
    "float64": (make_spec(dtype=jnp.float64, compute=jnp.float64), "float64"),
    "int8": (make_spec(dtype=jnp.int8), "int8"),
    "bad_extra_shape": (
        make_spec(ops=[Bias(0, (1, 3, 128, 128), F32)], extras=[ExtraSpec((1, 3, 128, 128), F32)]),
        "broadcastable",
    ),
    "missing_extra": (make_spec(ops=[Bias(0, (1, 1, 1, 128), F32)]), "extra #0"),
}


def test_fill_reasons_count_a_later_softcap():
    """A soft-cap after a mask or causal mask turns any fill into about -cap.
    The fill reasons used to count only later Scales: the spec was rejected for
    its soft-cap, but the reasons claimed the fills still excluded keys."""
    m, me = mask_op(0, (1, 1, 128, 128), fill=-1e9)
    ops = [Scale(0.125), m, Causal(0, -1e9), Softcap(30.0)]
    reasons = KERNEL.check(make_spec(ops=ops, extras=[me]), CPU_INTERPRET)
    assert any("soft-capping" in r for r in reasons), reasons
    assert any(r.startswith("mask fill -1000000000.0 ends as score -30 ") for r in reasons)
    assert any(r.startswith("causal mask fill -1000000000.0 ends as score -30 ") for r in reasons)
    # Applied after the soft-cap, the same fills exclude keys: only the soft-cap is in the way.
    ops = [Scale(0.125), Softcap(30.0), m, Causal(0, -1e9)]
    (reason,) = KERNEL.check(make_spec(ops=ops, extras=[me]), CPU_INTERPRET)
    assert "soft-capping" in reason


@pytest.mark.parametrize("name", list(REJECTED))
def test_check_rejects(name):
    spec, needle = REJECTED[name]
    reasons = KERNEL.check(spec, CPU_INTERPRET)
    assert reasons and all(isinstance(r, str) and r.strip() for r in reasons)
    assert any(needle in r for r in reasons), reasons
    with pytest.raises(ValueError, match="pallas_tpu cannot run"):
        KERNEL.apply(spec, None, None, None)  # rejected before the arrays are used


def test_kernel_attributes():
    assert isinstance(KERNEL, PallasTpuKernel)
    assert (KERNEL.name, KERNEL.platforms, KERNEL.interpret_platforms) == (
        "pallas_tpu",
        ("tpu",),
        ("cpu",),
    )
    assert KERNEL.grad
    assert math.isclose(_plan(make_spec(ops=[Scale(0.5), Scale(0.25)])).sm_scale, 0.125)


# --------------------------------------------------------------------------- segment ids


def _packed_ids(b, n, seed, segments=4):
    """Sorted (packed-document) int32 ids ``[b, n]``."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, segments, (b, n)), axis=1).astype(np.int32)


def _segment_spec(*, b=2, t=200, s=None, ops=(), extras=(), q_batch=None, dtype=F32, **kwargs):
    """A spec with `Segments(0, 1)` (ids ``[q_batch, 1, T, 1]`` and ``[q_batch,
    1, 1, S]``) after ``ops``, and ``extras`` after the two id extras."""
    s = s or t
    q_batch = b if q_batch is None else q_batch
    ids = [ExtraSpec((q_batch, 1, t, 1), np.int32), ExtraSpec((q_batch, 1, 1, s), np.int32)]
    return make_spec(
        b=b,
        t=t,
        s=s,
        dtype=dtype,
        ops=(*ops, Segments(0, 1, -1e9)),
        extras=(*ids, *extras),
        **kwargs,
    )


def test_segments_with_key_padding_gqa_and_shared_ids():
    """Packed documents with causal, GQA, a key padding mask and padded lengths:
    ids shared by the batch (``[1, 1, T, 1]``) while the mask varies per example
    (folded into the key ids, no T x S ``ab``); an id no kept key has, and a
    fully padded example, leave rows empty (the mean of v)."""
    t = 200
    m, me = mask_op(2, (2, 1, 1, t))
    spec = _segment_spec(
        t=t, h=4, hkv=2, q_batch=1, ops=[Scale(1 / 8), Causal(0, -1e9), m], extras=[me]
    )
    plan = _plan(spec, 128)
    assert plan.id_masks == (2,) and plan.ab_masks == () and plan.ab_dtype is None
    ids = _packed_ids(1, t, 1)
    keep = np.ones(me.shape, bool)
    keep[0, ..., 150:] = False  # example 0: left-padded keys...
    keep[0, ..., ids[0] == ids[0, 0]] = False  # ...and its first document's keys
    keep[1] = False  # example 1: fully padded
    extras = [ids[:, None, :, None], ids[:, None, None, :], keep]
    run_and_compare(SMALL_BLOCKS, spec, [jnp.asarray(x) for x in extras], tol=F32_TOL)


def test_segments_with_query_mask_bias_and_causal_offset():
    """Segment ids with a mask varying over queries, a bias and a bottom-right
    causal offset (all folded into ``ab``); the rows the ids and the mask empty
    together are found by a T x S pass.  Query and key ids differ
    (cross-attention over packed documents)."""
    t, s = 100, 160
    m, me = mask_op(2, (2, 1, t, s))
    bias, be = bias_op(3, (1, 2, t, s))
    spec = _segment_spec(t=t, s=s, ops=[Scale(0.3), bias, Causal(s - t, -1e9), m], extras=[me, be])
    plan = _plan(spec, 128)
    assert plan.ab_masks == (2,) and plan.id_masks == () and plan.fold_offset == s - t
    q_ids = _packed_ids(2, t, 2)
    kv_ids = _packed_ids(2, s, 3)
    keep = np.random.default_rng(4).random(me.shape) < 0.8
    keep[1, :, 40:60] = False  # rows with no key at all
    extras = [
        q_ids[:, None, :, None],
        kv_ids[:, None, None, :],
        keep,
        2 * np.random.default_rng(5).standard_normal(be.shape).astype(np.float32),
    ]
    run_and_compare(SMALL_BLOCKS, spec, [jnp.asarray(x) for x in extras], tol=F32_TOL)


@pytest.mark.slow
def test_segments_bf16_uint8_ids(only_with_m_slow):
    """bfloat16 attention with uint8 ids (cast to int32 exactly)."""
    t = 136
    spec = make_spec(
        t=t,
        dtype=BF16,
        ops=[Scale(1 / 8), Causal(0, float("-inf")), Segments(0, 1, float("-inf"))],
        extras=[ExtraSpec((2, 1, t, 1), np.uint8), ExtraSpec((2, 1, 1, t), np.uint8)],
        b=2,
    )
    ids = _packed_ids(2, t, 6).astype(np.uint8) + 250  # 250..253
    extras = [jnp.asarray(ids[:, None, :, None]), jnp.asarray(ids[:, None, None, :])]
    run_and_compare(SMALL_BLOCKS, spec, extras, tol=BF16_TOL)


def _ids(shape, dtype=np.int32):
    return ExtraSpec(shape, dtype)


SEGMENT_REJECTED = {
    "ids_per_head": (
        make_spec(ops=[Segments(0, 1, -1e9)], extras=[_ids((1, 2, 128, 1)), _ids((1, 1, 1, 128))]),
        "differ between heads",
    ),
    "int64_ids": (
        make_spec(
            ops=[Segments(0, 1, -1e9)],
            extras=[_ids((1, 1, 128, 1), np.int64), _ids((1, 1, 1, 128), np.int64)],
        ),
        "int64",
    ),
    "float_ids": (
        make_spec(
            ops=[Segments(0, 1, -1e9)],
            extras=[_ids((1, 1, 128, 1), F32), _ids((1, 1, 1, 128), F32)],
        ),
        "not integers",
    ),
    "query_ids_over_keys": (
        make_spec(ops=[Segments(0, 1, -1e9)], extras=[_ids((1, 1, 1, 128)), _ids((1, 1, 1, 128))]),
        "are not [B|1, 1, T, 1]",
    ),
    "missing_ids": (make_spec(ops=[Segments(0, 1, -1e9)]), "extra #0"),
    "fill_not_excluding": (
        make_spec(ops=[Segments(0, 1, -10.0)], extras=[_ids((1, 1, 128, 1)), _ids((1, 1, 1, 128))]),
        "segment ids (packed documents) fill -10.0 ends as score -10",
    ),
    "two_segment_ops": (
        make_spec(
            ops=[Segments(0, 1, -1e9), Segments(2, 3, -1e9)],
            extras=[_ids((1, 1, 128, 1)), _ids((1, 1, 1, 128))] * 2,
        ),
        "two segment-id masks",
    ),
    # An empty row would weigh the causally excluded keys (-inf) below the others.
    "fills_differ": (
        make_spec(
            ops=[Causal(0, float("-inf")), Segments(0, 1, -1e9)],
            extras=[_ids((1, 1, 128, 1)), _ids((1, 1, 1, 128))],
        ),
        "one fill",
    ),
    "fills_differ_after_scale": (
        make_spec(
            ops=[Segments(0, 1, -1e9), Scale(0.125), Causal(0, -1e9)],
            extras=[_ids((1, 1, 128, 1)), _ids((1, 1, 1, 128))],
        ),
        "(-1e+09, -1.25e+08)",
    ),
    "window": (make_spec(ops=[Causal(0, -1e9), Window(16, None, -1e9)]), "local window"),
}


@pytest.mark.parametrize("name", list(SEGMENT_REJECTED))
def test_segments_check_rejects(name):
    spec, needle = SEGMENT_REJECTED[name]
    reasons = KERNEL.check(spec, CPU_INTERPRET)
    assert reasons and any(needle in r for r in reasons), reasons
    with pytest.raises(ValueError, match="pallas_tpu cannot run"):
        KERNEL.apply(spec, None, None, None)


def test_segments_check_accepts():
    """One fill shared by every excluding op (-inf included: the documented
    mean-of-v rows), bool and 8/16/32-bit ids, ids broadcast over the batch."""
    for dtype in (np.bool_, np.int8, np.uint16, np.int32, np.uint32):
        for fill in (-1e9, float("-inf")):
            spec = make_spec(
                b=2,
                ops=[Scale(0.125), Causal(0, fill), Segments(0, 1, fill)],
                extras=[_ids((1, 1, 128, 1), dtype), _ids((2, 1, 1, 128), dtype)],
            )
            assert KERNEL.check(spec, CPU_INTERPRET) == [], (dtype, fill)


def test_unknown_score_op_is_rejected():
    @dataclasses.dataclass(frozen=True)
    class Novel:
        index: int = 0

    (reason,) = KERNEL.check(make_spec(ops=[Scale(1 / 8), Novel()]), CPU_INTERPRET)
    assert "unknown score op Novel" in reason
