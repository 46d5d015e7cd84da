"""The zoo's site rate: a kept site counts against it unless its reason says
no attention kernel computes it (benchmarks/zoo/render.py `excused`)."""

from __future__ import annotations

from benchmarks.zoo import render
from flashpass.patterns.common import NO_KERNEL


def _rec(sites, rewritten, kept=(), mode="direct"):
    return {
        "mode": mode,
        "status": "ok",
        "sites": sites,
        "rewritten": rewritten,
        "kept": list(kept),
        "unrecognised": [],
        "dense_operands": [],
    }


def test_a_kept_site_counts_against_the_rate():
    recs = [_rec(4, 2, ["`split` between the score product and the softmax is not recognised"])]
    assert render.rates(recs)["direct"] == (0, 1, 2, 4)


def test_a_kept_site_no_kernel_computes_is_left_out():
    why = f"each softmax row reads several heads' scores, {NO_KERNEL}; kept as written"
    recs = [_rec(4, 2, [why, why]), _rec(2, 2)]
    assert render.excused(recs[0]) == 2
    # 2 of 2 counted sites rewritten in the first model, 2 of 2 in the second
    assert render.rates(recs)["direct"] == (1, 2, 4, 4)


def test_the_excuse_is_read_from_the_reason_and_capped_by_the_sites():
    why = f"a convolution over the scores ..., {NO_KERNEL}; kept as written"
    rec = _rec(1, 0, [why, why, "the attention probabilities feed `add`, not a P·V product"])
    assert render.excused(rec) == 1  # never more than the sites counted
    assert render.rates([rec])["direct"] == (0, 1, 0, 0)
    assert render.excused(_rec(2, 1, ["key operand of the score product has 3 free axes"])) == 0


def test_the_matchers_reasons_say_it_in_the_rules_words():
    import inspect

    from flashpass.patterns import convolution, match

    for module in (match, convolution):
        assert "NO_KERNEL" in inspect.getsource(module)
