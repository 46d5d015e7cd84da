"""benchmarks/cpu.py runs end to end (--quick, tiny sizes) and writes the JSON it
promises; benchmarks/train.py runs its quick training step and passes its
correctness checks.  Checks fields only, never timings: the machine is shared."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cpu_benchmark_quick_writes_json(tmp_path):
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu.py"), "--quick", "--sizes", "64"]
    cmd += ["--heads", "2", "--dim", "8", "--modes", "fwd+bwd", "--kernel", "blockwise"]
    cmd += ["--mm-size", "128", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "vs naive" in proc.stdout  # the table

    data = json.loads(out.read_text())
    meta = data["meta"]
    for key in ("date", "jax", "machine", "load_avg_start", "load_avg_end", "args"):
        assert key in meta, key
    assert meta["machine"]["cores"] >= 1 and meta["matmul_gflops_median"] > 0

    results = {r["variant"]: r for r in data["results"]}
    assert set(results) == {"naive", "xla", "flashpass"}
    for r in results.values():
        assert (r["S"], r["causal"], r["mode"], r["status"]) == (64, True, "fwd+bwd", "ok")
        for key in ("time_s", "times_s", "matmul_gflops", "gflops", "matmul_fraction"):
            assert r[key] > 0 if not isinstance(r[key], list) else all(t > 0 for t in r[key])
        assert r["peak_run_bytes"] is not None and r["peak_process_bytes"] > 0
    assert results["flashpass"]["kernels"] == ["blockwise"]  # the rewrite happened

    (row,) = data["summary"]
    for key in ("speedup_vs_naive", "speedup_vs_xla", "memory_vs_naive", "xla_speedup_vs_naive"):
        assert row[key] > 0, key
    assert row["flashpass_kernels"] == ["blockwise"]


def test_cpu_benchmark_skips_what_would_not_fit(tmp_path):
    """Dense variants over --mem-limit-gb are not run, and the JSON says so."""
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cpu.py"), "--quick", "--sizes", "64"]
    cmd += ["--heads", "2", "--dim", "8", "--modes", "fwd", "--mem-limit-gb", "0"]
    cmd += ["--variants", "naive", "xla", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skip: not run" in proc.stdout
    data = json.loads(out.read_text())
    assert {r["status"] for r in data["results"]} == {"skipped"}
    assert all(r["estimated_bytes"] > 0 for r in data["results"])


def test_train_benchmark_quick():
    """The training-step benchmark: same update, every site forward+backward.

    Its exit status covers correctness only (memory and time just print)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train.py"), "--quick"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "(1) updated params rel. diff" in out and "goal <= 1e-05): met" in out
    assert "(2) sites rewritten forward+backward: 2 of 2" in out
    assert out.count("forward+backward") >= 3  # the report's two rows and line (2)
    for row in ("temp memory (MiB)", "step time, median (ms)", "summary: T=1024"):
        assert row in out, row
