"""The report of rewriting an exported artifact: per platform, plus the lift."""

from __future__ import annotations

import dataclasses
import os
import re

from flashpass.layers import _LAYER_NAME, display_path
from flashpass.pipeline import distinguish_layers
from flashpass.report import Report

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A ``path.py:LINE`` inside flashpass itself (the lifter's rules), in a reason or scope.
_OWN_PATH = re.compile(re.escape(_PACKAGE) + r"[\\/][^\s:`'\"]*?\.py:\d+")
#: ``loc("name"(...))``: the op's name (a name scope path ending in the op's name).
_LOC_NAME = re.compile(r'^loc\("((?:[^"\\]|\\.)*)"\(')
#: The first ``"file":LINE:`` of a ``loc(...)`` (the innermost frame).
_LOC_FILE = re.compile(r'"((?:[^"\\]|\\.)*)":(\d+):')
NO_LOCATION = "no location in the artifact"


@dataclasses.dataclass(frozen=True)
class SiteRoute:
    """Which route one site took, and why: ``"lift"`` (the whole module was
    lifted and re-exported), ``"splice"`` (its ops were replaced by a call),
    or ``"kept"`` (left as written)."""

    location: str
    route: str
    why: str


@dataclasses.dataclass
class ExportReport(Report):
    """A `Report` for an exported artifact.

    ``rewrites``/``fallbacks``/``errors`` are those of ``platform`` (the
    artifact's first platform); ``by_platform`` holds each platform's own
    report.  ``route`` is ``"lift"`` when the artifact was lifted and
    rewritten, ``"kept"`` when it was returned unchanged, with ``kept_reason``
    saying why.  ``islands`` lists the ops the lifter has no rule for (called
    as opaque modules, without a derivative).
    """

    route: str = "lift"
    kept_reason: str = ""
    platforms: tuple = ()
    islands: list = dataclasses.field(default_factory=list)
    by_platform: dict = dataclasses.field(default_factory=dict, repr=False)
    #: The splice route: why a site found was not spliced (it is kept as written).
    splice_notes: list = dataclasses.field(default_factory=list)
    #: Each site found: the route it took and why (`SiteRoute`).
    sites: list = dataclasses.field(default_factory=list)
    #: The artifact has 64-bit types (int64 tokens): x64 must be on to call it
    #: (as the original); lifting and re-exporting turn it on in a scope.
    needs_x64: bool = False
    #: The rewritten artifact's derivative: "lifted" (the rewritten program's,
    #: the kernels' backward) or "artifact" (the original artifact's own VJP).
    backward: str = "lifted"

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.update(
            route=self.route,
            kept_reason=self.kept_reason,
            platforms=list(self.platforms),
            islands=[dataclasses.asdict(i) for i in self.islands],
            by_platform={p: r.to_dict() for p, r in self.by_platform.items()},
            splice_notes=list(self.splice_notes),
            sites=[dataclasses.asdict(s) for s in self.sites],
            needs_x64=self.needs_x64,
            backward=self.backward,
        )
        return out

    def __str__(self) -> str:
        head = f"artifact for {', '.join(self.platforms)}: route {self.route}"
        x64 = (
            "\n  64-bit types: call it with x64 on (jax.config.update('jax_enable_x64', True)),"
            " as the original"
            if self.needs_x64
            else ""
        )
        if self.route == "kept":
            return f"{head}{x64}\n  kept unchanged: {self.kept_reason}"
        lines = [head + x64]
        if self.backward == "artifact":
            lines.append(
                "  derivative: the artifact's own (its exporter's rules kept; the original "
                "backward runs); backward='lifted' for the kernels' backward"
            )
        lines += [f"  site at {s.location}: {s.route} ({s.why})" for s in self.sites]
        lines += [f"  not spliced (kept as written): {note}" for note in self.splice_notes]
        for island in self.islands:
            lines.append(
                f"  opaque island: {island.op} x{island.count} at {island.location} "
                "(no lifting rule; called as its own module, not differentiable)"
            )
        for platform, report in self.by_platform.items():
            lines += ["", f"[{platform}]", Report.__str__(report)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"ExportReport(route={self.route!r}, platforms={self.platforms}, "
            f"rewrites={len(self.rewrites)}, fallbacks={len(self.fallbacks)}, "
            f"islands={len(self.islands)})"
        )


def artifact_location(loc: str) -> tuple[str | None, str]:
    """``(location, layer)`` of a lifted op from its ``loc(...)`` text: the
    artifact's ``file:LINE`` (None without one) and the layer its name scopes
    say (e.g. ``Model/attn``; else the location; else `NO_LOCATION`)."""
    found = _LOC_FILE.search(loc)
    location = None
    if found:  # "-": the line of MLIR text parsed from memory (a bare module)
        file = "module text" if found.group(1) == "-" else found.group(1)
        location = f"{file}:{found.group(2)}"
    named = _LOC_NAME.match(loc)
    parts = named.group(1).split("/")[:-1] if named else []  # the last part is the op
    layer = "/".join(p for p in parts if _LAYER_NAME.match(p))
    return location, layer or (display_path(location) if location else NO_LOCATION)


def relocated(report: Report, op_locations: list, scope_prefix: str) -> Report:
    """``report`` (of a lifted module) pointing at the artifact's own locations:
    each entry's ``location`` and ``layer`` from the ``loc(...)`` of the op its
    name scope (``scope_prefix`` and an index into ``op_locations``) names,
    never at the lifter's own source lines."""
    marker = re.compile(re.escape(scope_prefix) + r"(\d+)")

    def text(value: str) -> str:
        return _OWN_PATH.sub("the lifted module", value) if value else value

    def fix(entry):
        changes = {}
        found = marker.findall(getattr(entry, "layer", "") or "")
        if found and int(found[-1]) < len(op_locations):
            location, layer = artifact_location(op_locations[int(found[-1])])
            changes.update(location=location, layer=layer)
        elif entry.location and entry.location.startswith(_PACKAGE):
            changes["location"] = None
            if hasattr(entry, "layer"):
                changes["layer"] = NO_LOCATION
        for name in ("scope", "reason", "error", "broke_at"):
            value = getattr(entry, name, None)
            if isinstance(value, str) and _OWN_PATH.search(value):
                changes[name] = text(value)
        dense = getattr(entry, "dense", ())  # a rewrite's notes on masks kept dense
        if any(_OWN_PATH.search(note) for note in dense):
            changes["dense"] = tuple(text(note) for note in dense)
        return dataclasses.replace(entry, **changes) if changes else entry

    out = dataclasses.replace(
        report,
        rewrites=[fix(r) for r in report.rewrites],
        fallbacks=[fix(f) for f in report.fallbacks],
        errors=[fix(e) for e in report.errors],
        unrecognised=[fix(u) for u in report.unrecognised],
    )
    distinguish_layers(out)  # two sites of one source line: numbered, as in optimize
    return out
