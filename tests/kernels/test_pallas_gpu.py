"""The Pallas GPU (Triton) attention adapter: plan, checks, precision, lowering.

Numerics for every case are in test_conformance.py (interpret mode here,
natively on a GPU); this file adds the key-exclusion column path.  From JAX
0.11.1, which deprecates the Triton kernel, the adapter declines every site
(`test_declined_where_jax_deprecates_triton`); the plan and the spec checks
are still tested there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from kernel_testing import (
    BF16,
    F32,
    bias_op,
    mask_op,
    run_and_compare,
    spec_of,
)

from flashpass import compat
from flashpass.kernels import Causal, CheckContext, Scale, Softcap, get_kernel
from flashpass.kernels.pallas_gpu import PallasGpuKernel
from flashpass.spec import Segments

from jax_versions import requires_triton

KERNEL = get_kernel("pallas_gpu")
GPU = CheckContext(platform="gpu")


def _plan(spec):
    return KERNEL._plan(spec)


def _shapes(spec):
    return [
        jax.ShapeDtypeStruct(spec.q_shape, spec.q_dtype),
        jax.ShapeDtypeStruct(spec.k_shape, spec.k_dtype),
        jax.ShapeDtypeStruct(spec.v_shape, spec.v_dtype),
        *[jax.ShapeDtypeStruct(e.shape, e.dtype) for e in spec.extras],
    ]


@requires_triton
def test_attributes_and_platforms():
    assert isinstance(KERNEL, PallasGpuKernel)
    assert (KERNEL.platforms, KERNEL.interpret_platforms, KERNEL.grad) == (
        ("gpu",),
        ("cpu",),
        True,
    )
    spec = spec_of(t=256, ops=[Scale(0.125)])
    assert KERNEL.check(spec, GPU) == []
    assert KERNEL.check(spec, CheckContext(platform="cpu", interpret=True)) == []
    (reason,) = KERNEL.check(spec, CheckContext(platform="tpu"))
    assert "runs on gpu, not tpu" in reason
    with pytest.raises(ValueError, match="power of two"):
        PallasGpuKernel(block_q=48)


def test_declined_where_jax_deprecates_triton():
    """JAX 0.11.1+ deprecates the Triton kernel: every site is declined with
    that reason, on every platform, and `apply` refuses before importing it."""
    import flashpass

    spec = spec_of(t=256, ops=[Scale(0.125)])
    for ctx in (GPU, CheckContext(platform="cpu", interpret=True)):
        reasons = KERNEL.check(spec, ctx)
        assert any("deprecates" in r for r in reasons) == (not compat.TRITON_ATTENTION), reasons
    if compat.TRITON_ATTENTION:
        return
    with pytest.raises(ValueError, match="pallas_gpu runs on JAX < 0.11.1"):
        KERNEL.apply(spec, None, None, None)
    q = jnp.ones((1, 2, 256, 16), jnp.float32)
    attn = lambda q, k, v: jax.nn.softmax(jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.125) @ v  # noqa: E731
    report = flashpass.optimize(attn, kernel=["pallas_gpu", "blockwise"], interpret=True).explain(
        q, q, q
    )
    assert report.kernels == ["blockwise"], str(report)
    assert "deprecates" in report.rewrites[0].rejected["pallas_gpu"][0]


def test_plan_lengths_and_key_exclusion():
    # Causal offset: queries placed `offset` rows down; one common length.
    p = _plan(spec_of(t=19, s=37, ops=[Causal(18, -1e9)]))
    assert (p.front, p.length, p.segments, p.column) == (18, 64, True, False)
    # Real query rows would sit on padded keys: the head-dim column excludes them.
    p = _plan(spec_of(t=30, s=20, d=16, ops=[Causal(0, -1e9)]))
    assert (p.length, p.segments, p.column, p.head_dim) == (32, False, True, 17)
    # Key masks always use the column; long sequences pad to the block size.
    m, me = mask_op(0, (2, 1, 1, 300))
    p = _plan(spec_of(t=300, d=64, dv=32, ops=[m], extras=[me]))
    assert (p.length, p.column, p.head_dim, p.block_q, p.block_bwd) == (384, True, 65, 128, 32)
    # No padding, no masks: nothing added; tiny head dims padded to Triton's 16.
    p = _plan(spec_of(t=256, d=8))
    assert (p.length, p.segments, p.column, p.head_dim) == (256, False, False, 16)


@requires_triton
def test_decode_shapes_declined_unless_named():
    """Queries and keys are padded to one length: T=1, S=4096 is 4096x the work."""
    spec = spec_of(t=1, s=4096, ops=[Scale(0.125)])
    (reason,) = KERNEL.check(spec, GPU)
    assert "4096.0x the work" in reason and "kernel='pallas_gpu'" in reason
    assert KERNEL.check(spec, CheckContext(platform="gpu", explicit=True)) == []


_b, _be = bias_op(0, (1, 2, 16, 16))
_q, _qe = mask_op(0, (2, 1, 16, 16))
REJECTED = {
    "bias": (spec_of(ops=[Scale(0.25), _b], extras=[_be]), "takes no bias"),
    "softcap": (spec_of(ops=[Scale(0.25), Softcap(20.0)]), "soft-capping"),
    "query_mask": (spec_of(ops=[_q], extras=[_qe]), "varies over queries"),
    "zero_scale": (spec_of(ops=[Scale(0.0)]), "not positive"),
    "float64": (spec_of(dtype=np.float64, compute=np.float64), "float64"),
    # The kernel's one id array serves queries and keys: separate ids are not exact.
    "segments": (
        spec_of(
            ops=[Scale(0.25), Causal(0, -1e9), Segments(0, 1, -1e9)],
            extras=[((2, 1, 16, 1), np.int32), ((2, 1, 1, 16), np.int32)],
        ),
        "one segment-id array for queries and keys",
    ),
    # One array (`Segments.same`), but the causal offset shifts query rows against it.
    "segments_offset": (
        spec_of(
            t=12,
            s=16,
            ops=[Scale(0.25), Causal(4, -1e9), Segments(0, 1, -1e9, same=True)],
            extras=[((2, 1, 12, 1), np.int32), ((2, 1, 1, 16), np.int32)],
        ),
        "causal offset 4",
    ),
    "segments_per_head": (
        spec_of(
            ops=[Segments(0, 1, -1e9, same=True)],
            extras=[((2, 2, 16, 1), np.int32), ((2, 2, 1, 16), np.int32)],
        ),
        "differ between heads",
    ),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_check_rejects_with_reason(name):
    spec, needle = REJECTED[name]
    reasons = KERNEL.check(spec, GPU)
    assert reasons and any(needle in r for r in reasons), reasons
    with pytest.raises(ValueError, match="pallas_gpu cannot run"):
        KERNEL.apply(spec, None, None, None)


def _packed(q, k, v, ids):
    """Packed documents, causal: the ids compared with themselves (one array)."""
    t = q.shape[2]
    keep = (ids[:, :, None] == ids[:, None, :])[:, None] & jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(keep, jnp.einsum("bhtd,bhsd->bhts", q, k) * 0.3, -1e9)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)


@requires_triton
@pytest.mark.parametrize("t", [16, 21], ids=["t16", "t21-padded"])
def test_segment_ids_of_one_array_numerics(t):
    """The program's ids, proven one array, become the kernel's segment_ids
    (padded keys get an id no query has): forward and gradients."""
    import flashpass

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 2, t, 16)), jnp.float32) for _ in range(3))
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (2, t)), axis=1).astype(np.int32))
    opt = flashpass.optimize(
        _packed, kernel=PallasGpuKernel(block_q=16, block_k=16, block_bwd=16), interpret=True
    )
    report = opt.explain(q, k, v, ids)
    assert report.kernels == ["pallas_gpu"], str(report)
    ops = report.rewrites[0].spec["score_ops"]
    assert any(op["op"] == "segments" and op["same"] for op in ops), ops
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    got = jax.jit(jax.value_and_grad(loss(opt), argnums=(0, 1, 2)))(q, k, v, ids)
    want = jax.value_and_grad(loss(_packed), argnums=(0, 1, 2))(q, k, v, ids)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5 * float(jnp.abs(w).max()))


@requires_triton
def test_segment_ids_of_two_arrays_are_kept_for_blockwise():
    import flashpass

    def separate(q, k, v, q_ids, kv_ids):
        keep = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
        s = jnp.where(keep, jnp.einsum("bhtd,bhsd->bhts", q, k), -1e9)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 2, 16, 16)), jnp.float32) for _ in range(3))
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (2, 16)), axis=1).astype(np.int32))
    opt = flashpass.optimize(separate, kernel=["pallas_gpu", "blockwise"], interpret=True)
    report = opt.explain(q, k, v, ids, ids)
    assert report.kernels == ["blockwise"], str(report)
    assert "one array" in report.rewrites[0].rejected["pallas_gpu"][0]


@requires_triton
def test_column_exclusion_numerics():
    """More query rows than keys, causal: padded keys excluded by the column."""
    spec = spec_of(h=4, hkv=2, t=30, s=20, ops=[Scale(0.3), Causal(0, -1e9)])
    assert _plan(spec).column
    run_and_compare(KERNEL, spec, tol=2e-5, interpret=True)


def _dot_precisions(fn, *args):
    """Precision of every dot_general inside the traced pallas_call bodies."""
    found = []

    def walk(jaxpr, inside):
        for eqn in jaxpr.eqns:
            if inside and eqn.primitive is lax.dot_general_p:
                found.append(eqn.params["precision"])
            for sub in compat.subjaxprs_of_params(eqn.params):
                walk(sub, inside or eqn.primitive.name == "pallas_call")

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return found


@requires_triton
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_float32_dots_are_ieee_not_tf32(dtype):
    """DEFAULT precision makes Triton use TF32; float32 kernels trace at HIGHEST,
    in the forward and in the backward."""
    spec = spec_of(t=32, dtype=dtype, ops=[Scale(0.25), Causal(0, -1e9)])

    def grad(q, k, v):
        return jax.grad(lambda q: KERNEL.apply(spec, q, k, v).astype(jnp.float32).sum())(q)

    precisions = _dot_precisions(grad, *_shapes(spec))
    assert len(precisions) >= 6  # forward (2 dots) and the fused backward
    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    if dtype == F32:
        assert all(p == highest for p in precisions), precisions
    else:
        assert not any(p == highest for p in precisions), precisions


@requires_triton
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "key_mask"])
def test_lowers_for_gpu(masked):
    """Forward and gradient lower to Triton kernels without a GPU."""
    ops = [Scale(0.088), Causal(0, -1e9)]
    extras = []
    if masked:
        m, me = mask_op(0, (2, 1, 1, 1000))
        ops, extras = [Scale(0.088), m], [me]
    spec = spec_of(h=8, hkv=2, t=1000, d=128, dtype=BF16, ops=ops, extras=extras)

    def fwd(q, k, v, *extras):
        return KERNEL.apply(spec, q, k, v, extras)

    def grad(q, k, v, *extras):
        loss = lambda q, k, v: fwd(q, k, v, *extras).astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def targets(fn):
        module = compat.parse_stablehlo(compat.lower_for_gpu(fn, *_shapes(spec)))
        return [t for _, _, t in compat.stablehlo_ops(module) if t]

    assert targets(fwd) == ["__gpu$xla.gpu.triton"]
    # forward with residuals, backward preprocessing, fused dQ/dK/dV
    assert targets(grad) == ["__gpu$xla.gpu.triton"] * 3
