"""Conformance of the blockwise kernel to `reference_attention` (the spec's oracle).

The oracle runs in float64; the kernel in float32 (or bf16 inputs).  Small
shapes with 16-wide tiles so every case crosses several query and key tiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from t_by_s import assert_no_t_by_s, jaxpr_shapes

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
from flashpass.kernels.blockwise import (
    CPU_MIN_KV_LEN,
    HEAD_LOOP_BLOCK,
    HEAD_LOOP_MIN_CAUSAL_LEN,
    MIN_BLOCK,
    TILE_ELEMENTS,
    BlockSizes,
    BlockwiseKernel,
    default_blocks,
    head_loop_pays,
    unit_spec,
)
from flashpass.kernels.reference import reference_attention

F32, BF16 = np.dtype("float32"), np.dtype(jnp.bfloat16)
KERNEL = BlockwiseKernel(block_q=16, block_k=16)

# Compile time dominates these tests; XLA's backend optimisation level only
# changes code speed, not floating-point semantics, so drop it (~3x faster).
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def make_spec(
    b=2, h=4, hkv=None, t=48, s=48, d=16, dv=None, ops=(), extras=(), dtype=F32, p_dtype=None
):
    return AttentionSpec(
        batch=b,
        heads=h,
        kv_heads=hkv or h,
        q_len=t,
        kv_len=s,
        head_dim=d,
        v_head_dim=dv or d,
        q_dtype=dtype,
        k_dtype=dtype,
        v_dtype=dtype,
        out_dtype=dtype,
        compute_dtype=F32,
        p_dtype=p_dtype or dtype,
        score_ops=tuple(ops),
        extras=tuple(ExtraSpec(tuple(x.shape), x.dtype) for x in extras),
    )


def make_qkv(spec, seed=0):
    q = normal(spec.q_shape, seed).astype(spec.q_dtype)
    k = normal(spec.k_shape, seed + 1).astype(spec.k_dtype)
    v = normal(spec.v_shape, seed + 2).astype(spec.v_dtype)
    return q, k, v


def run_both(spec, q, k, v, extras=(), kernel=KERNEL, oracle=True):
    """(kernel, oracle) results: output and grads w.r.t. q, k, v and float extras."""
    float_idx = [i for i, x in enumerate(extras) if jnp.issubdtype(x.dtype, jnp.floating)]

    def split(fn):
        def f(q, k, v, floats):
            ex = list(extras)
            for i, x in zip(float_idx, floats, strict=True):
                ex[i] = x
            return fn(q, k, v, tuple(ex))

        return f

    floats = tuple(extras[i] for i in float_idx)
    ct = normal(spec.out_shape, 99)

    @jit
    def ours(q, k, v, floats):
        out, vjp = jax.vjp(split(lambda *a: kernel.apply(spec, *a)), q, k, v, floats)
        return out, vjp(ct.astype(out.dtype))

    got = jax.tree.map(np.asarray, ours(q, k, v, floats))
    if not oracle:
        return got, None
    with jax.enable_x64(True):

        @jit
        def reference(q, k, v, floats):
            fn = split(lambda *a: reference_attention(spec, *a, dtype=jnp.float64))
            out, vjp = jax.vjp(fn, q, k, v, floats)
            return out, vjp(ct.astype(out.dtype))

        want = jax.tree.map(np.asarray, reference(q, k, v, floats))
    return got, want


def assert_close(got, want, tol):
    """Elementwise |got - want| <= tol * (|want| + 2 * max(1, max|want|)): relative
    to the tensor's scale, so gradients of large magnitude are judged fairly."""
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l)
    for i, (g, w) in enumerate(zip(got_l, want_l, strict=True)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(1.0, np.max(np.abs(w64)))
        np.testing.assert_allclose(g64, w64, rtol=tol, atol=2 * tol * scale, err_msg=f"leaf {i}")


def bool_mask(shape, seed, p=0.7):
    m = np.random.default_rng(seed).random(shape) < p
    m[..., 0] = True  # every row keeps a key unless a test says otherwise
    return jnp.asarray(m)


def normal(shape, seed, scale=1.0):
    # numpy, not jax.random: compiling a sampler per shape costs seconds.
    rng = np.random.default_rng(seed)
    return jnp.asarray(scale * rng.standard_normal(shape), F32)


B, H, T, S, D = 2, 4, 48, 48, 16
SC = Scale(D**-0.5)
PAD = bool_mask((B, 1, 1, S), 1)
TS_MASK = bool_mask((1, 1, T, S), 2)
BIAS = normal((1, H, T, S), 3)
KEY_BIAS = normal((B, 1, 1, S), 4)

# name -> (spec kwargs, extras)
CASES = {
    "plain": (dict(), ()),
    "scale": (dict(ops=[Scale(0.3)]), ()),  # not a power of two: folded into q in f32
    "causal": (dict(ops=[SC, Causal(0, -1e9)]), ()),
    "causal_short_q_neg_inf_fill": (dict(t=20, s=48, ops=[SC, Causal(28, -np.inf)]), ()),
    "padding_mask": (dict(ops=[SC, Mask(0, PAD.shape, -1e9)]), (PAD,)),
    "ts_mask_neg_inf": (dict(ops=[SC, Mask(0, TS_MASK.shape, -np.inf)]), (TS_MASK,)),
    "bias": (dict(ops=[SC, Bias(0, BIAS.shape, BIAS.dtype)]), (BIAS,)),
    "key_bias": (dict(ops=[SC, Bias(0, KEY_BIAS.shape, F32)]), (KEY_BIAS,)),
    "softcap": (dict(ops=[Softcap(2.0)]), ()),
    "scale_bias_mask": (
        dict(ops=[SC, Bias(0, BIAS.shape, F32), Mask(1, TS_MASK.shape, -1e9)]),
        (BIAS, TS_MASK),
    ),
    "mask_bias_scale": (
        dict(ops=[Mask(1, PAD.shape, -1e4), Bias(0, BIAS.shape, F32), SC]),
        (BIAS, PAD),
    ),
    "bias_scale_mask_causal_softcap": (
        dict(
            ops=[
                Bias(0, KEY_BIAS.shape, F32),
                SC,
                Mask(1, PAD.shape, -1e9),
                Causal(0, -1e9),
                Softcap(5.0),
            ]
        ),
        (KEY_BIAS, PAD),
    ),
    # Bias after Causal: skipped keys would not share one score, so no skipping.
    "causal_then_bias": (
        dict(ops=[SC, Causal(0, -1e9), Bias(0, BIAS.shape, F32)]),
        (BIAS,),
    ),
    "gqa": (dict(h=4, hkv=2, ops=[SC, Causal(0, -1e9)]), ()),
    "mqa": (dict(h=4, hkv=1, ops=[SC, Bias(0, BIAS.shape, F32)]), (BIAS,)),
    "cross_v_head_dim": (dict(t=24, s=40, dv=8, ops=[SC]), ()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_f32(name):
    kwargs, extras = CASES[name]
    spec = make_spec(extras=extras, **kwargs)
    q, k, v = make_qkv(spec)
    got, want = run_both(spec, q, k, v, extras)
    assert got[0].dtype == spec.out_dtype
    assert_close(got, want, 1e-5)


def test_odd_lengths_pad_internally():
    mask = bool_mask((1, 1, 37, 53), 5)
    bias = normal((1, H, 37, 53), 6)
    ops = [SC, Bias(1, bias.shape, F32), Mask(0, mask.shape, -1e9), Causal(16, -1e9)]
    spec = make_spec(t=37, s=53, ops=ops, extras=(mask, bias))
    plan = KERNEL.plan(spec)
    assert (plan.bq * plan.nq, plan.bk * plan.nk) == (48, 64)  # 16 does not divide 37 or 53
    q, k, v = make_qkv(spec)
    got, want = run_both(spec, q, k, v, (mask, bias))
    assert_close(got, want, 1e-5)


def test_fully_masked_row_finite_fill_is_uniform():
    """A user Mask keeps literal where(mask, s, fill) semantics: a row masked
    everywhere attends uniformly to the real keys; padded keys never count."""
    mask = np.array(bool_mask((1, 1, 37, 53), 7))
    mask[..., 3, :] = False
    mask = jnp.asarray(mask)
    spec = make_spec(t=37, s=53, ops=[SC, Mask(0, mask.shape, -1e9)], extras=(mask,))
    q, k, v = make_qkv(spec)
    got, want = run_both(spec, q, k, v, (mask,))
    assert_close(got, want, 1e-5)
    np.testing.assert_allclose(got[0][:, :, 3], np.asarray(v.mean(axis=2)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal_fill", [-1e9, -1000.0])
def test_fully_masked_row_with_causal_skipping(causal_fill):
    """Skipped blocks still count when the masked row's scores all sit at or
    below the causal fill (the literal semantics spread weight over them)."""
    mask = np.ones((1, 1, T, S), bool)
    mask[..., 5, :] = False
    mask[..., 30, :] = False
    mask = jnp.asarray(mask)
    ops = [SC, Mask(0, mask.shape, -1e9), Causal(0, causal_fill)]
    spec = make_spec(ops=ops, extras=(mask,))
    assert KERNEL.plan(spec).tiles_computed() < KERNEL.plan(spec).nq * KERNEL.plan(spec).nk
    q, k, v = make_qkv(spec)
    got, want = run_both(spec, q, k, v, (mask,))
    assert_close(got, want, 1e-5)


def test_softcap_after_causal_counts_skipped_keys():
    # softcap(-inf) = -cap: excluded keys keep a real weight, skipped or not.
    spec = make_spec(ops=[Causal(0, -np.inf), Softcap(1.0)])
    assert KERNEL.plan(spec).skipped_score == pytest.approx(-1.0)
    q, k, v = make_qkv(spec)
    got, want = run_both(spec, q, k, v)
    assert_close(got, want, 1e-5)


@pytest.mark.parametrize("p_dtype, scale", [(F32, 0.25), (BF16, 0.3)])
def test_bf16_inputs_f32_compute(p_dtype, scale):
    bias = normal((1, H, T, S), 8).astype(BF16)
    ops = [Scale(scale), Bias(0, bias.shape, BF16), Mask(1, PAD.shape, -1e9), Causal(0, -1e9)]
    spec = make_spec(ops=ops, extras=(bias, PAD), dtype=BF16, p_dtype=p_dtype)
    q, k, v = make_qkv(spec)
    got, want = run_both(spec, q, k, v, (bias, PAD))
    assert [g.dtype for g in jax.tree.leaves(got)] == [BF16] * 5
    assert_close(got, want, 2e-2)


def test_scale_is_folded_into_q_only_when_harmless():
    fold = lambda dtype, c: KERNEL.plan(make_spec(ops=[Scale(c)], dtype=dtype)).q_scale
    assert fold(F32, 0.3) == pytest.approx(0.3)  # moves one f32 rounding
    assert fold(BF16, 0.25) == 0.25  # exact in any dtype
    assert fold(BF16, 0.3) == 1.0  # would round q to bf16: not folded
    assert KERNEL.plan(make_spec(ops=[Causal(0, -1e9), SC])).q_scale == 1.0  # not leading


def test_block_size_does_not_change_numerics():
    ops = [SC, Bias(0, BIAS.shape, F32), Causal(0, -1e9)]
    spec = make_spec(ops=ops, extras=(BIAS,))
    q, k, v = make_qkv(spec)
    small, _ = run_both(spec, q, k, v, (BIAS,), kernel=BlockwiseKernel(8, 24), oracle=False)
    whole, _ = run_both(spec, q, k, v, (BIAS,), kernel=BlockwiseKernel(), oracle=False)
    assert_close(small, whole, 1e-5)


#: Different forward and backward tilings, as `default_blocks` gives.
SPLIT_TILES = BlockSizes(block_q=24, block_k=8, block_q_bwd=8, block_k_bwd=24)


@pytest.mark.parametrize("gqa", [False, True])
def test_forward_and_backward_tilings_may_differ(gqa):
    """The statistics cross from one tiling to the other: padding included
    (37 and 53 fit neither tiling), a fully masked row, a skipped causal block."""
    mask = np.array(bool_mask((1, 1, 37, 53), 5))
    mask[:, :, 3] = False
    mask = jnp.asarray(mask)
    bias = normal((1, H, 37, 53), 6)
    ops = [SC, Bias(1, bias.shape, F32), Mask(0, mask.shape, -1e9), Causal(0, -1e9)]
    spec = make_spec(t=37, s=53, hkv=2 if gqa else None, ops=ops, extras=(mask, bias))
    q, k, v = make_qkv(spec)
    kernel = BlockwiseKernel(block_sizes=SPLIT_TILES)
    got, want = run_both(spec, q, k, v, (mask, bias), kernel=kernel)
    assert_close(got, want, 1e-5)


@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_head_loop_matches_the_reference(hkv):
    """One (batch, kv head) unit at a time: GQA/MQA slicing, a bias per head
    (its gradient summed over the batch), a key bias shared by the heads (summed
    over the units), a padding mask, causal skipping, padded tiles, and the
    statistics crossing from the forward's tiling to the backward's."""
    pad = np.array(bool_mask((B, 1, 1, 53), 7))
    pad[1, ..., :] = False  # a fully padded example
    pad = jnp.asarray(pad)
    bias, key_bias = normal((1, H, 37, 53), 8), normal((B, 1, 1, 53), 9)
    ops = [
        SC,
        Bias(0, bias.shape, F32),
        Bias(1, key_bias.shape, F32),
        Mask(2, pad.shape, -1e9),
        Causal(16, -1e9),
    ]
    extras = (bias, key_bias, pad)
    spec = make_spec(t=37, s=53, hkv=hkv, ops=ops, extras=extras)
    q, k, v = make_qkv(spec)
    by_head = BlockwiseKernel(head_loop=True, block_sizes=SPLIT_TILES)
    got, want = run_both(spec, q, k, v, extras, kernel=by_head)
    assert_close(got, want, 1e-5)
    batched = BlockwiseKernel(block_sizes=SPLIT_TILES)
    plain, _ = run_both(spec, q, k, v, extras, kernel=batched, oracle=False)
    assert_close(got, plain, 1e-5)


def test_head_loop_choice():
    """The CPU default runs unit by unit only where that measured faster."""
    causal = [SC, Causal(0, -1e9)]
    n = HEAD_LOOP_MIN_CAUSAL_LEN
    assert head_loop_pays(make_spec(b=1, h=8, t=1024, s=1024, ops=[SC]))
    assert not head_loop_pays(make_spec(b=1, h=1, t=8192, s=8192, ops=[SC]))  # one unit
    assert not head_loop_pays(make_spec(b=1, h=8, t=512, s=512, ops=[SC]))  # under a tile
    assert head_loop_pays(make_spec(b=1, h=8, hkv=2, t=512, s=512, ops=[SC]))  # G rows
    assert not head_loop_pays(make_spec(b=1, h=8, t=n // 2, s=n // 2, ops=causal))
    assert head_loop_pays(make_spec(b=1, h=8, t=n, s=n, ops=causal))

    spec = make_spec(b=1, h=8, t=n, s=n, ops=causal)
    auto = BlockwiseKernel()
    single_cpu = jax.default_backend() == "cpu" and jax.device_count() == 1
    assert auto.uses_head_loop(spec) == single_cpu
    if auto.uses_head_loop(spec):
        plan = auto.plan(spec)
        assert plan.spec == unit_spec(spec)
        assert (plan.spec.batch, plan.spec.heads, plan.spec.kv_heads) == (1, 1, 1)
        assert (plan.bq, plan.bk) == (HEAD_LOOP_BLOCK, HEAD_LOOP_BLOCK)
        assert "head_loop=auto" in repr(auto)
    off = BlockwiseKernel(head_loop=False)
    assert not off.uses_head_loop(spec)
    assert off.plan(spec).spec == spec
    assert BlockwiseKernel(head_loop=True).uses_head_loop(make_spec())
    with pytest.raises(ValueError, match="head_loop must be True, False or None"):
        BlockwiseKernel(head_loop="yes")


@pytest.mark.parametrize("heads", [1, 8, 32, 1024])
def test_default_blocks_fit_the_tile_budget(heads):
    spec = make_spec(b=1, h=heads, t=8192, s=8192)
    fwd, bwd = default_blocks(spec), default_blocks(spec, backward=True)
    assert bwd == fwd[::-1]  # the backward's loops are key-major
    assert heads * fwd[0] * fwd[1] <= TILE_ELEMENTS or fwd == (MIN_BLOCK, MIN_BLOCK)
    assert min(fwd) >= MIN_BLOCK


def test_jit_and_vmap():
    spec = make_spec(b=1, ops=[SC, Mask(0, (1, 1, 1, S), -1e9), Causal(0, -1e9)])
    n = 3
    q = normal((n, *spec.q_shape), 10)
    k = normal((n, *spec.k_shape), 11)
    v = normal((n, *spec.v_shape), 12)
    mask = bool_mask((n, 1, 1, 1, S), 13)

    def loss(fn, q, k, v, m):
        return jnp.sum(jnp.sin(fn(spec, q, k, v, (m,))))

    ours = jit(jax.vmap(jax.value_and_grad(lambda *a: loss(KERNEL.apply, *a), (0, 1, 2))))
    ref = jit(jax.vmap(jax.value_and_grad(lambda *a: loss(reference_attention, *a), (0, 1, 2))))
    assert_close(ours(q, k, v, mask), ref(q, k, v, mask), 1e-5)


def test_grad_without_bias_cotangent():
    """A bias nobody differentiates gets no gradient work (a symbolic zero)."""
    spec = make_spec(ops=[SC, Bias(0, BIAS.shape, F32), Causal(0, -1e9)], extras=(BIAS,))
    q, k, v = make_qkv(spec)

    def dq(fn, **kw):
        return jit(jax.grad(lambda q: jnp.sum(jnp.sin(fn(spec, q, k, v, (BIAS,), **kw)))))(q)

    got = dq(KERNEL.apply)
    with jax.enable_x64(True):
        want = dq(reference_attention, dtype=jnp.float64)
    assert_close(got, want, 1e-5)


def test_bool_mask_gets_float0_cotangent():
    spec = make_spec(ops=[Mask(0, PAD.shape, -1e9)], extras=(PAD,))
    q, k, v = make_qkv(spec)
    vjp = jax.vjp(lambda m: KERNEL.apply(spec, q, k, v, (m,)), PAD)[1]
    (dmask,) = vjp(jnp.ones(spec.out_shape, F32))
    assert dmask.dtype == jax.dtypes.float0 and dmask.shape == PAD.shape


# --------------------------------------------------------------------------- structure


def test_no_full_score_matrix_materialised():
    """No array of the forward or the gradient could hold the 512 x 512 scores,
    in any layout (tests/t_by_s.py); the reference's do."""
    n = 512
    spec = make_spec(b=1, h=2, t=n, s=n, ops=[SC, Causal(0, -1e9)])
    kernel = BlockwiseKernel(128, 128)
    q, k, v = make_qkv(spec)
    fwd = lambda q, k, v: kernel.apply(spec, q, k, v)
    grad = jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v)), argnums=(0, 1, 2))
    control = jaxpr_shapes(jax.make_jaxpr(lambda *a: reference_attention(spec, *a))(q, k, v))
    for fn in (fwd, grad):
        shapes = jaxpr_shapes(jax.make_jaxpr(fn)(q, k, v))
        assert_no_t_by_s(shapes, n, n, control=control)
        assert any(tuple(s[-2:]) == (128, 128) for s in shapes)  # the tiles are there


def test_causal_skips_blocks_above_the_diagonal():
    """NaN planted where only skipped tiles would read it stays out of the result."""
    spec = make_spec(b=1, h=2, t=64, s=64, ops=[SC, Causal(0, -np.inf)])
    plan = KERNEL.plan(spec)
    assert plan.tiles_computed() == 10 and plan.nq * plan.nk == 16  # 4 + 3 + 2 + 1
    q, k, v = make_qkv(spec)

    @jit
    def run(q, k, v, v_nan, ct_nan):
        # Forward with nan values on key tiles 1..3: query tile 0 only reads key
        # tile 0, while a kernel visiting tiles 1..3 would multiply their zero
        # weights by nan.
        out = KERNEL.apply(spec, q, k, v_nan)
        # Backward with a nan cotangent on query tile 0: it must not reach key
        # tiles 1..3, which that query tile never attends to.
        _, vjp = jax.vjp(lambda q, k, v: KERNEL.apply(spec, q, k, v), q, k, v)
        return out, vjp(ct_nan)

    v_nan = v.at[:, :, 16:].set(jnp.nan)
    ct_nan = jnp.ones(spec.out_shape, F32).at[:, :, :16].set(jnp.nan)
    out, (_, dk, dv) = jax.tree.map(np.asarray, run(q, k, v, v_nan, ct_nan))
    assert np.isfinite(out[:, :, :16]).all() and np.isnan(out[:, :, 16:]).all()
    assert np.isfinite(dk[:, :, 16:]).all() and np.isfinite(dv[:, :, 16:]).all()
    assert np.isnan(dk[:, :, :16]).all()  # the nan did flow where it should


# --------------------------------------------------------------------------- check / errors


def test_check_short_sequence_on_cpu_only_when_not_explicit():
    kernel = get_kernel("blockwise")
    assert isinstance(kernel, BlockwiseKernel)
    short = make_spec(t=256, s=256)
    reasons = kernel.check(short, CheckContext(platform="cpu"))
    assert len(reasons) == 1
    assert reasons[0].startswith("kept: faster as written: short sequence (")
    assert f"< {CPU_MIN_KV_LEN}" in reasons[0]
    assert kernel.check(short, CheckContext(platform="cpu", explicit=True)) == []
    assert kernel.check(short, CheckContext(platform="gpu")) == []
    long = make_spec(t=256, s=CPU_MIN_KV_LEN)
    assert kernel.check(long, CheckContext(platform="cpu")) == []


def test_check_platform_reason():
    reasons = KERNEL.check(make_spec(), CheckContext(platform="metal", explicit=True))
    assert len(reasons) == 1 and "metal" in reasons[0]


def test_unknown_score_op_raises_type_error():
    @dataclasses.dataclass(frozen=True)
    class Alibi:
        slope: float

    spec = make_spec(ops=[Alibi(0.5)])
    with pytest.raises(TypeError, match="unknown score op"):
        KERNEL.apply(spec, *make_qkv(spec))


def test_bad_inputs_fail_clearly():
    spec = make_spec(ops=[Mask(0, PAD.shape, -1e9)], extras=(PAD,))
    q, k, v = make_qkv(spec)
    with pytest.raises(ValueError, match="q has shape"):
        KERNEL.apply(spec, q[:, :, :5], k, v, (PAD,))
    with pytest.raises(ValueError, match="extras"):
        KERNEL.apply(spec, q, k, v, ())
    with pytest.raises(ValueError, match=r"extras\[0\] has shape"):
        KERNEL.apply(spec, q, k, v, (jnp.ones((B, 2, 1, S), bool),))
    with pytest.raises(ValueError, match="block_q"):
        BlockwiseKernel(block_q=0)


def test_block_sizes_are_validated_and_frozen():
    sizes = BlockSizes(np.int64(32), 16, block_k_bwd=64)
    assert (sizes.block_q, type(sizes.block_q)) == (32, int)
    assert sizes.pick((512, 256)) == (32, 16)
    assert sizes.pick((256, 512), backward=True) == (32, 64)  # block_q_bwd: the forward's
    assert BlockSizes().pick((256, 512), backward=True) == (256, 512)
    for bad in (0, -1, 1.5, "16"):
        with pytest.raises(ValueError, match="block_k_bwd must be a positive int or None"):
            BlockSizes(block_k_bwd=bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.block_q = 8
    kernel = BlockwiseKernel(block_sizes=sizes)
    spec = make_spec()
    assert (kernel.block_q, kernel.block_k) == (32, 16)
    assert kernel.blocks(spec) == (32, 16) and kernel.blocks(spec, backward=True) == (32, 64)
    assert "bwd=32x64" in repr(kernel)
    with pytest.raises(ValueError, match="not both"):
        BlockwiseKernel(16, block_sizes=sizes)
    with pytest.raises(TypeError, match="BlockSizes"):
        BlockwiseKernel(block_sizes=(16, 16))


def _grad_errors(spec, q, k, v, fn):
    """Largest error of ``fn``'s float32 dq and dk against the float64 oracle,
    relative to each gradient's largest magnitude."""
    ct = normal(spec.out_shape, 99)
    _, vjp = jax.vjp(fn, q, k, v)
    got = vjp(ct)
    with jax.enable_x64(True):
        wide = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        _, vjp = jax.vjp(lambda *a: reference_attention(spec, *a, dtype=jnp.float64), *wide)
        want = vjp(jnp.asarray(ct, jnp.float64))
        return [
            float(np.max(np.abs(np.asarray(g, np.float64) - w)) / np.max(np.abs(w)))
            for g, w in zip(got[:2], want[:2], strict=True)
        ]


@pytest.mark.parametrize("q_scale", [0.3, 1.0, 4.0])
def test_backward_keeps_precision_where_values_share_a_large_component(q_scale):
    # V = 1000 + noise: dP = dO V^T and delta = rowsum(dO * O) both carry the
    # shared 1000, which cancels in dP - delta.  Centred on V's mean over the
    # keys (the softmax backward is invariant to it), the flash backward's dq
    # and dk are as accurate as autodiff's of the plain softmax; before, 1.6 to
    # 2x less (visformer_tiny's training step in the zoo).
    spec = make_spec(h=3, t=64, s=64, d=64, ops=(Scale(0.125),))
    q = normal(spec.q_shape, 0, q_scale)
    k = normal(spec.k_shape, 1)
    v = 1000.0 + normal(spec.v_shape, 2)
    kernel = BlockwiseKernel()  # its default tiles, as a rewritten program runs it
    ours = _grad_errors(spec, q, k, v, lambda *a: kernel.apply(spec, *a))
    plain = _grad_errors(spec, q, k, v, lambda *a: reference_attention(spec, *a))
    assert all(a <= 1.25 * b for a, b in zip(ours, plain, strict=True)), (ours, plain)
