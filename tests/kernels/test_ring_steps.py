"""Ring steps (`Kernel.ring_step`, `flashpass.ring.cases`) on one device.

A ring of two devices seen from device 1: its query block (rows ``L..2L-1``)
meets key block 0 (``d = L``: whole for a causal mask) and its own block 1
(``d = 0``: the diagonal).  Each kernel declaring ring steps runs both steps
with the specs `ring_steps` translates them to; merged by their row
statistics they must equal the float64 reference's rows ``L..2L-1``, and the
steps' backward, given the merged (global) statistics and output, must sum to
its gradients.  The translation itself is checked case by case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import BF16, F32, normal, rel_err, spec_of

from flashpass.kernels import Causal, CheckContext, Scale, Softcap
from flashpass.kernels.blockwise import BlockwiseKernel
from flashpass.kernels.pallas_gpu import PallasGpuKernel
from flashpass.kernels.reference import reference_attention
from flashpass.kernels.splash import SplashKernel
from flashpass.ring import cases as ring_steps
from flashpass.spec import Chunk, Dropout, KvLengths, Prefix, Segments, Sink, Window

from jax_versions import requires_triton

L = 32  # block length: the global sequence is 2L

CASES = {
    "full": [Scale(0.25)],
    "causal": [Scale(0.25), Causal(0, -1e9)],
    "window": [Scale(0.25), Window(40, 0, -1e9)],
    "softcap": [Scale(0.25), Softcap(5.0), Causal(0, -jnp.inf)],
}

#: Kernels declaring ring steps, as the tests run them (here: on this host).
KERNELS = {
    "blockwise": (lambda: BlockwiseKernel(block_q=16, block_k=16, head_loop=False), False),
    "blockwise_heads": (lambda: BlockwiseKernel(block_q=16, block_k=16, head_loop=True), False),
    # Pallas kernels in interpret mode (16-wide blocks: several per step).
    "pallas_gpu": (lambda: PallasGpuKernel(block_q=16, block_k=16, block_bwd=16), True),
    "splash": (lambda: SplashKernel(max_block=128), True),
}

TOL = {F32: 2e-5, BF16: 2e-2}


def _global_spec(ops, dtype):
    return spec_of(b=2, h=4, hkv=2, t=2 * L, d=16, ops=ops, dtype=dtype)


def _steps(spec):
    """Device 1's steps: (d, key slice) for key blocks 0 and 1."""
    local = spec_of(b=2, h=4, hkv=2, t=L, d=16, ops=spec.score_ops, dtype=spec.q_dtype)
    out = []
    for d, keys in ((L, slice(0, L)), (0, slice(L, 2 * L))):
        ops = ring_steps.local_ops(local, d)
        assert isinstance(ops, tuple), ops
        out.append((ring_steps.step_spec(local, ops), keys))
    return out


def _reference(spec, q, k, v, dout):
    """Rows L..2L-1 of the float64 reference and their vjp w.r.t. q, k, v."""
    with jax.enable_x64(True):
        wide = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]

        def rows(q, k, v):
            return reference_attention(spec, q, k, v, (), dtype=jnp.float64)[:, :, L:]

        out, vjp = jax.vjp(rows, *wide)
        return out, vjp(jnp.asarray(dout, jnp.float64))


#: (kernel, case, dtype): every case once in float32, the causal one in
#: bfloat16 and through the head loop (each compiles two steps' passes).
COMBINATIONS = [("blockwise", case, F32) for case in CASES] + [
    ("blockwise", "causal", BF16),
    ("blockwise_heads", "causal", F32),
    *(
        pytest.param("pallas_gpu", case, dtype, marks=requires_triton)
        for case, dtype in (("full", F32), ("causal", F32), ("causal", BF16))
    ),
    *(("splash", case, F32) for case in CASES),
    ("splash", "causal", BF16),
]


@pytest.mark.parametrize(
    "name, case, dtype", COMBINATIONS, ids=lambda x: getattr(x, "name", str(x))
)
def test_steps_merge_to_the_reference(name, case, dtype):
    make, interpret = KERNELS[name]
    kernel = make()
    spec = _global_spec(CASES[case], dtype)
    q, k, v = (
        normal(s, i, dtype) for i, s in enumerate((spec.q_shape, spec.k_shape, spec.v_shape))
    )
    qb = q[:, :, L:]
    ctx = CheckContext("cpu", interpret=interpret, explicit=True)
    steps = _steps(spec)
    for local, _ in steps:
        assert kernel.check(local, ctx) == [], local

    parts = [
        kernel.step_forward(local, qb, k[:, :, keys], v[:, :, keys], interpret=interpret)
        for local, keys in steps
    ]
    for o, m, den in parts:
        assert o.dtype == jnp.float32 and m.shape == den.shape == (2, 4, L)
    top = jnp.max(jnp.stack([m for _, m, _ in parts]), axis=0)
    weights = [den * jnp.exp(m - top) for _, m, den in parts]
    den = sum(weights)
    out = sum(o * (w / den)[..., None] for (o, _, _), w in zip(parts, weights, strict=True))

    dout = normal(out.shape, 9, dtype)
    ref, (dq_ref, dk_ref, dv_ref) = _reference(spec, q, k, v, dout)
    assert rel_err(out, ref) < TOL[dtype], case

    dq = jnp.zeros(qb.shape, jnp.float32)
    dk, dv = [], []
    for local, keys in steps:
        dq_b, dk_b, dv_b, _ = kernel.step_backward(
            local, qb, k[:, :, keys], v[:, :, keys], (), out, top, den, dout, (),
            interpret=interpret,
        )  # fmt: skip
        dq = dq + dq_b.astype(jnp.float32)
        dk.append(dk_b)
        dv.append(dv_b)
    assert rel_err(dq, dq_ref[:, :, L:]) < TOL[dtype]
    assert rel_err(jnp.concatenate(dk, axis=2), dk_ref) < TOL[dtype]
    assert rel_err(jnp.concatenate(dv, axis=2), dv_ref) < TOL[dtype]


# --------------------------------------------------------------------------- translation


def _local(*ops, extras=()):
    return spec_of(t=L, ops=ops, extras=extras)


def test_causal_steps():
    spec = _local(Scale(0.5), Causal(0, -1e9))
    assert ring_steps.local_ops(spec, 0) == (Scale(0.5), Causal(0, -1e9))
    assert ring_steps.local_ops(spec, L) == (Scale(0.5),)  # an earlier block: whole
    assert ring_steps.local_ops(spec, -L) == "excluded"  # a later one
    # A causal offset reaching into the next block: an edge below the diagonal.
    reach = _local(Causal(4, -1e9))
    assert ring_steps.local_ops(reach, -L) == "a causal edge below the diagonal"
    assert ring_steps.local_ops(reach, 0) == (Causal(4, -1e9),)


def test_window_steps():
    spec = _local(Window(40, 0, -1e9))
    assert ring_steps.local_ops(spec, 0) == (Window(40, 0, -1e9),)  # the diagonal block
    assert ring_steps.local_ops(spec, L) == (Window(8, None, -1e9),)  # no upper edge left
    spec = _local(Window(40, 2, -1e9))
    assert ring_steps.local_ops(spec, 0) == (Window(40, 2, -1e9),)
    assert ring_steps.local_ops(spec, L) == (Window(8, None, -1e9),)
    # Block 2L before the queries: the window's lower edge lies above the diagonal.
    assert ring_steps.local_ops(spec, 2 * L) == "a window edge off the diagonal's side"
    assert ring_steps.local_ops(spec, 3 * L) == "excluded"
    # The next block: a right edge of 2 reaches its first keys, below the diagonal.
    assert ring_steps.local_ops(spec, -L) == "a window edge off the diagonal's side"
    assert ring_steps.local_ops(_local(Window(40, 0, -1e9)), -L) == "excluded"


def test_an_excluded_block_wins_over_an_op_not_stated():
    """Whatever the order of the ops, a block one of them excludes is excluded
    (skipped), even when another could not be stated in local positions."""
    for ops in (
        (Window(4, 2, -1e9), Causal(0, -1e9)),
        (Causal(0, -1e9), Window(4, 2, -1e9)),
        (Chunk(8, -1e9), Causal(0, -1e9)),
    ):
        assert ring_steps.local_ops(_local(*ops), -L) == "excluded", ops


def test_device_dependent_ops_take_the_plain_step():
    assert "Chunk" in ring_steps.local_ops(_local(Chunk(8, -1e9), Causal(0, -1e9)), L)
    assert "Prefix" in ring_steps.local_ops(_local(Prefix(4, -1e9)), L)
    drop = Dropout(0, (1, 1, 1, 2), (2, 2, L, L), (), 32, "float32", 0.9)
    assert "dropout" in ring_steps.local_ops(_local(drop, extras=[((1, 1, 1, 2), np.uint32)]), 0)


def test_position_free_ops_stay_and_sinks_leave():
    """Segment ids stay (one array read at both positions only on the
    diagonal), kv lengths stay (the ring shifts the array to the block), the
    sink leaves (the ring's statistics start from it, once)."""
    extras = [((2, 1, L, 1), np.int32), ((2, 1, 1, L), np.int32), ((1, 2, 1, 1), np.float32)]
    extras.append(((2, 1, 1, 1), np.int32))
    seg = Segments(0, 1, -1e9, same=True)
    lengths = KvLengths(3, (2, 1, 1, 1), -1e9)
    spec = _local(Scale(0.5), seg, lengths, Sink(2, (1, 2, 1, 1)), extras=extras)
    assert ring_steps.local_ops(spec, 0) == (Scale(0.5), seg, lengths)
    off = ring_steps.local_ops(spec, L)
    assert off == (Scale(0.5), Segments(0, 1, -1e9, same=False), lengths)
    # The step's extras are sized to the blocks (ids of 2L keys: L).
    whole = _local(Scale(0.5), seg, extras=[((2, 1, L, 1), np.int32), ((2, 1, 1, 2 * L), np.int32)])
    assert ring_steps.step_spec(whole, off[:2]).extras[1].shape == (2, 1, 1, L)
    assert ring_steps.step_spec(whole, off[:2]).out_dtype == np.float32


def test_plan_steps_per_case():
    blockwise = BlockwiseKernel()
    ctx = CheckContext("cpu", explicit=True)
    spec = spec_of(t=L, ops=[Scale(0.25), Causal(0, -1e9)])
    steps = ring_steps.plan_steps(spec, 4, True, True, [blockwise], ctx)
    assert len(steps) == 4 and len(steps[0]) == 1 and all(len(c) == 2 for c in steps[1:])
    assert steps[0][0].kernel is blockwise and steps[0][0].spec.causal == Causal(0, -1e9)
    assert all(own.kernel is blockwise and own.spec.causal is None for own, _ in steps[1:])
    assert all(wrapped.skip for _, wrapped in steps[1:])
    assert ring_steps.describe(steps) == "blockwise"
    # No kernel with ring steps, local queries, unequal blocks: the plain step.
    plain = ring_steps.plan_steps(spec, 4, True, True, [], ctx)
    assert ring_steps.describe(plain) == ring_steps.PLAIN
    local_q = ring_steps.plan_steps(spec, 2, False, True, [blockwise], ctx)
    assert "local" in local_q[0][0].why
    cross = spec_of(t=L, s=2 * L, ops=[Scale(0.25)])
    assert "differ" in ring_steps.plan_steps(cross, 2, True, True, [blockwise], ctx)[1][0].why
    # An excluded block that a row may still need (kv lengths) is not skipped.
    kept = ring_steps.plan_steps(spec, 2, True, False, [blockwise], ctx)
    assert not kept[1][1].skip and kept[1][1].kernel is None


class _BrokenSteps(BlockwiseKernel):
    """A kernel whose ring step fails to trace."""

    name = "broken_steps"

    def step_forward(self, spec, q, k, v, extras=(), *, interpret=False):
        raise RuntimeError("no step here")


def test_a_step_kernel_that_fails_to_trace_is_probed_out():
    """Step kernels are chosen as a site's kernel is (`select.choose`): a step
    that fails to trace rejects that kernel for the case, with the error, and
    the next kernel (or the plain step) runs it; zig-zag is not used."""
    from flashpass.ring import zigzag

    blockwise, broken = BlockwiseKernel(), _BrokenSteps()
    ctx = CheckContext("cpu", explicit=True)
    spec = spec_of(t=L, ops=[Scale(0.25), Causal(0, -1e9)])
    steps = ring_steps.plan_steps(spec, 2, True, True, [broken, blockwise], ctx)
    assert ring_steps.describe(steps) == "blockwise"
    alone = ring_steps.plan_steps(spec, 2, True, True, [broken], ctx)
    assert ring_steps.describe(alone) == ring_steps.PLAIN
    assert "broken_steps: raised RuntimeError while tracing a ring step: no step here" in (
        alone[0][0].why
    )
    assert zigzag.plan(spec, 2, True, [broken], ctx) is None
    assert zigzag.plan(spec, 2, True, [broken, blockwise], ctx).kernel is blockwise


def test_zigzag_plan_and_its_reasons():
    """A causal ring is balanced (`flashpass.ring.zigzag`) with four static block
    specs one kernel takes; other rings keep the contiguous order, saying why."""
    from flashpass.ring import zigzag

    blockwise = BlockwiseKernel()
    ctx = CheckContext("cpu", explicit=True)
    spec = spec_of(t=L, ops=[Scale(0.25), Softcap(5.0), Causal(0, -1e9)])
    zz = zigzag.plan(spec, 4, True, [blockwise], ctx)
    c = L // 2
    assert zz is not None and zz.kernel is blockwise
    shapes = [(s.q_len, s.kv_len, s.causal) for s in (zz.diag, zz.diag_hi, zz.own, zz.wrapped)]
    assert shapes == [
        (c, c, Causal(0, -1e9)),
        (c, 2 * c, Causal(c, -1e9)),
        (2 * c, c, None),
        (c, 2 * c, None),
    ]
    assert zz.own.score_ops == (Scale(0.25), Softcap(5.0))  # the other ops, in order
    assert zigzag.plan(spec, 4, True, [], ctx) is None  # no kernel with ring steps
    assert zigzag.plan(spec, 4, False, [blockwise], ctx) is None
    cases = {
        "local": (spec, False),
        "one length": (spec_of(t=L, s=2 * L, ops=[Causal(0, -1e9)]), True),
        "odd": (spec_of(t=L + 1, ops=[Causal(0, -1e9)]), True),
        "only a causal": (spec_of(t=L, ops=[Window(8, 0, -1e9)]), True),
        "offset": (spec_of(t=L, ops=[Causal(2, -1e9)]), True),
        "full": (spec_of(t=L, ops=[Scale(0.25)]), True),
    }
    for name, (s, q_global) in cases.items():
        assert zigzag.reason(s, 4, q_global) is not None, name
    assert zigzag.reason(spec, 4, True) is None
