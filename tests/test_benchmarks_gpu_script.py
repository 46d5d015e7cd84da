"""benchmarks/gpu.py --cpu-check: the GPU verification script's correctness part,
run on CPU (Pallas in interpret mode, the cuDNN adapter on XLA), as CI does."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from jax_versions import requires_triton

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@requires_triton
def test_gpu_benchmark_cpu_check():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "correctness: ok" in out
    for label in ("pallas_gpu (interpret)", "cudnn adapter on XLA", "flashpass.optimize"):
        lines = [line for line in out.splitlines() if line.strip().startswith(label)]
        assert any(line.endswith("ok") for line in lines), (label, out)
    assert "FAIL" not in out
    assert "kernel=pallas_gpu" in out  # no cuDNN on CPU: the rewrite picked pallas_gpu
