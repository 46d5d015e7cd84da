"""Run the multi-device sharding tests in their own pytest session (see conftest)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEVICES = 8


def test_multidevice_session():
    """The default set's multi-device tests (`-m "not slow"`)."""
    run_session("not slow")


@pytest.mark.slow
def test_multidevice_session_slow():
    """The slow multi-device tests: `pytest -m slow` runs them here (the main
    session never collects tests/sharding/multidevice)."""
    run_session("slow")


def run_session(markers: str):
    # (Under `pytest -n`, the worker's own variables stay out of the session.)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "pytest", str(HERE), "-q", "-rs", "-p", "no:cacheprovider"]
    cmd += ["-m", markers]
    # About 4 minutes on 2 idle cores; CI runs it beside another lane.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (
        f"multi-device sharding tests failed ({' '.join(cmd)}):\n"
        + proc.stdout[-12000:]
        + proc.stderr[-4000:]
    )
    assert_ran(proc.stdout)


def assert_ran(stdout: str):
    """Green means the 8-device tests ran: a session whose modules all skipped
    (the device flag lost, fewer devices) exits 0 too."""
    summary = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, "no multi-device test ran:\n" + stdout[-4000:]
    assert "needs 8 devices" not in stdout, "multi-device modules skipped:\n" + stdout[-4000:]


def test_a_session_that_skipped_is_not_green():
    skipped = (
        "sssss\nSKIPPED [5] tests/sharding/multidevice/test_ring.py:26: needs 8 devices "
        "(see conftest)\n5 skipped in 1.00s\n"
    )
    some = "..s\nSKIPPED [1] tests/sharding/multidevice/test_zigzag.py:15: needs 8 devices\n"
    for stdout in (skipped, some + "2 passed, 1 skipped in 1.00s\n", ""):
        with pytest.raises(AssertionError):
            assert_ran(stdout)
    assert_ran("....\n4 passed in 1.00s\n")
