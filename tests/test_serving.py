"""A serving process's resident memory over varied shapes stays bounded.

Runs ``benchmarks/serving.py``'s measurement in a fresh process: a
self-attention and a decode step, both ``optimize``d with a forced kernel,
called on new signatures whose length, batch and dtype all vary; the growth of
current resident memory (VmRSS, read after ``malloc_trim``) is bounded by
what ``cache_size`` entries hold plus what JAX and XLA keep per compiled
program (``jax.jit`` keeps as much; `benchmarks/serving.py` prints both).
"""

import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "serving.py"

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc malloc_trim, /proc/self/status"
)


def _growth(mode: str, shapes: int, cache_size: int, workload="mixed") -> tuple[float, float]:
    """(VmRSS growth, what is left of it with every cache cleared), in MB."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--child", mode, str(shapes), str(cache_size), workload],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    grown, residue = map(float, out.stdout.split()[-2:])
    return grown, residue


@pytest.mark.slow  # (test_resources' decode-step bound is the default set's memory check)
def test_memory_over_varied_shapes_is_bounded_by_the_cache():
    """30 signatures (15 per function), ``cache_size=2``.  What the caches
    hold (the entries' programs, JAX's bounded tracing caches) stays under
    12 MB: ``jax.jit``, which keeps every shape's program, holds ~2 MB per
    shape, so 30 shapes kept would be ~60 MB.  The whole growth, including
    what JAX and XLA keep per compiled program whoever compiles it (0.3-0.5 MB
    per shape, measured next to ``jax.jit`` by `benchmarks/serving.py`), stays
    under 40 MB."""
    grown, residue = _growth("optimize", 30, 2)
    held = grown - residue
    assert held <= 12, f"the caches hold {held:.1f} MB after 30 shapes at cache_size=2"
    assert grown <= 40, f"grew {grown:.1f} MB over 30 shapes ({residue:.1f} MB held by no cache)"


@pytest.mark.slow
def test_memory_over_250_varied_shapes():
    """250 signatures, ``cache_size=32``: at most 150 MB
    (``python benchmarks/serving.py`` prints it next to ``jax.jit``'s growth)."""
    grown, residue = _growth("optimize", 250, 32)
    assert grown <= 150, f"grew {grown:.1f} MB over 250 shapes ({residue:.1f} MB held by no cache)"


@pytest.mark.slow
def test_self_attention_memory_as_the_os_sees_it():
    """Issue 41's workload: the self-attention alone on 250 new lengths
    (q/k/v ``[1, T, 2, 16]``, T = 66 ... 315), ``cache_size=32``, VmRSS read
    after ``gc.collect`` only: at most 150 MB (``jax.jit`` alone grows about
    three times that; docs/benchmarks.md)."""
    grown, residue = _growth("optimize", 250, 32, "self-attention")
    assert grown <= 150, f"grew {grown:.1f} MB over 250 shapes ({residue:.1f} MB held by no cache)"
