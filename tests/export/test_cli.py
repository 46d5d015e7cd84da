"""`python -m flashpass explain|rewrite`, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
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
