"""Conformance of the `EmptyRows` op across kernels (kernels/empty_rows.py).

A spec of causal + key (padding) mask + `EmptyRows` stands for the additive
mask ``s + where(causal & keep, 0, fill)``.  Every kernel that takes a bias
must compute it as that dense bias would, forward and gradient, including the
rows the mask leaves with no key (left padding); Pallas kernels run in
interpret mode.  The fill is -1e4 here: it excludes keys (weight exactly 0),
and the float64 oracle's ``s + fill`` then differs from float32's only by the
rounding of the sum, so an empty row's ``softmax(s + fill)`` is checked
against its exact value, far from the uniform row a mask would give.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import bias_op, mask_op, run_and_compare, spec_of

from flashpass.kernels import CheckContext, empty_rows, get_kernel
from flashpass.kernels.reference import reference_attention
from flashpass.spec import Causal, EmptyRows, Scale

FILL = -1e4
T = 128
LEAD = 12  # left padding: under causality rows 0 .. LEAD - 1 keep no key


def _spec():
    mask, mask_extra = mask_op(0, (2, 1, 1, T), FILL)
    ops = (Scale(2.0), Causal(0, FILL), mask, EmptyRows(2, FILL, "float32"))
    return spec_of(b=2, h=2, t=T, ops=ops, extras=(mask_extra,))


def _keys():
    keep = np.ones((2, 1, 1, T), bool)
    keep[0, ..., :LEAD] = False  # example 0 left-padded, example 1 not
    return jnp.asarray(keep)


def _dense_oracle(q, k, v, keys):
    """The additive mask as the dense bias the program adds."""
    bias, extra = bias_op(0, (2, 1, T, T))
    dense = _spec().with_ops((Scale(2.0), bias), extras=(extra,))
    causal = np.tril(np.ones((T, T), bool))
    values = jnp.where(causal & keys, 0.0, FILL).astype(q.dtype)
    return reference_attention(dense, q, k, v, (values,), dtype=jnp.float64)


class _Split:
    """A kernel run as the pass runs it: through `empty_rows.apply`."""

    def __init__(self, kernel):
        self.kernel = kernel

    def apply(self, spec, q, k, v, extras=(), *, interpret=False):
        return empty_rows.apply(self.kernel, spec, q, k, v, extras, interpret=interpret)


@pytest.mark.parametrize(
    "name, ctx",
    [
        ("blockwise", CheckContext("cpu", explicit=True)),
        ("reference", CheckContext("cpu", explicit=True)),
        ("pallas_tpu", CheckContext("cpu", interpret=True, explicit=True)),
    ],
)
def test_kernel_computes_the_empty_rows_as_the_original(name, ctx):
    kernel = get_kernel(name)
    spec = _spec()
    assert empty_rows.check(kernel, spec, ctx) == []
    errors = run_and_compare(
        _Split(kernel), spec, (_keys(),), tol=2e-3, interpret=ctx.interpret, reference=_dense_oracle
    )
    assert errors["out"] < 2e-3


def test_empty_rows_are_not_the_uniform_row():
    """The control: the descriptors alone (no `EmptyRows`) give the mean of
    ``v`` in the empty rows, which the oracle's rows are far from."""
    spec = _spec()
    masked = empty_rows.split(spec).masked
    kernel = get_kernel("reference")
    with pytest.raises(AssertionError, match="errors above"):
        run_and_compare(kernel, masked, (_keys(),), tol=2e-3, grad=False, reference=_dense_oracle)


def test_a_kernel_without_bias_declines_with_the_rows_reason():
    kernel = get_kernel("splash")  # takes the key mask, not a bias
    ctx = CheckContext("tpu", explicit=True)
    assert kernel.check(empty_rows.split(_spec()).masked, ctx) == []
    reasons = empty_rows.check(kernel, _spec(), ctx)
    assert reasons and all(
        "for the rows the additive mask may leave with no key" in r for r in reasons
    )


def test_empty_rows_alone_in_chunks(monkeypatch):
    """The second call covers only the empty rows (`empty_rows.rows_apart`:
    the filled spec is scale + fill), gathered per (batch, head) a chunk at a
    time: with 4-row chunks, example 0's 12 empty rows take 3 chunks, example
    1 has none; exact against the dense bias, forward and gradient."""
    monkeypatch.setattr(empty_rows, "ROW_CHUNK", 4)
    kernel = get_kernel("blockwise")
    parts = empty_rows.split(_spec())
    assert empty_rows.rows_apart(kernel, parts.filled, ())
    errors = run_and_compare(_Split(kernel), _spec(), (_keys(),), tol=2e-3, reference=_dense_oracle)
    assert errors["out"] < 2e-3


def test_rows_apart_declines_position_dependent_fills():
    """A causal op left outside the additive mask depends on the row's
    position: the second call then runs over every row, as before."""
    mask, mask_extra = mask_op(0, (2, 1, 1, T), FILL)
    ops = (Causal(0, -np.inf), mask, EmptyRows(1, FILL, "float32"))
    spec = spec_of(b=2, h=2, t=T, ops=ops, extras=(mask_extra,))
    parts = empty_rows.split(spec)
    assert not empty_rows.rows_apart(get_kernel("blockwise"), parts.filled, ())
    assert not empty_rows.rows_apart(get_kernel("pallas_tpu"), empty_rows.split(_spec()).filled, ())
