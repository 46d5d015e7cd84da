"""A partial refresh of an expected file records one entry per sweep.

The sweep saves after each model (so an interrupted sweep keeps what it ran);
each save of the same refresh replaces its entry rather than adding one per
model saved so far.
"""

from __future__ import annotations

import json

from benchmarks.zoo import sweep


def _rec(model, mode="direct"):
    return {"model": model, "mode": mode, "status": "ok"}


def test_one_refresh_entry_per_sweep(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "EXPECTED", tmp_path)
    monkeypatch.setattr(sweep, "commit", lambda: "abc1234")
    monkeypatch.setattr(sweep, "versions", lambda: {})
    monkeypatch.setattr(sweep, "models", lambda suite: [])
    sweep.save("s", [_rec("A"), _rec("B"), _rec("C")], "full", 1.0, merge=False)
    sweep.save("s", [_rec("A")], "partial", 1.0, merge=True)  # after A
    sweep.save("s", [_rec("A"), _rec("B")], "partial", 1.0, merge=True)  # after B
    sweep.save("s", [_rec("C")], "another", 1.0, merge=True)  # a second sweep
    meta = json.loads((tmp_path / "s.json").read_text())["meta"]
    assert [r["models"] for r in meta["refreshes"]] == [["A", "B"], ["C"]]
    assert meta["command"] == "full"
