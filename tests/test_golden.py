"""Golden jaxpr tests: the rewritten jaxpr of every spelling, pinned.

Regenerate after an intended change with:

    FLASHPASS_UPDATE_GOLDENS=1 python -m pytest tests/test_golden.py

The files use flashpass's own printer (stable across JAX versions: no source
info, only the parameters that decide semantics) and are stamped with the JAX
version that wrote them.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashpass
from flashpass.testing import assert_golden, golden_text

import spellings

GOLDEN = pathlib.Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", sorted(spellings.POSITIVE))
def test_golden(name):
    fn, make = spellings.POSITIVE[name]
    args = make(np.random.default_rng(0))
    opt = flashpass.optimize(fn, kernel="blockwise")
    assert_golden(opt, *args, path=GOLDEN / f"{name}.txt")


def test_golden_mismatch_prints_a_diff(tmp_path):
    fn, make = spellings.POSITIVE["matmul_bnth"]
    args = make(np.random.default_rng(0))
    opt = flashpass.optimize(fn, kernel="blockwise")
    path = tmp_path / "g.txt"
    assert_golden(opt, *args, path=path, update=True)
    assert path.read_text().startswith("# jax ")
    assert_golden(opt, *args, path=path, update=False)  # round trip
    text = path.read_text().replace("flashpass_blockwise", "flashpass_other")
    path.write_text(text)
    with pytest.raises(AssertionError, match=r"(?s)differs.*-.*flashpass_other.*\+.*blockwise"):
        assert_golden(opt, *args, path=path, update=False)


def test_golden_notices_a_stopped_rewrite(tmp_path):
    fn, make = spellings.POSITIVE["matmul_bnth"]
    args = make(np.random.default_rng(0))
    path = tmp_path / "g.txt"
    assert_golden(flashpass.optimize(fn, kernel="blockwise"), *args, path=path, update=True)
    # same model, but now nothing is rewritten (as after an upgrade that breaks a pattern)
    unrewritten = flashpass.optimize(fn)  # short sequence: default keeps the original
    with pytest.raises(AssertionError, match="stopped or added a rewrite"):
        assert_golden(unrewritten, *args, path=path, update=False)


def test_missing_golden_is_an_error(tmp_path):
    fn, make = spellings.POSITIVE["matmul_bnth"]
    with pytest.raises(AssertionError, match="does not exist"):
        assert_golden(fn, *make(np.random.default_rng(0)), path=tmp_path / "none.txt", update=False)


def test_golden_text_has_no_source_info():
    fn, make = spellings.POSITIVE["causal_tril_where"]
    text = golden_text(flashpass.optimize(fn, kernel="blockwise"), *make(np.random.default_rng(0)))
    assert "spellings.py" not in text and "flashpass_blockwise(" in text


def test_golden_training_step():
    """A training step: the site's forward and its backward are both rewritten
    (one kernel call and its vjp), the gradients read from the kernel's."""
    fn, make = spellings.POSITIVE["causal_tril_where"]
    args = make(np.random.default_rng(0))

    def step(q, k, v):
        return jax.value_and_grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2))(q, k, v)

    opt = flashpass.optimize(step, kernel="blockwise")
    assert [r.passes for r in opt.explain(*args).rewrites] == ["forward+backward"]
    assert_golden(opt, *args, path=GOLDEN / "training_step.txt")
