"""Docs stay in sync with the code."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _miss_reasons():
    """Literal fragments of every `Miss(...)` reason in the matcher."""
    files = sorted((ROOT / "patterns").glob("*.py")) + [
        ROOT / "flashpass" / name for name in ("match.py", "backward.py", "scans.py", "pipeline.py")
    ]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Miss"):
                continue
            if any(k.arg == "relevant" for k in node.keywords):
                continue  # silent misses (not a softmax at all) are never reported
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant):
                parts = [arg.value]
            elif isinstance(arg, ast.JoinedStr):
                parts = [v.value for v in arg.values if isinstance(v, ast.Constant)]
            else:
                continue  # a computed reason (e.g. soft-cap) is listed by hand below
            fragment = max(parts, key=len).strip(" `")
            found.append((path.name, fragment))
    return found


def test_troubleshooting_lists_every_reason():
    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    flat = re.sub(r"\s+", " ", doc)
    missing = []
    for name, fragment in _miss_reasons():
        words = fragment.split(": ")[0].split("; ")[0]
        if len(words) >= 6 and words not in flat:
            missing.append(f"{name}: {words!r}")
    for literal in (
        "tanh on the scores is not a soft-cap",
        "short sequence",
        "interpret=True",
        "while tracing/lowering",
        "rewriting the enclosing body failed",
    ):
        if literal not in flat:
            missing.append(literal)
    assert not missing, "docs/troubleshooting.md lacks:\n" + "\n".join(missing)
