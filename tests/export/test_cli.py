"""`python -m flashpass explain|rewrite`, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from variants import VARIANTS


def _run(*args, check=True):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "flashpass", *args], capture_output=True, text=True, env=env
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _artifact(tmp_path, variant, serialized=True):
    exp = jax.export.export(jax.jit(variant.fn))(*variant.structs())
    path = tmp_path / ("model.bin" if serialized else "model.mlir")
    if serialized:
        path.write_bytes(exp.serialize())
    else:
        path.write_text(exp.mlir_module())
    return path


def test_explain_prints_the_report(tmp_path):
    path = _artifact(tmp_path, VARIANTS[1])
    out = _run("explain", str(path), "--kernel", "blockwise").stdout
    assert "route lift" in out and "1 rewritten" in out and "blockwise" in out, out
    data = json.loads(_run("explain", str(path), "--kernel", "blockwise", "--json").stdout)
    assert data["route"] == "lift" and data["rewrites"][0]["kernel"] == "blockwise"
    assert data["rewrites"][0]["mask"] == "causal"


def test_rewrite_writes_a_working_artifact(tmp_path):
    variant = VARIANTS[1]
    path = _artifact(tmp_path, variant, serialized=False)  # MLIR text in
    out = tmp_path / "flash.bin"
    proc = _run("rewrite", str(path), str(out), "--kernel", "blockwise", "--vjp-order", "1")
    assert "1 rewritten" in proc.stdout, proc.stdout
    new = jax.export.deserialize(out.read_bytes())
    assert new.has_vjp()
    args = variant.args()
    np.testing.assert_allclose(new.call(*args), variant.fn(*args), atol=2e-5)


def test_bad_input_is_an_error_not_a_traceback(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"\x00\x01 not a module")
    proc = _run("explain", str(path), check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error:"), proc.stderr
    proc = _run("rewrite", str(path), str(tmp_path / "out.bin"), "--platform", "vax", check=False)
    assert proc.returncode == 2 and "error:" in proc.stderr


def test_rewrite_route_splice(tmp_path):
    variant = VARIANTS[1]
    path = _artifact(tmp_path, variant)
    out = tmp_path / "spliced.bin"
    proc = _run("rewrite", str(path), str(out), "--kernel", "blockwise", "--route", "splice")
    assert "route splice" in proc.stdout and "1 rewritten" in proc.stdout, proc.stdout
    new = jax.export.deserialize(out.read_bytes())
    assert "call @_flashpass_splice0_" in new.mlir_module()
    args = variant.args()
    np.testing.assert_allclose(new.call(*args), variant.fn(*args), atol=2e-5)


# ------------------------------------------------------------ behaving like a command-line tool


def _one_line_error(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, proc.stderr)


@pytest.mark.slow  # subprocesses of python -m flashpass
def test_missing_empty_and_unreadable_inputs_are_one_line_errors(tmp_path):
    missing = tmp_path / "nothing.bin"
    _one_line_error(_run("explain", str(missing), check=False), str(missing), "no such file")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    _one_line_error(_run("explain", str(empty), check=False), str(empty), "empty")
    _one_line_error(_run("explain", str(tmp_path), check=False), str(tmp_path), "folder")
    junk = tmp_path / "junk.mlir"
    junk.write_text("module {\n  not mlir at all\n}\n")
    _one_line_error(_run("explain", str(junk), check=False), str(junk))


@pytest.mark.slow  # subprocesses of python -m flashpass
def test_output_is_checked_before_the_work_and_never_the_input(tmp_path):
    path = _artifact(tmp_path, VARIANTS[1])
    before = path.read_bytes()
    # an output folder that does not exist: refused at once (no traceback, no rewrite)
    bad = tmp_path / "no" / "such" / "out.bin"
    proc = _run("rewrite", str(path), str(bad), check=False)
    _one_line_error(proc, str(bad), "does not exist")
    assert "rewritten" not in proc.stdout
    _one_line_error(_run("rewrite", str(path), str(path), check=False), "--force")
    assert path.read_bytes() == before
    proc = _run("rewrite", str(path), str(path), "--kernel", "blockwise", "--force")
    assert path.read_bytes() != before and f"wrote {path}" in proc.stdout


@pytest.mark.slow  # subprocesses of python -m flashpass
def test_rewrite_says_where_it_wrote(tmp_path):
    path = _artifact(tmp_path, VARIANTS[1])
    out = tmp_path / "flash.bin"
    proc = _run("rewrite", str(path), str(out), "--kernel", "blockwise", "--quiet")
    assert proc.stdout.strip().splitlines() == [
        f"wrote {out} ({out.stat().st_size} bytes, rewritten)"
    ], proc.stdout


@pytest.mark.slow  # subprocesses of python -m flashpass
def test_version():
    import flashpass

    proc = _run("--version")
    assert proc.stdout.strip() == f"flashpass {flashpass.__version__}"


@pytest.mark.slow  # subprocesses of python -m flashpass
def test_closed_pipe_is_quiet(tmp_path):
    path = _artifact(tmp_path, VARIANTS[1])
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = f"{sys.executable} -m flashpass explain {path} --kernel blockwise --json | head -n 1"
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env)
    assert proc.stdout.strip() == "{", proc.stdout
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.slow  # subprocesses of python -m flashpass
def test_platform_gpu_is_the_artifacts_gpu(tmp_path):
    variant = VARIANTS[1]
    exp = jax.export.export(jax.jit(variant.fn), platforms=("cpu", "cuda"))(*variant.structs())
    path = tmp_path / "two.bin"
    path.write_bytes(exp.serialize())
    data = json.loads(_run("explain", str(path), "--platform", "gpu", "--json").stdout)
    assert data["platforms"] == ["cuda"], data
    _one_line_error(
        _run("explain", str(_artifact(tmp_path, variant)), "--platform", "gpu", check=False),
        "'cuda' or 'rocm'",
    )
