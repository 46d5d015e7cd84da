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


#: A row's scale is at least this fraction of the whole tensor's (`row_err`):
#: an output row, or a gradient row, whose values cancel to (nearly) zero is
#: measured against its neighbours' size.  Gradient rows cancel more (dS = P *
#: (dP - delta) of a row that keeps one key is exactly 0), hence their floor.
ROW_FLOOR, GRAD_ROW_FLOOR = 1e-2, 1e-1
#: A gradient holds to ``tol`` over the whole tensor (`rel_err`) and each of its
#: rows to this many times ``tol`` (`row_err`): in bfloat16 a gradient row's
#: cancellation measures up to about 2x the whole tensor's error (0.06 against
#: 0.03), while a wrong row is off by its own size.
GRAD_ROW_SLACK = 4
#: A bfloat16 output rounds at 2**-9 relative; per row, the kernels measure
#: about 5e-3.  `run_and_compare` holds bfloat16 outputs to this however loose
#: the caller's (gradient) tolerance: one key too many or too few in a row of
#: a hundred moves that row by about 1e-2 to 1e-1.
BF16_OUT_TOL = 1.2e-2
#: JAX's own XLA attention (`jax.nn.dot_product_attention(implementation="xla")`,
#: cuDNN's stand-in on CPU) rounds the probabilities to bfloat16 before P.V on JAX
#: 0.12: up to 2e-2 per row, still well under the ~1e-1 of one key off in a row.
XLA_ATTENTION_BF16_OUT_TOL = 2.5e-2


def row_err(actual, expected, floor=ROW_FLOOR) -> float:
    """The worst row's relative error: over every row (the last axis: a query's
    output, a key's dK, a bias row), max |actual - expected| over the row divided
    by the row's scale, max |expected| over the row (at least ``floor`` times
    the tensor's).  One wrong row among large ones, e.g. a kv length off by one
    in a long row next to a short row's large values, is not averaged away as
    by `rel_err`.  Never below `rel_err`.  NaN-aware: NaN gives inf."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    if actual.size == 0:
        return 0.0
    if actual.ndim == 0:
        actual, expected = actual[None], expected[None]
    whole = max(float(np.max(np.abs(expected))), 1e-30)
    scale = np.maximum(np.max(np.abs(expected), axis=-1), floor * whole)
    return float(np.max(np.max(np.abs(actual - expected), axis=-1) / scale))


def run_and_compare(
    kernel,
    spec,
    extras=(),
    *,
    tol,
    grad=True,
    interpret=True,
    seed=0,
    reference=None,
    bf16_out_tol=BF16_OUT_TOL,
):
    """Run ``kernel`` (one compile for forward and gradients) and compare with
    the float64 oracle: `oracle` (`reference_attention`), or ``reference(q, k,
    v, *extras)`` given float64 arrays (a kernel whose own backward is
    `reference_attention` needs an independent one).  Returns ``{name:
    error}``: the output's `row_err` (the worst row's relative error) below
    ``tol`` (a bfloat16 output's below `BF16_OUT_TOL` too); each gradient's
    `rel_err` below ``tol`` and its `row_err` (``"dq rows"``) below
    `GRAD_ROW_SLACK` times ``tol``."""
    arrays = (*qkv(spec, seed), *extras)
    expect = reference or functools.partial(oracle, spec)

    def run(*a):
        q, k, v, *ex = a
        return kernel.apply(spec, q, k, v, ex, interpret=interpret)

    errors = {}
    if not grad:
        out = fast_jit(run)(*arrays)
        assert out.shape == spec.out_shape and out.dtype == spec.out_dtype
        with jax.enable_x64(True):
            wide = [jnp.asarray(a, jnp.float64) if _real(a) else a for a in arrays]
            errors["out"] = row_err(out, expect(*wide))
    else:
        cotangent = normal(spec.out_shape, 1000 + seed)
        out, grads = fast_jit(lambda *a: value_and_vjp(run, a, cotangent))(*arrays)
        assert out.shape == spec.out_shape and out.dtype == spec.out_dtype
        with jax.enable_x64(True):
            wide = [jnp.asarray(a, jnp.float64) if _real(a) else a for a in arrays]
            expected, ref_grads = fast_jit(lambda *a: value_and_vjp(expect, a, cotangent))(*wide)
        errors["out"] = row_err(out, expected)
        names = ["q", "k", "v"] + [f"extra{i}" for i, e in enumerate(extras) if _real(e)]
        for name, g, ref in zip(names, grads, ref_grads, strict=True):
            assert g.shape == ref.shape, name
            errors[f"d{name}"] = rel_err(g, ref)
            errors[f"d{name} rows"] = row_err(g, ref, GRAD_ROW_FLOOR)
    out_tol = min(tol, bf16_out_tol) if spec.out_dtype == BF16 else tol
    limits = {name: tol * (GRAD_ROW_SLACK if name.endswith(" rows") else 1) for name in errors}
    limits["out"] = out_tol
    bad = {name: e for name, e in errors.items() if not e < limits[name]}
    assert not bad, f"errors above their limits {limits}: {bad} (all: {errors})"
    return errors
