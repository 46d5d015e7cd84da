"""The zoo's CI sample: at least one model per family of each suite, against
the checked-in expected results (benchmarks/zoo/expected/).

What it runs, to stay within CI's budget (the full sweep runs every mode): the
forward (``direct``) of every sample model, and the training step (``train``:
the matcher's backward reading) of one decoder per suite (`TRAIN`).

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


#: suite -> the one model whose training step the sample checks.
TRAIN = {
    "hf_flax": "GPT-2",
    "keras_hub": "GPT-2",
    "jax_native": "flax.linen MHA self",
    "hf_torch": "GPT2LMHeadModel[eager]",
    "timm": "vit_tiny_patch16_224",
}


def _check(suite: str, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FLASHPASS_STRICT"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.zoo", "check", "--suite", suite, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith(("[", "REGRESSION"))]
    assert out.returncode == 0, "\n".join(lines) + "\n" + out.stderr[-3000:]
    done = [x for x in lines if x.startswith(f"[{suite}]") and "0 regression(s)" in x]
    assert done and " 0 records" not in done[0], "\n".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("suite", list(NEEDS))
def test_sample_matches_expected(suite):
    missing = [m for m in NEEDS[suite] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{suite}: {', '.join(missing)} not installed")
    if not (ROOT / "benchmarks" / "zoo" / "expected" / f"{suite}.json").exists():
        pytest.skip(f"{suite}: no expected results checked in")
    _check(suite, "--sample", "--modes", "direct")
    _check(suite, "--models", TRAIN[suite], "--modes", "train")
