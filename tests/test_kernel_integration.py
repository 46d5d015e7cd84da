"""End to end through the real kernels: every spelling with blockwise, a few with
the Pallas TPU kernel in interpret mode; kernel calls are named in the HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass

import spellings


def _check(fn, opt, args, rtol, atol):
    ref = fn(*args)
    out = opt(*args)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=rtol, atol=atol
    )
    diff = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(ref.shape), ref.dtype)

    def loss(f):
        return lambda *a: jnp.sum((f(*a) * ct).astype(jnp.float32))

    for a, b in zip(
        jax.grad(loss(opt), argnums=diff)(*args),
        jax.grad(loss(fn), argnums=diff)(*args),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol * 5, atol=atol * 5
        )


@pytest.mark.parametrize("name", sorted(spellings.POSITIVE))
def test_blockwise_end_to_end(name, rng):
    fn, make = spellings.POSITIVE[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert opt.explain(*args).kernels == ["blockwise"]
    bf16 = any(a.dtype == jnp.bfloat16 for a in args)
    _check(fn, opt, args, *((2e-2, 2e-2) if bf16 else (2e-5, 2e-5)))


@pytest.mark.parametrize(
    "name",
    [
        "causal_tril_where",
        pytest.param("bias_input", marks=pytest.mark.slow),
        pytest.param("gqa_dot_product_attention", marks=pytest.mark.slow),
    ],
)
def test_pallas_tpu_interpret_end_to_end(name, rng):
    fn, make = spellings.POSITIVE[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="pallas_tpu", interpret=True)
    assert opt.explain(*args).kernels == ["pallas_tpu"], str(opt.explain(*args))
    _check(fn, opt, args, 2e-5, 2e-5)


def test_kernel_call_is_named_in_hlo(rng):
    args = spellings.bnth(rng)
    opt = flashpass.optimize(spellings.matmul_bnth, kernel="blockwise")
    text = jax.jit(opt).lower(*args).as_text(debug_info=True)
    assert "flashpass_blockwise" in text
