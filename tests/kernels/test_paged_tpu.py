"""The TPU decode path: JAX's paged-attention kernel over a contiguous KV cache.

Numerics in TPU interpret mode against a dense float64 attention written here
(`_dense`), independent of `reference_attention`, which is the kernel's own
backward: forward and gradients, per row (`kernel_testing.row_err`), so one
key too many or too few in a long row fails.  GQA, several queries per row, ragged lengths
including 0 and the whole cache, a cache that is not whole pages, a head dim
above 128, a soft-cap.  Checks: what it declines and why; that a decode site
on TPU picks it by default and a prefill site does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import (
    BF16,
    BF16_OUT_TOL,
    F32,
    mask_op,
    qkv,
    rel_err,
    row_err,
    run_and_compare,
    spec_of,
)

import flashpass
from flashpass.kernels import Causal, CheckContext, Scale, Softcap
from flashpass.kernels.paged_tpu import MAX_QUERIES, PagedTpuKernel
from flashpass.spec import KvLengths, Window

KERNEL = PagedTpuKernel()
CTX = CheckContext(platform="cpu", interpret=True, explicit=True)


def _decode(*, b=4, h=4, hkv=2, t=1, s=320, d=128, lengths_shape=None, ops=(), dtype=BF16):
    shape = lengths_shape or (b, 1, 1, 1)
    op = KvLengths(0, shape, -1e9, 0)
    return spec_of(
        b=b,
        h=h,
        hkv=hkv,
        t=t,
        s=s,
        d=d,
        dtype=dtype,
        compute=dtype,
        ops=[Scale(d**-0.5), *ops, op],
        extras=[(shape, "int32")],
    )


def _dense(spec, q, k, v, *extras):
    """Attention as the spec's ops say, in plain float64 jnp: the oracle for
    outputs and gradients (``jax.vjp`` of this)."""
    g = spec.heads // spec.kv_heads
    k, v = (jnp.repeat(x, g, axis=1) for x in (k, v))
    s = jnp.einsum("bhtd,bhsd->bhts", q, k)
    key = jnp.arange(spec.kv_len)[None, None, None, :]
    for op in spec.score_ops:
        if isinstance(op, Scale):
            s = s * op.value
        elif isinstance(op, Softcap):
            s = op.cap * jnp.tanh(s / op.cap)
        elif isinstance(op, KvLengths):
            s = jnp.where(key < extras[op.index] + op.shift, s, op.fill)
        else:
            raise AssertionError(f"_dense has no {op}")
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return jnp.einsum("bhts,bhsd->bhtd", p / jnp.sum(p, axis=-1, keepdims=True), v)


def _oracle(spec):
    return lambda *arrays: _dense(spec, *arrays)


def _lengths(values, shape=None):
    values = np.asarray(values, np.int32)
    return jnp.asarray(values.reshape(shape or (len(values), 1, 1, 1)))


@pytest.mark.parametrize(
    "case",
    [
        dict(),  # one query, GQA, a cache of 320 keys (4 pages of 80)
        dict(t=3, hkv=1),  # three queries per row, MQA
        dict(d=256, s=1024, h=2, hkv=2),  # pages of 128, two compute blocks
        dict(ops=(Softcap(20.0),)),
    ],
    ids=["gqa", "queries_mqa", "head_dim_256", "softcap"],
)
def test_numerics_and_gradients_match_the_reference(case):
    """Rows of length 0 (the mean of v), 1, 129 (a page and a key, or two) and
    the whole cache; outputs and gradients against float64."""
    spec = _decode(**case)
    assert KERNEL.check(spec, CTX) == []
    lengths = _lengths([0, 1, 129, spec.kv_len])
    run_and_compare(
        KERNEL, spec, [lengths], tol=3e-2, grad=True, interpret=True, reference=_oracle(spec)
    )


def test_one_key_more_is_outside_the_tolerance():
    """The check above sees a kernel that reads one key too many in a long row
    (129 -> 130): per row, that moves the output far beyond the bfloat16
    tolerance, though not by the old whole-tensor measure."""
    spec = _decode()
    q, k, v = qkv(spec)
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
        right = _dense(spec, q, k, v, _lengths([0, 1, 129, 320]))
        wrong = _dense(spec, q, k, v, _lengths([0, 1, 130, 320]))
    assert row_err(wrong, right) > 3 * BF16_OUT_TOL
    assert rel_err(wrong, right) < 3e-2  # what the whole-tensor measure let through


def test_several_lengths_ops_take_the_minimum():
    ops = [Scale(0.25), KvLengths(0, (2, 1, 1, 1), -1e9, 0), KvLengths(1, (2, 1, 1, 1), -1e9, 1)]
    extras = [((2, 1, 1, 1), "int32"), ((2, 1, 1, 1), "int32")]
    spec = spec_of(b=2, h=2, t=1, s=256, d=128, dtype=BF16, compute=BF16, ops=ops, extras=extras)
    assert KERNEL.check(spec, CTX) == []
    lengths = [_lengths([150, 7]), _lengths([40, 255])]
    run_and_compare(KERNEL, spec, lengths, tol=3e-2, interpret=True, reference=_oracle(spec))


@pytest.mark.parametrize(
    "spec,word",
    [
        (_decode(dtype=F32), "float32"),
        (_decode(dtype=np.dtype(np.float16)), "float16"),
        (_decode(t=MAX_QUERIES + 1), "queries per row"),
        # Three queries at the end of the cache, causal among them: three key counts.
        (_decode(t=3, ops=(Causal(317, -1e9),)), "causal"),
        (_decode(lengths_shape=(4, 4, 1, 1)), "vary over heads"),
        (_decode(ops=(Window(64, 0, -1e9),)), "window"),
        (_decode(d=64), "multiple of 128"),
        (_decode(s=300), "not a multiple of 16"),
    ],
    ids=[
        "float32",
        "float16",
        "too_many_queries",
        "causal_among_queries",
        "per_head_lengths",
        "window",
        "head_dim_64",
        "kv_len_300",
    ],
)
def test_declines_with_the_reason(spec, word):
    reasons = KERNEL.check(spec, CTX)
    assert any(word in r for r in reasons), reasons
    with pytest.raises(ValueError, match="paged_tpu cannot run"):
        KERNEL.apply(
            spec,
            *(jnp.zeros(x, spec.q_dtype) for x in (spec.q_shape, spec.k_shape, spec.v_shape)),
            [_lengths([1, 2, 3, 4])],
        )


def test_key_masks_and_platforms_are_declined():
    m, me = mask_op(1, (4, 1, 1, 320))
    spec = _decode(ops=(m,))
    spec = spec.__class__(**{**spec.__dict__, "extras": (*spec.extras, me)})
    assert any("key mask" in r for r in KERNEL.check(spec, CTX))
    reasons = KERNEL.check(_decode(), CheckContext(platform="gpu"))
    assert any("runs on tpu" in r for r in reasons), reasons


def _decode_step(q, k, v, lengths):
    s = jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=jnp.float32) * 0.088
    keep = jnp.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
    p = jax.nn.softmax(jnp.where(keep, s, -1e9), axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bhsd->bhtd", p, v)


def test_tpu_default_order_picks_it_for_decode_only():
    """On TPU a decode step against a ragged cache goes to the paged kernel; a
    64-query block of the same code does not (splash and JAX's flash kernel take
    no kv lengths: our own flash_tpu), with the paged kernel's reason in the report."""
    rng = np.random.default_rng(0)
    kv = [jnp.asarray(rng.standard_normal((2, 4, 512, 128)), jnp.bfloat16) for _ in range(2)]
    lengths = jnp.array([100, 512], jnp.int32)
    for t, expected in ((1, "paged_tpu"), (64, "flash_tpu")):
        q = jnp.asarray(rng.standard_normal((2, 4, t, 128)), jnp.bfloat16)
        report = flashpass.optimize(_decode_step, platform="tpu").explain(q, *kv, lengths)
        assert report.kernels == [expected], str(report)
        if t > 1:
            (rewrite,) = report.rewrites
            assert any("queries per row" in r for r in rewrite.rejected["paged_tpu"])


def test_end_to_end_under_jit_in_interpret_mode():
    """The first call under jax.jit, rewritten to the paged kernel, matches
    the original program."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((3, 4, 1, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((3, 4, 640, 128)), jnp.bfloat16) for _ in range(2))
    lengths = jnp.array([0, 300, 640], jnp.int32)
    opt = flashpass.optimize(_decode_step, kernel="paged_tpu", interpret=True)
    out = jax.jit(opt)(q, k, v, lengths)
    assert opt.reports[-1].kernels == ["paged_tpu"]
    with jax.enable_x64(True):
        ref = _decode_step(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), lengths)
    assert row_err(out, ref) < BF16_OUT_TOL


@pytest.mark.parametrize("t", [1, 4])
def test_lowers_to_mosaic_tpu(t):
    """Forward and gradient lower for TPU from this host: one Mosaic call in
    each (the gradient's backward is the reference's plain XLA)."""
    from flashpass import compat

    spec = _decode(t=t, s=1024)
    shapes = [jax.ShapeDtypeStruct(x, jnp.bfloat16) for x in (spec.q_shape, spec.k_shape)]
    shapes += [jax.ShapeDtypeStruct(spec.v_shape, jnp.bfloat16)]
    shapes += [jax.ShapeDtypeStruct((4, 1, 1, 1), jnp.int32)]

    def fwd(q, k, v, n):
        return KERNEL.apply(spec, q, k, v, [n])

    def grad(q, k, v, n):
        loss = lambda q, k, v: fwd(q, k, v, n).astype(jnp.float32).sum()  # noqa: E731
        return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

    assert compat.lower_for_tpu(fwd, *shapes).count("tpu_custom_call") == 1
    assert compat.lower_for_tpu(grad, *shapes).count("tpu_custom_call") == 1
