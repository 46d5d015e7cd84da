"""The zoo's site rate: a kept site counts against it (benchmarks/zoo/render.py)."""

from __future__ import annotations

from benchmarks.zoo import render


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
