"""K/V caches read in the program's own layout (issue 41).

Hugging Face Flax, keras-hub and MaxText hold their caches as ``[B, S, H, D]``.
A site whose k and v are, up to reshapes, ``[B, S, Hkv, D]`` reports
``kv_layout() == "bshd"``, and a kernel that declares the layout
(`Kernel.kv_layouts`: blockwise) gets the arrays as they are: the rewritten
program holds no transpose of the cache.  The decode path slices its chunks
from them and equals the reference forward and gradient (the backward
transposes, a training step's cost); kernels that do not declare the layout
get the canonical one, as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.kernels.blockwise import BlockwiseKernel
from flashpass.kernels.reference import reference_attention
from flashpass.spec import AttentionSpec, ExtraSpec, KvLengths, Scale

B, H, S, D = 2, 4, 96, 8


def step(layout: str):
    x, c = ("bhtd", "bhsd") if layout == "bhsd" else ("bthd", "bshd")
    seq = 2 if layout == "bhsd" else 1

    def attend(q, k, v, lengths):
        s = jnp.einsum(f"{x},{c}->bhts", q, k) * D**-0.5
        keep = jnp.arange(k.shape[seq])[None, :] < lengths[:, None]
        s = jnp.where(keep[:, None, None, :], s, -1e9)
        return jnp.einsum(f"bhts,{c}->{x}", jax.nn.softmax(s, axis=-1), v)

    return attend


def _args(layout: str, t: int = 1, hkv: int = H):
    rng = np.random.default_rng(0)

    def shape(h, n):
        return (B, h, n, D) if layout == "bhsd" else (B, n, h, D)

    q, k, v = (
        jnp.asarray(rng.standard_normal(s), jnp.float32)
        for s in (shape(H, t), shape(hkv, S), shape(hkv, S))
    )
    return q, k, v, jnp.asarray([17, 96], jnp.int32)


def _cache_transposes(jaxpr, shape) -> int:
    return sum(
        1
        for e in jaxpr.eqns
        if e.primitive.name == "transpose" and tuple(e.invars[0].aval.shape) == shape
    )


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_decode_step_reads_the_cache_as_held(layout):
    fn = step(layout)
    opt = flashpass.optimize(fn, kernel=BlockwiseKernel(block_k=16))
    args = _args(layout)
    assert len(opt.explain(*args).rewrites) == 1
    jaxpr = opt.rewritten_jaxpr(*args)
    assert _cache_transposes(jaxpr.jaxpr, args[1].shape) == 0, jaxpr
    np.testing.assert_allclose(opt(*args), fn(*args), rtol=2e-5, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_decode_step_gradient_in_layout(layout):
    fn = step(layout)
    opt = flashpass.optimize(fn, kernel=BlockwiseKernel(block_k=16))
    args = _args(layout)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v, args[3]) ** 2)

    want = jax.grad(loss(fn), argnums=(0, 1, 2))(*args[:3])
    got = jax.grad(loss(opt), argnums=(0, 1, 2))(*args[:3])
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_site_layout():
    """`AttentionSite.kv_layout`: the program's order of (batch, key, head)."""
    from flashpass.graph import build_scopes
    from flashpass.patterns import match_scopes
    from flashpass.pipeline import trace

    def layouts(fn, args):
        closed, _ = trace(fn, [jax.typeof(a) for a in args])
        sites, _ = match_scopes(build_scopes(closed))
        return [site.kv_layout() for _, site in sites]

    assert layouts(step("bshd"), _args("bshd")) == ["bshd"]
    assert layouts(step("bhsd"), _args("bhsd")) == ["bhsd"]
    # Prefill (T = S) in [B, S, H, D]: the same reading.
    assert layouts(step("bshd"), _args("bshd", t=S)) == ["bshd"]


def test_grouped_queries_in_bshd():
    fn = step("bshd")

    def gqa(q, k, v, lengths):  # kv heads repeated as Hugging Face's GQA does
        rep = H // 2
        return fn(q, jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2), lengths)

    opt = flashpass.optimize(gqa, kernel=BlockwiseKernel(block_k=16))
    args = _args("bshd", t=2, hkv=2)
    report = opt.explain(*args)
    assert len(report.rewrites) == 1, report
    np.testing.assert_allclose(opt(*args), gqa(*args), rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_kernel_apply_in_bshd_equals_canonical():
    """`BlockwiseKernel.apply(kv_layout="bshd")`, decode path and tiled path."""
    kernel = BlockwiseKernel(block_k=16)
    for t in (1, 40):
        spec = AttentionSpec(
            B, H, H, t, S, D, D, *["float32"] * 6,
            score_ops=(Scale(0.3), KvLengths(0, (B, 1, 1, 1), -1e9, 0)),
            extras=(ExtraSpec((B, 1, 1, 1), np.int32),),
        )  # fmt: skip
        q, k, v, n = _args("bhsd", t=t)
        ln = n.reshape(B, 1, 1, 1)
        want = reference_attention(spec, q, k, v, (ln,))
        kt, vt = (jnp.swapaxes(x, 1, 2) for x in (k, v))
        got = kernel.apply(spec, q, kt, vt, (ln,), kv_layout="bshd")
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="kv_layout"):
        kernel.apply(spec, q, k, v, (ln,), kv_layout="sbhd")


def test_cost_model_reads_the_layout():
    """One query per kv head at 4096 keys: kept as written over a ``[B, H, S, D]``
    cache (the original is as fast), rewritten over ``[B, S, H, D]`` (whose
    original products are slower on CPU: `DECODE_MIN_KV_LEN_ONE_ROW_BSHD`)."""
    from flashpass.kernels.blockwise.cost import (
        DECODE_MIN_KV_LEN_ONE_ROW,
        DECODE_MIN_KV_LEN_ONE_ROW_BSHD,
    )

    s = 4096
    assert DECODE_MIN_KV_LEN_ONE_ROW_BSHD <= s < DECODE_MIN_KV_LEN_ONE_ROW

    def args(layout):
        def shape(n):
            return (B, H, n, D) if layout == "bhsd" else (B, n, H, D)

        return (
            jax.ShapeDtypeStruct(shape(1), jnp.float32),
            jax.ShapeDtypeStruct(shape(s), jnp.float32),
            jax.ShapeDtypeStruct(shape(s), jnp.float32),
            jax.ShapeDtypeStruct((B,), jnp.int32),
        )

    kept = flashpass.optimize(step("bhsd")).explain(*args("bhsd"))
    assert not kept.rewrites and "faster as written" in str(kept), kept
    done = flashpass.optimize(step("bshd")).explain(*args("bshd"))
    assert [r.kernel for r in done.rewrites] == ["blockwise"], done
