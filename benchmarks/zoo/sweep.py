"""Run a suite (or its CI sample) and read and write its expected-results file.

``expected/<suite>.json`` holds ``{"meta": {...}, "records": [...]}``, one
record per (model, mode) as `harness.run_model` makes it, sorted, so a
refresh diffs cleanly.  Timings and measured errors are kept for the docs
but never compared (`compare.py` decides what a regression is).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

from .model import ZooModel

HERE = pathlib.Path(__file__).parent
EXPECTED = HERE / "expected"
SUITES = ("hf_flax", "hf_torch", "timm", "keras_hub", "jax_native")


def prepare_environment() -> None:
    """Before any library import: Keras on JAX, Hugging Face offline, quiet logs."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def models(suite: str, sample: bool = False, names=None) -> list[ZooModel]:
    """The suite's models: all, the CI sample, or those named."""
    module = importlib.import_module(f"benchmarks.zoo.suites.{suite}")
    out = list(module.MODELS)
    if sample:
        out = [m for m in out if m.sample]
    if names:
        out = [m for m in out if m.name in names]
    return out


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in (
        "jax", "flax", "transformers", "keras", "keras_hub", "equinox", "haiku", "penzai",
        "optax", "torch", "torchax", "timm",
    ):  # fmt: skip
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            out[name] = module.__version__
    return out


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


_ROOT = str(HERE.resolve().parents[1]) + "/"
_PREFIX = re.compile(r"[^\s'\"`(\[]*(?:site-packages|dist-packages)/")


def scrub(value):
    """``value`` (a record, recursively) without this machine's paths: an
    installed library's file as its package path (``flax/linen/...``), ours
    relative to the repository."""
    if isinstance(value, str):
        return _PREFIX.sub("", value).replace(_ROOT, "")
    if isinstance(value, list):
        return [scrub(v) for v in value]
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items()}
    return value


def tidy(suite: str) -> None:
    """Rewrite an expected file with `scrub` applied and each record's
    accounting redone by the harness's current rules (`harness.account`):
    the measured values stay as they were."""
    from .harness import account

    data = load(suite)
    if data["records"]:
        data["records"] = [account(r) for r in data["records"]]
        path = EXPECTED / f"{suite}.json"
        path.write_text(json.dumps(scrub(data), indent=1, sort_keys=True) + "\n")


def key(rec: dict) -> tuple[str, str]:
    return rec["model"], rec["mode"]


def run(
    suite: str, *, sample=False, names=None, modes=None, log=None, each=None, reverse=False
) -> list[dict]:
    """Records of the suite's models (each model in turn; progress to ``log``;
    ``each(records so far)`` after every model, so a long sweep keeps what it did)."""
    from .harness import run_model

    records = []
    # The CI sample's models first: a sweep cut short still covers them.
    order = sorted(models(suite, sample, names), key=lambda m: not m.sample)
    for model in reversed(order) if reverse else order:
        start = time.perf_counter()
        got = run_model(model, modes)
        records += got
        if each is not None:
            each(records)
        if log is not None:
            states = " ".join(f"{r['mode']}={r['status']}" for r in got)
            print(
                f"[{suite}] {model.name}: {states} ({time.perf_counter() - start:.0f} s)",
                file=log,
                flush=True,
            )
    return records


def load(suite: str) -> dict:
    path = EXPECTED / f"{suite}.json"
    if not path.exists():
        return {"meta": {}, "records": []}
    return json.loads(path.read_text())


def save(suite: str, records: list[dict], command: str, wall_s: float, merge: bool) -> pathlib.Path:
    """Write the expected file; ``merge``: replace only these records' (model, mode)."""
    old = load(suite)
    if merge:
        mine = {key(r) for r in records}
        records = [r for r in old["records"] if key(r) not in mine] + records
    order = {m.name: i for i, m in enumerate(models(suite))}
    records.sort(key=lambda r: (order.get(r["model"], len(order)), r["model"], r["mode"]))
    meta = {
        "suite": suite,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "versions": versions(),
        "wall_s": round(wall_s if not merge else old["meta"].get("wall_s", 0.0), 1),
    }
    if merge and old["meta"]:
        # The sweep's own date and commit stay; the refresh says its own.
        refreshed = sorted({r["model"] for r in records if key(r) in mine})
        refreshes = list(old["meta"].get("refreshes", []))
        last = refreshes[-1] if refreshes else None
        if last and last["commit"] == meta["commit"] and set(last["models"]) <= set(refreshed):
            # The same refresh saved again after its next model (`each`): one entry.
            refreshes.pop()
        refreshes.append({"date": meta["date"], "commit": meta["commit"], "models": refreshed})
        meta["refreshes"] = refreshes
        for name in ("date", "commit", "command"):
            meta[name] = old["meta"].get(name, meta[name])
    path = EXPECTED / f"{suite}.json"
    EXPECTED.mkdir(exist_ok=True)
    data = scrub({"meta": meta, "records": records})
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path
