"""The direction of dependency between flashpass's layers, checked.

::

    engine (api, pipeline, select, placement, ring, rewrite, export, ...)
       |-> patterns/  (program -> sites: the matcher, match/builder/backward/scans
       |               and the piece modules)
       |-> kernels/   (spec -> kernel call)
              |-> base (ops, spec, site, terms, replay, roles, graph, compat, errors)

* base imports base only (and JAX, numpy, the standard library);
* patterns/ and kernels/ import base and themselves, never the engine, and never
  each other;
* the engine may import anything, but enters patterns/ through its package alone
  (`flashpass.patterns.match_scopes`, the one entry point, and its result types),
  never a module inside it.

Every import counts, module level or inside a function (a lazy import is still a
dependency).  The check reads the source with `ast`: nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The base layer: the types every other layer builds on.
BASE = (
    "flashpass.ops",
    "flashpass.spec",
    "flashpass.site",
    "flashpass.terms",
    "flashpass.replay",
    "flashpass.roles",
    "flashpass.graph",
    "flashpass.compat",
    "flashpass.errors",
)

#: Which layers each layer may import (its own included).
ALLOWED = {
    "base": {"base"},
    "patterns": {"patterns", "base"},
    "kernels": {"kernels", "base"},
    "engine": {"engine", "patterns", "kernels", "base"},
}


def module_name(path: pathlib.Path) -> str:
    """The installed name of a source file (patterns/ and kernels/ are
    installed as ``flashpass.patterns`` and ``flashpass.kernels``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("patterns", "kernels"):
        parts.insert(0, "flashpass")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(name: str) -> str:
    if name.startswith("flashpass.patterns"):
        return "patterns"
    if name.startswith("flashpass.kernels"):
        return "kernels"
    if any(name == b or name.startswith(b + ".") for b in BASE):
        return "base"
    return "engine"


def sources() -> list[pathlib.Path]:
    return sorted(p for d in ("flashpass", "patterns", "kernels") for p in (ROOT / d).rglob("*.py"))


def imported(path: pathlib.Path, known: set[str]) -> set[tuple[str, int]]:
    """``(module, line)`` for each flashpass module ``path`` imports, resolved to
    the module that is loaded (``from flashpass import compat`` is
    ``flashpass.compat``; ``from flashpass.spec import X`` is
    ``flashpass.spec``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` loads pkg.sub when sub is a module.
            targets = [f"{module}.{a.name}" for a in node.names] + [module]
        else:
            continue
        for target in targets:
            if not target.startswith("flashpass"):
                continue
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != "flashpass":
                found.add((target, node.lineno))
    # `from .spec import X` names both `flashpass.spec.X` (not a module) and
    # `flashpass.spec`: keep each module once per line.
    return found


def violations() -> list[str]:
    files = sources()
    known = {module_name(p) for p in files}
    bad = []
    for path in files:
        here = layer(module_name(path))
        for target, line in sorted(imported(path, known)):
            there = layer(target)
            if there not in ALLOWED[here]:
                rel = path.relative_to(ROOT)
                bad.append(f"{rel}:{line}: {here} imports {there} ({target})")
    return bad


def test_layers_import_only_downwards():
    bad = violations()
    assert not bad, "imports against the layer contract:\n" + "\n".join(bad)


def test_the_engine_enters_patterns_through_its_package():
    """The matcher has one entry point: the engine imports ``flashpass.patterns``
    (which re-exports `match_scopes`), never one of its modules."""
    files = sources()
    known = {module_name(p) for p in files}
    inside = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for path in files
        if layer(module_name(path)) == "engine"
        for target, line in sorted(imported(path, known))
        if layer(target) == "patterns" and target != "flashpass.patterns"
    ]
    assert not inside, "the engine imports inside patterns/:\n" + "\n".join(inside)
    entering = [
        path
        for path in files
        if layer(module_name(path)) == "engine"
        and any(t == "flashpass.patterns" for t, _ in imported(path, known))
    ]
    assert entering, "no engine module imports flashpass.patterns: the check is vacuous"


def test_every_layer_is_populated():
    """A contract over empty layers would pass vacuously: each layer has modules,
    and the check sees imports between them (a base import from patterns/)."""
    files = sources()
    known = {module_name(p) for p in files}
    layers = {layer(n) for n in known}
    assert layers == set(ALLOWED)
    down = [
        t
        for p in files
        if layer(module_name(p)) == "patterns"
        for t, _ in imported(p, known)
        if layer(t) == "base"
    ]
    assert down, "no patterns -> base import seen: the import reader is broken"


@pytest.mark.parametrize(
    "source, expect",
    [
        ("from flashpass import select\n", "patterns imports engine (flashpass.select)"),
        ("def f():\n    from flashpass.kernels import blockwise\n", "patterns imports kernels"),
        ("from ..pipeline import run_pass\n", "patterns imports engine (flashpass.pipeline)"),
    ],
)
def test_a_violation_is_reported(tmp_path, monkeypatch, source, expect):
    """A deliberate upward import in a patterns/ module fails the contract."""
    probe = ROOT / "patterns" / "_layer_probe.py"
    monkeypatch.setattr(
        pathlib.Path,
        "read_text",
        lambda self, *a, _orig=pathlib.Path.read_text, **k: (
            source if self == probe else _orig(self, *a, **k)
        ),
    )
    real_sources = sources()
    monkeypatch.setitem(globals(), "sources", lambda: real_sources + [probe])
    bad = violations()
    assert any(expect in line and "_layer_probe.py" in line for line in bad), bad
