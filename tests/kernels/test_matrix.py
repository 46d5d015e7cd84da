"""Kernel capabilities: the generated docs table, and who reads the declarations."""

from __future__ import annotations

import pathlib

import pytest

from flashpass import sharding
from flashpass.kernels import Kernel, get_kernel, kernel_names, matrix

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pinned_jax() -> str:
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.startswith("jax=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError("constraints.txt pins no jax")


def test_docs_kernels_md_has_the_generated_matrix():
    # The page is generated on the JAX that constraints.txt pins: on another
    # version the GPU order (tokamax from 0.11.1) and Triton's availability
    # differ, so the columns do too.
    import jax

    if jax.__version__ != _pinned_jax():
        pytest.skip(
            f"docs/kernels.md is generated on JAX {_pinned_jax()}, this is {jax.__version__}"
        )
    page = (ROOT / "docs" / "kernels.md").read_text()
    assert matrix.BEGIN in page and matrix.END in page
    assert matrix.replace_in(page) == page, (
        "docs/kernels.md's capability matrix is out of date with the kernels' declarations: "
        "run `python -m flashpass.kernels.matrix --write docs/kernels.md`"
    )


def test_matrix_reads_the_declarations():
    table = matrix.capability_matrix()
    header = table.splitlines()[0]
    assert all(f"`{name}`" in header for name in kernel_names())
    bias = next(line for line in table.splitlines() if "descriptors: bias" in line)
    cells = [c.strip() for c in bias.strip("|").split("|")][2:]
    names = [c.strip(" `") for c in header.strip("|").split("|")][2:]
    assert dict(zip(names, cells, strict=True))["splash"] == "—"
    assert dict(zip(names, cells, strict=True))["pallas_tpu"] == "yes"


def test_replace_in_needs_the_markers():
    with pytest.raises(ValueError, match="capability matrix"):
        matrix.replace_in("# a page without the table\n")
    page = f"before\n{matrix.BEGIN}\nstale\n{matrix.END}\nafter\n"
    want = f"before\n{matrix.BEGIN}\n\n| t |\n\n{matrix.END}\nafter\n"
    assert matrix.replace_in(page, "| t |\n") == want


def test_sharding_reads_partitionable_and_plain_jax():
    """The name sets sharding.py used to keep are the declarations now."""
    assert not hasattr(sharding, "PARTITIONABLE") and not hasattr(sharding, "PLAIN_JAX")
    partitionable = {n for n in kernel_names() if get_kernel(n).partitionable}
    plain = {n for n in kernel_names() if get_kernel(n).plain_jax}
    assert partitionable == {"blockwise", "chunked", "reference", "cudnn"}
    assert plain == {"blockwise", "chunked", "reference"}


def test_capability_defaults_and_the_old_supports_grad_name():
    class Minimal(Kernel):
        name = "minimal"

    class Old(Kernel):
        name = "old"
        supports_grad = False

    assert (Minimal.partitionable, Minimal.plain_jax, Minimal.dropout, Minimal.ring_step) == (
        False,
        False,
        False,
        False,
    )
    assert Minimal.grad and Minimal().supports_grad
    assert Old.grad is False and Old().supports_grad is False
