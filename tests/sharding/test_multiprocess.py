"""Two processes, four CPU devices each, joined by jax.distributed on 127.0.0.1
with gloo collectives, as on a multi-host pod: a sequence-sharded site runs
as a ring across both processes (tests/sharding/multiprocess_ring.py), stated
by the program or placed at partitioning (nothing annotated)."""

import pathlib
import socket
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ring_across_two_processes():
    port = _free_port()
    script = str(HERE / "multiprocess_ring.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(i), str(port)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the two-process run did not finish in {TIMEOUT_S} s")
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-6000:]
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
        _, out_err, grad_err, kernels = line.split()
        # The causal ring, load-balanced across the processes (flashpass/ring/zigzag.py).
        assert kernels == "ring[blockwise,_zig-zag]", out[-3000:]
        assert float(out_err) < 2e-5 and float(grad_err) < 1e-4, line
        # Nothing annotated: XLA's partitioner places it, as the same ring.
        (line,) = [x for x in out.splitlines() if x.startswith("DEFERRED ")]
        _, out_err, grad_err, where, how, gathers = line.split()
        assert where == "placed_at_partitioning", line
        assert how == "ring_over_seq_(blockwise,_zig-zag)", line
        assert gathers == "0" and float(out_err) < 2e-5 and float(grad_err) < 1e-4, line
