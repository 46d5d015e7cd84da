"""examples/sharded.py runs, passes its own checks and prints what docs/sharding.md shows."""

import pathlib
import re
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import sharded  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")


def test_sharded_example():
    lines: list[str] = []
    assert sharded.run("blockwise", log=lines.append), "\n".join(lines)
    text = "\n".join(lines)
    assert "flashpass_blockwise on q 2x2x128x16 inside shard_map" in text, text
    assert text.count("numerics: PASS") == 2 and "keys whole" in text, text
    assert "0 rewritten" not in text and "collectives {}" in text, text
    # docs/sharding.md shows this output verbatim, up to the measured errors'
    # last digits (they move with the kernel's tiling and the JAX version).
    doc = (ROOT / "docs" / "sharding.md").read_text()
    shown = doc.split("```\n== 1. report", 1)[1].split("```", 1)[0]

    def errors_masked(s: str) -> str:
        return re.sub(r"error \d\.\de-\d\d", "error <e>", s).strip()

    assert errors_masked("== 1. report" + shown) == errors_masked(text), (
        "docs/sharding.md is out of date"
    )
