"""The splash attention adapter: plan, checks, no K/V repetition, TPU lowering.

Numerics (interpret mode, every case) are in test_conformance.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import BF16, F32, bias_op, mask_op, run_and_compare, spec_of

from flashpass import compat
from flashpass.kernels import Causal, CheckContext, ExtraSpec, Mask, Scale, Softcap, get_kernel
from flashpass.kernels._linear import linear_form
from flashpass.kernels.splash import SplashKernel, _plan

KERNEL = get_kernel("splash")
TPU = CheckContext(platform="tpu")


def _avals(closed):
    """Every equation output aval of a closed jaxpr, nested jaxprs included."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (v.aval for v in eqn.outvars)
            for sub in compat.subjaxprs_of_params(eqn.params):
                yield from walk(sub)

    return list(walk(closed.jaxpr))


def test_attributes_and_platforms():
    assert isinstance(KERNEL, SplashKernel)
    assert (KERNEL.platforms, KERNEL.interpret_platforms, KERNEL.grad) == (
        ("tpu",),
        ("cpu",),
        True,
    )
    spec = spec_of(ops=[Scale(0.125)])
    assert KERNEL.check(spec, TPU) == []
    assert KERNEL.check(spec, CheckContext(platform="cpu", interpret=True)) == []
    (reason,) = KERNEL.check(spec, CheckContext(platform="cpu"))
    assert "interpret=True" in reason
    assert KERNEL.check(spec, CheckContext(platform="gpu"))
    with pytest.raises(ValueError, match="power-of-two"):
        SplashKernel(max_block=100)


def test_plan_padding_and_mask_mechanisms():
    plain = _plan(spec_of(t=100, s=200, d=72, dv=200, ops=[Causal(100, -1e9)]), 512)
    # Keys padded to 128 are excluded by segment ids, which need 128-row query blocks.
    assert (plain.q_len, plain.kv_len, plain.segment_ids) == (128, 256, True)
    assert (plain.head_dim, plain.v_head_dim) == (72, 256)
    exact = _plan(spec_of(t=100, s=256, ops=[Causal(0, -1e9)]), 512)
    assert (exact.q_len, exact.segment_ids, exact.block_kv) == (112, False, 256)
    long = _plan(spec_of(t=1000, s=1000), 512)
    assert (long.q_len, long.block_q, long.kv_len, long.block_kv) == (1024, 512, 1024, 512)

    k, ke = mask_op(0, (2, 1, 1, 256))
    key = _plan(spec_of(t=100, s=256, ops=[k], extras=[ke]), 512)
    assert (key.key_masks, key.dynamic_masks, key.segment_ids) == ((0,), (), True)
    m, me = mask_op(1, (2, 1, 100, 256))
    both = _plan(spec_of(t=100, s=256, ops=[k, m], extras=[ke, me]), 512)
    assert (both.key_masks, both.dynamic_masks) == ((), (0, 1))


def test_scale_after_softcap_moves_in_front():
    """c * cap * tanh(x / cap) == (c * cap) * tanh(c * x / (c * cap)): accepted."""
    spec = spec_of(ops=[Scale(0.5), Softcap(10.0), Scale(2.0), Causal(0, -1e9)])
    form = linear_form(spec)
    assert (form.scale, form.softcap, form.causal_offset) == (1.0, 20.0, 0)
    assert KERNEL.check(spec, TPU) == []


_b, _be = bias_op(0, (1, 2, 16, 16))
_m, _me = mask_op(0, (1, 1, 16, 16), fill=-10.0)
REJECTED = {
    "bias": (spec_of(ops=[Scale(0.25), _b], extras=[_be]), "takes no bias"),
    "mask_fill_not_excluding": (spec_of(ops=[_m], extras=[_me]), "does not exclude"),
    "mask_before_softcap": (
        spec_of(ops=[Mask(0, (1, 1, 16, 16), -1e9), Softcap(30.0)], extras=[_me]),
        "about -cap",
    ),
    "negative_causal_offset": (spec_of(ops=[Causal(-2, -1e9)]), "offset -2"),
    "float64": (spec_of(dtype=np.float64, compute=np.float64), "float64"),
    "missing_extra": (spec_of(ops=[Mask(0, (1, 1, 16, 16), -1e9)]), "extra #0"),
    "bad_extra_shape": (
        spec_of(ops=[Mask(0, (1, 3, 16, 16), -1e9)], extras=[ExtraSpec((1, 3, 16, 16), bool)]),
        "broadcastable",
    ),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_check_rejects_with_reason(name):
    spec, needle = REJECTED[name]
    reasons = KERNEL.check(spec, TPU)
    assert reasons and any(needle in r for r in reasons), reasons
    with pytest.raises(ValueError, match="splash cannot run"):
        KERNEL.apply(spec, None, None, None)


@pytest.mark.parametrize("hkv", [1, 2], ids=["mqa", "gqa"])
def test_gqa_and_mqa_do_not_repeat_kv(hkv):
    """No array of K/V expanded to the query heads appears (GQA/MQA native)."""
    spec = spec_of(h=4, hkv=hkv, t=16, s=200, d=32, ops=[Scale(0.2), Causal(0, -1e9)])
    shapes = [jax.ShapeDtypeStruct(x, F32) for x in (spec.q_shape, spec.k_shape, spec.v_shape)]
    closed = jax.make_jaxpr(lambda q, k, v: KERNEL.apply(spec, q, k, v, interpret=True))(*shapes)
    expanded = {(2, 4, n, 32) for n in (200, 256)}
    assert not any(getattr(a, "shape", None) in expanded for a in _avals(closed))


def test_several_blocks_numerics():
    """2 query x 3 key blocks: online softmax across blocks, causal block
    skipping with an offset, key segment ids with left padding (empty rows)."""
    m, me = mask_op(0, (2, 1, 1, 300))
    spec = spec_of(h=4, hkv=2, t=200, s=300, ops=[Scale(0.2), m, Causal(100, -1e9)], extras=[me])
    plan = _plan(spec, 128)
    assert (plan.q_len // plan.block_q, plan.kv_len // plan.block_kv) == (2, 3)
    keep = np.ones(me.shape, bool)
    keep[1, ..., :130] = False  # example 1: rows 0..29 keep no key
    run_and_compare(SplashKernel(max_block=128), spec, [jnp.asarray(keep)], tol=2e-5)


def _lowering_shapes(spec):
    return [
        jax.ShapeDtypeStruct(spec.q_shape, spec.q_dtype),
        jax.ShapeDtypeStruct(spec.k_shape, spec.k_dtype),
        jax.ShapeDtypeStruct(spec.v_shape, spec.v_dtype),
        *[jax.ShapeDtypeStruct(e.shape, e.dtype) for e in spec.extras],
    ]


_key, _keye = mask_op(0, (2, 1, 1, 1000))
_dyn, _dyne = mask_op(0, (1, 8, 300, 300))
LOWERING = {
    "causal_gqa_bf16": spec_of(
        b=2, h=8, hkv=2, t=1024, d=128, dtype=BF16, ops=[Scale(0.088), Causal(0, -1e9)]
    ),
    "key_mask_softcap_odd": spec_of(
        h=4,
        hkv=1,
        t=300,
        s=1000,
        d=72,
        dv=40,
        ops=[Scale(0.1), Softcap(30.0), _key],
        extras=[_keye],
    ),
    "dynamic_mask": spec_of(
        b=1, h=8, t=300, d=64, dtype=BF16, ops=[Scale(0.1), _dyn], extras=[_dyne]
    ),
}


@pytest.mark.parametrize("name", list(LOWERING))
def test_lowers_for_tpu(name):
    """Forward and gradient lower to Mosaic TPU kernels without a TPU (Pallas
    validates block shapes when lowering)."""
    spec = LOWERING[name]

    def fwd(q, k, v, *extras):
        return KERNEL.apply(spec, q, k, v, extras)

    def grad(q, k, v, *extras):
        def loss(q, k, v):
            return fwd(q, k, v, *extras).astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    shapes = _lowering_shapes(spec)
    assert compat.lower_for_tpu(fwd, *shapes).count("tpu_custom_call") == 1
    # forward with residuals, dQ, dK/dV
    assert compat.lower_for_tpu(grad, *shapes).count("tpu_custom_call") == 3
