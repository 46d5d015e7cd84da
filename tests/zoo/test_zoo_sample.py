"""The zoo's CI sample: at least one model per family of each suite, in every
mode, against the checked-in expected results (benchmarks/zoo/expected/).

Any regression fails: a site rewritten before and kept now, a new error, a
numerics mismatch, a new silent miss (benchmarks/zoo/compare.py).  Each suite
runs in its own process (``python -m benchmarks.zoo check --sample``): Keras
must see its backend before anything imports it, and the sweep records the
pass's internal errors instead of raising them (this suite's conftest sets
FLASHPASS_STRICT).  A suite whose libraries are not installed is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: suite -> the modules it needs (the torch suites run in the frameworks leg).
NEEDS = {
    "hf_flax": ("transformers", "flax"),
    "keras_hub": ("keras", "keras_hub"),
    "jax_native": ("flax", "equinox", "haiku", "penzai"),
    "hf_torch": ("torch", "torchax", "transformers"),
    "timm": ("torch", "torchax", "timm"),
}


@pytest.mark.slow
@pytest.mark.parametrize("suite", list(NEEDS))
def test_sample_matches_expected(suite):
    missing = [m for m in NEEDS[suite] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{suite}: {', '.join(missing)} not installed")
    if not (ROOT / "benchmarks" / "zoo" / "expected" / f"{suite}.json").exists():
        pytest.skip(f"{suite}: no expected results checked in")
    env = {k: v for k, v in os.environ.items() if k != "FLASHPASS_STRICT"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.zoo", "check", "--sample", "--suite", suite],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith(("[", "REGRESSION"))]
    assert out.returncode == 0, "\n".join(lines) + "\n" + out.stderr[-3000:]
    assert any(x.startswith(f"[{suite}]") and "0 regression(s)" in x for x in lines), "\n".join(
        lines
    )
