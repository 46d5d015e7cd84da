"""Size limits on flashpass's sources, checked: no module over 600 lines, no
function over 150.

A module that outgrows the limit is split along a seam (as ``api.py`` was into
the front door, `flashpass.arguments`, `flashpass.cache`, `flashpass.methods`
and `flashpass.nnx_state`); a function, into the steps it takes.  The check
reads the sources with `ast`: nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

MAX_MODULE_LINES = 600
#: A function's lines run from its ``def`` to its last line (docstring, nested
#: functions and all; decorators not counted).
MAX_FUNCTION_LINES = 150


def sources() -> list[pathlib.Path]:
    return sorted(p for d in ("flashpass", "patterns", "kernels") for p in (ROOT / d).rglob("*.py"))


def oversized(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    rel = path.relative_to(ROOT)
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{rel}: {lines} lines (at most {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(
                    f"{rel}:{node.lineno}: {node.name} is {length} lines "
                    f"(at most {MAX_FUNCTION_LINES})"
                )
    return found


def violations() -> list[str]:
    return [line for path in sources() for line in oversized(path)]


def test_modules_and_functions_are_within_the_limits():
    bad = violations()
    assert not bad, "over the size limits:\n" + "\n".join(bad)


def test_every_source_folder_is_read():
    """A check over no files would pass vacuously."""
    folders = {p.relative_to(ROOT).parts[0] for p in sources()}
    assert folders == {"flashpass", "patterns", "kernels"}


def _function(name: str, body_lines: int) -> str:
    return f"def {name}():\n" + "    x = 0\n" * body_lines


@pytest.mark.parametrize(
    "source, expect",
    [
        ("x = 0\n" * (MAX_MODULE_LINES + 1), f"{MAX_MODULE_LINES + 1} lines (at most"),
        (_function("long", MAX_FUNCTION_LINES), f"long is {MAX_FUNCTION_LINES + 1} lines"),
        (
            "class C:\n    def method(self):\n" + "        x = 0\n" * MAX_FUNCTION_LINES,
            "method is",
        ),
        (
            "def outer():\n    def inner():\n" + "        x = 0\n" * MAX_FUNCTION_LINES,
            "inner is",
        ),
    ],
)
def test_a_violation_is_reported(monkeypatch, source, expect):
    """An oversized module, function, method or nested function planted in
    kernels/ fails the check; one at the limits passes."""
    probe = ROOT / "kernels" / "_size_probe.py"
    text = {"now": source}
    monkeypatch.setattr(
        pathlib.Path,
        "read_text",
        lambda self, *a, _orig=pathlib.Path.read_text, **k: (
            text["now"] if self == probe else _orig(self, *a, **k)
        ),
    )
    real_sources = sources()
    monkeypatch.setitem(globals(), "sources", lambda: real_sources + [probe])
    bad = violations()
    assert any(expect in line and "_size_probe.py" in line for line in bad), bad
    fits = _function("fits", MAX_FUNCTION_LINES - 1)  # a def line and its body
    text["now"] = "x = 0\n" * (MAX_MODULE_LINES - MAX_FUNCTION_LINES) + fits
    assert not [line for line in violations() if "_size_probe.py" in line]
