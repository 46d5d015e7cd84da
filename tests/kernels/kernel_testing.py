"""Helpers shared by the kernel tests (a plain module, not a conftest: tests/ has
its own conftest.py): specs, inputs, the float64 oracle, one-compile runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashpass import compat
from flashpass.kernels import AttentionSpec, Bias, ExtraSpec, Mask
from flashpass.kernels.reference import reference_attention

F32 = np.dtype(np.float32)
BF16 = np.dtype(jnp.bfloat16)

#: Interpret mode's (and small kernels') cost is XLA:CPU compile time; the
#: backend optimisation level changes speed, not floating-point semantics.
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def has_gpu() -> bool:
    return compat.gpu_compute_capability() is not None


requires_gpu = pytest.mark.skipif(not has_gpu(), reason="needs an NVIDIA GPU")


def spec_of(
    *,
    b=2,
    h=2,
    hkv=None,
    t=16,
    s=None,
    d=16,
    dv=None,
    ops=(),
    extras=(),
    dtype=F32,
    compute=F32,
    p_dtype=None,
    out_dtype=None,
) -> AttentionSpec:
    """An `AttentionSpec`; ``extras`` are `ExtraSpec`s or (shape, dtype) pairs."""
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
        extras=tuple(e if isinstance(e, ExtraSpec) else ExtraSpec(*e) for e in extras),
    )


def bias_op(index, shape, dtype=F32):
    return Bias(index, tuple(shape), dtype), ExtraSpec(tuple(shape), dtype)


def mask_op(index, shape, fill=-1e9):
    return Mask(index, tuple(shape), fill), ExtraSpec(tuple(shape), np.dtype(bool))


def normal(shape, seed: int, dtype=F32):
    """Standard-normal array from numpy (``jax.random`` compiles a program per
    shape, about a second each on CPU)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jnp.asarray(x).astype(dtype)


def qkv(spec: AttentionSpec, seed: int = 0):
    return (
        normal(spec.q_shape, 3 * seed, spec.q_dtype),
        normal(spec.k_shape, 3 * seed + 1, spec.k_dtype),
        normal(spec.v_shape, 3 * seed + 2, spec.v_dtype),
    )


def oracle(spec: AttentionSpec, q, k, v, *extras):
    """`reference_attention` in float64 on the (already rounded) inputs."""
    with jax.enable_x64(True):
        wide = [x if x.dtype == jnp.bool_ else jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        extras = [jnp.asarray(x, jnp.float64) if _real(x) else x for x in extras]
        return reference_attention(spec, *wide, extras, dtype=jnp.float64)


def _real(x) -> bool:
    """Differentiable (and widened to float64 for the oracle): not a boolean
    mask or integer (kv lengths, segment ids) extra."""
    return bool(jnp.issubdtype(x.dtype, jnp.floating))


def value_and_vjp(fn, arrays, cotangent):
    """``fn(*arrays)`` and its vjp w.r.t. every floating array."""
    diff = [i for i, a in enumerate(arrays) if _real(a)]

    def f(*d):
        full = list(arrays)
        for i, a in zip(diff, d, strict=True):
            full[i] = a
        return fn(*full)

    out, vjp = jax.vjp(f, *[arrays[i] for i in diff])
    return out, vjp(cotangent.astype(out.dtype))


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected| (NaN-aware: NaN gives inf)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def run_and_compare(kernel, spec, extras=(), *, tol, grad=True, interpret=True, seed=0):
    """Run ``kernel`` (one compile for forward and gradients) and compare with
    the float64 oracle.  Returns ``{name: relative error}``."""
    arrays = (*qkv(spec, seed), *extras)

    def run(*a):
        q, k, v, *ex = a
        return kernel.apply(spec, q, k, v, ex, interpret=interpret)

    errors = {}
    if not grad:
        out = fast_jit(run)(*arrays)
        assert out.shape == spec.out_shape and out.dtype == spec.out_dtype
        errors["out"] = rel_err(out, oracle(spec, *arrays))
    else:
        cotangent = normal(spec.out_shape, 1000 + seed)
        out, grads = fast_jit(lambda *a: value_and_vjp(run, a, cotangent))(*arrays)
        assert out.shape == spec.out_shape and out.dtype == spec.out_dtype
        with jax.enable_x64(True):
            wide = [jnp.asarray(a, jnp.float64) if _real(a) else a for a in arrays]
            expected, ref_grads = fast_jit(
                lambda *a: value_and_vjp(lambda *b: oracle(spec, *b), a, cotangent)
            )(*wide)
        errors["out"] = rel_err(out, expected)
        names = ["q", "k", "v"] + [f"extra{i}" for i, e in enumerate(extras) if _real(e)]
        for name, g, ref in zip(names, grads, ref_grads, strict=True):
            assert g.shape == ref.shape, name
            errors[f"d{name}"] = rel_err(g, ref)
    bad = {name: e for name, e in errors.items() if not e < tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"
    return errors
