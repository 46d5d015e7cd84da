"""The report of rewriting an exported artifact: per platform, plus the lift."""

from __future__ import annotations

import dataclasses

from flashpass.report import Report


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
