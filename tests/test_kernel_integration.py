"""End to end through the real kernels: every spelling with blockwise, a few with
the Pallas TPU kernel in interpret mode; kernel calls are named in the HLO."""

import jax
import pytest

import flashpass
from flashpass.testing import assert_same_function

import spellings


@pytest.mark.parametrize("name", sorted(spellings.POSITIVE))
def test_blockwise_end_to_end(name, rng):
    fn, make = spellings.POSITIVE[name]
    args = make(rng)
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert opt.explain(*args).kernels == ["blockwise"]
    assert_same_function(fn, opt, *args)


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
    assert_same_function(fn, opt, *args, rtol=2e-5, atol=2e-5)


def test_kernel_call_is_named_in_hlo(rng):
    args = spellings.bnth(rng)
    opt = flashpass.optimize(spellings.matmul_bnth, kernel="blockwise")
    text = jax.jit(opt).lower(*args).as_text(debug_info=True)
    assert "flashpass_blockwise" in text
