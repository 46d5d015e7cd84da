"""The shared "no T x S array" check (tests/t_by_s.py) sees every layout."""

import jax
import jax.numpy as jnp
import pytest
from t_by_s import assert_no_t_by_s, is_t_by_s, jaxpr_shapes

T, S = 64, 96


@pytest.mark.parametrize(
    "shape",
    [(T, S), (S, T), (2, 3, T, S), (2, T, 3, S), (2 * 3 * T, S), (4, 2, 3, T, S), (T, 2, S)],
    ids=["ts", "st", "bhts", "bths", "flat_rows", "stacked", "split"],
)
def test_every_layout_of_a_score_matrix_is_caught(shape):
    assert is_t_by_s(shape, T, S)
    with pytest.raises(AssertionError, match="could hold 1 "):
        assert_no_t_by_s([(2, 3, T, 16), shape], T, S)


@pytest.mark.parametrize(
    "shape",
    [(2, 3, T, 16), (2, 3, S, 16), (2, 3, T), (T, S - 1 - T), (T // 2, S)],
    ids=["q", "k", "stats", "short", "half_rows"],
)
def test_smaller_arrays_pass(shape):
    assert not is_t_by_s(shape, T, S)
    assert_no_t_by_s([shape], T, S)


def test_the_control_must_be_caught_and_sub_jaxprs_are_walked():
    def scores(q, k):
        return jax.lax.scan(lambda c, x: (c, q @ k.T), 0.0, jnp.arange(2))[1]

    q, k = jnp.ones((T, 16)), jnp.ones((S, 16))
    shapes = jaxpr_shapes(jax.make_jaxpr(scores)(q, k))
    assert (T, S) in shapes and (2, T, S) in shapes  # inside the scan body, and stacked
    with pytest.raises(AssertionError, match="control program"):
        assert_no_t_by_s([(T, 16)], T, S, control=[(T, 16)])


def test_copies_count_stacked_matrices():
    """One tile spanning a short sequence passes; the same stacked over layers does not."""
    assert_no_t_by_s([(2, 2, T, S)], T, S, copies=3 * 2 * 2)
    assert is_t_by_s((3, 2, 2, T, S), T, S, copies=3 * 2 * 2)
    assert is_t_by_s((3 * 2 * 2 * T, S), T, S, copies=3 * 2 * 2)
