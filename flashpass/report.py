"""What flashpass did to a function, per attention site, and why."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from .layers import display_path


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """An attention site replaced by a kernel call."""

    pattern: str
    kernel: str
    location: str | None
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    dtype: str
    causal: bool
    mask: str  # "none", "causal", "key mask", "causal+dense", ... (docs/report.md)
    bias: bool
    scale: float
    scope: str  # where in the program: "top level", "scan body at ...", ...
    spec: dict = dataclasses.field(default_factory=dict, repr=False)
    rejected: dict = dataclasses.field(default_factory=dict)  # earlier kernels -> reasons
    #: True when the site's backward (in a differentiated program: a training
    #: step) was replaced too: the report's "forward+backward".
    backward: bool = False
    #: A ring (``kernel == "ring"``): the kernels its steps run, e.g.
    #: ``"blockwise"``, ``"splash, plain JAX"`` (`flashpass.ring.cases`).
    ring_steps: str = ""
    #: Which layer of the model: the JAX name stack of the site (Flax module
    #: paths, ``jax.named_scope``), e.g. ``"Model/decoder/layers_3/attn"``, else
    #: the nearest line of the user's own code (`flashpass.layers`).
    layer: str = ""
    #: True when the site applies dropout to the attention weights (the kernel
    #: regenerates the program's own keep-mask).
    dropout: bool = False
    #: Where the placement was decided: "" at trace time (from the types or
    #: the program's annotations), "placed at partitioning" when XLA's
    #: partitioner decides, by the shardings it chose
    #: (`flashpass.placement.deferred`).
    placement: str = ""
    #: Why a mask the program adds to or writes into the scores stays a dense
    #: array operand of the kernel (docs/troubleshooting.md), one line each.
    dense: tuple = ()

    @property
    def passes(self) -> str:
        return "forward+backward" if self.backward else "forward"

    def to_dict(self) -> dict:
        return _jsonable(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A site (or near-site) that keeps its original computation."""

    location: str | None
    reason: str
    scope: str
    pattern: str | None = None
    rejections: dict = dataclasses.field(default_factory=dict)  # kernel -> [reasons]
    #: Which layer of the model (as `Rewrite.layer`); "" when unknown.
    layer: str = ""

    def to_dict(self) -> dict:
        return _jsonable(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class InternalError:
    """A site where the pass itself failed (a flashpass bug): kept as written.

    ``stage`` is the pipeline stage that raised ("match", "plan", "rewrite");
    ``error`` the exception's type and first line; ``hint`` how to report it.
    """

    location: str | None
    stage: str
    error: str
    scope: str
    pattern: str | None = None
    hint: str = ""

    def to_dict(self) -> dict:
        return _jsonable(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class Unrecognised:
    """A softmax-like computation not recognised as attention: an ``exp`` as
    big as a score matrix whose values reach a ``dot_general``, which the
    matcher did not take as an attention site.  ``location`` is the exp's;
    ``broke``/``broke_at`` the first equation that broke the chain, and where;
    ``reason`` the whole story (patterns/softmax_like.py)."""

    location: str | None
    reason: str
    scope: str
    broke: str
    broke_at: str | None = None
    layer: str = ""

    def to_dict(self) -> dict:
        return _jsonable(dataclasses.asdict(self))


@dataclasses.dataclass
class Report:
    """Per-site result of `flashpass.optimize` for one input signature.

    ``rewrites`` lists the sites replaced by a kernel; ``fallbacks`` those kept
    as written, each with the first condition that failed; ``errors`` the
    sites kept because the pass itself failed (`InternalError`, a bug to
    report; empty in a healthy run); ``unrecognised`` the softmax-like
    computations not recognised as attention (`Unrecognised`): kept as
    written, each with the equation that broke the chain.
    """

    rewrites: list = dataclasses.field(default_factory=list)
    fallbacks: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    unrecognised: list = dataclasses.field(default_factory=list)
    platform: str = ""
    jax_version: str = ""
    #: Why the pass did not run (``"FLASHPASS_DISABLE=1"``, ``"kernel=[]"``):
    #: the function runs as written under ``jax.jit``; "" when it ran.
    disabled: str = ""

    @property
    def kernels(self) -> list[str]:
        return [r.kernel for r in self.rewrites]

    def to_dict(self) -> dict:
        return {
            "platform": self.platform,
            "jax_version": self.jax_version,
            "disabled": self.disabled,
            "rewrites": [r.to_dict() for r in self.rewrites],
            "fallbacks": [f.to_dict() for f in self.fallbacks],
            "internal_errors": [e.to_dict() for e in self.errors],
            "unrecognised": [u.to_dict() for u in self.unrecognised],
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        if self.disabled:
            return (
                f"flashpass report ({self.platform}): disabled ({self.disabled}): nothing "
                "matched or rewritten; the function runs as written under jax.jit"
            )
        lines = [
            f"flashpass report ({self.platform}): {len(self.rewrites)} rewritten, "
            f"{len(self.fallbacks)} kept as written"
            + (f", {len(self.errors)} internal error(s)" if self.errors else "")
            + (
                f", {len(self.unrecognised)} softmax-like not recognised as attention"
                if self.unrecognised
                else ""
            )
        ]
        if self.rewrites:
            # The passes column appears for differentiated programs only.
            trained = any(r.backward for r in self.rewrites)
            rows = [("#", "kernel", "layer", "location", "q / k / v", "dtype", "mask", "bias")]
            rows[0] += ("dropout", "scale") + (("passes",) if trained else ())
            for i, r in enumerate(self.rewrites):
                rows.append(
                    (
                        str(i),
                        r.kernel
                        + (f" ({r.ring_steps})" if r.ring_steps else "")
                        + (f" [{r.placement}]" if r.placement else ""),
                        r.layer or "?",
                        display_path(r.location),
                        f"{_dims(r.q_shape)} / {_dims(r.k_shape)} / {_dims(r.v_shape)}",
                        r.dtype,
                        r.mask,
                        "yes" if r.bias else "no",
                        "yes" if r.dropout else "no",
                        f"{r.scale:.4g}",
                    )
                    + ((r.passes,) if trained else ())
                )
            lines += ["", "rewritten:", *_table(rows)]
        if self.fallbacks:
            lines += ["", "kept as written:"]
            for i, f in enumerate(self.fallbacks):
                reason = _display_paths(f.reason)
                where = display_path(f.location)
                where = f"{f.layer} ({where})" if f.layer and f.layer != where else where
                lines.append(f"  [{i}] {where}: {reason}")
                for kernel, reasons in f.rejections.items():
                    for other in reasons:  # only what the reason above does not say
                        if _display_paths(other) not in reason:
                            lines.append(f"        {kernel}: {_display_paths(other)}")
        if self.errors:
            lines += ["", "internal errors (kept as written; a flashpass bug, please report):"]
            for i, e in enumerate(self.errors):
                error = _display_paths(e.error)
                lines.append(f"  [{i}] {display_path(e.location)}: {e.stage} failed: {error}")
        if self.unrecognised:
            lines += [
                "",
                "softmax-like computations not recognised as attention (kept as written):",
            ]
            for i, u in enumerate(self.unrecognised):
                where = display_path(u.location)
                where = f"{u.layer} ({where})" if u.layer and u.layer != where else where
                lines.append(f"  [{i}] {where}: {_display_paths(u.reason)}")
        dense = [(i, note) for i, r in enumerate(self.rewrites) for note in r.dense]
        if dense:
            lines += ["", "masks kept as dense arrays:"]
            lines += [f"  [{i}] {_display_paths(note)}" for i, note in dense]
        declined = [(i, r) for i, r in enumerate(self.rewrites) if r.rejected]
        if declined:
            lines += ["", "kernels tried first:"]
            for i, r in declined:
                for kernel, reasons in r.rejected.items():
                    lines.append(f"  [{i}] {kernel}: {_display_paths(reasons[0])}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        if self.disabled:
            return f"Report(disabled={self.disabled!r})"
        errors = f", errors={len(self.errors)}" if self.errors else ""
        if self.unrecognised:
            errors += f", unrecognised={len(self.unrecognised)}"
        return f"Report(rewrites={len(self.rewrites)}, fallbacks={len(self.fallbacks)}{errors})"


def _dims(shape) -> str:
    return "x".join(str(d) for d in shape)


#: An absolute ``path.py:LINE`` inside a reason (`matcher.where` writes them).
_LOCATION = re.compile(r"(?:[A-Za-z]:)?[\\/][^\s:`'\"]*?\.py:\d+")


def _display_paths(text: str) -> str:
    """``text`` with each source location shown as `display_path` shows it."""
    return _LOCATION.sub(lambda m: display_path(m.group(0)), text)


def _table(rows) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, row in enumerate(rows):
        cells = (c.ljust(w) for c, w in zip(row, widths, strict=True))
        out.append(("  " + "  ".join(cells)).rstrip())
        if j == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return out


def _jsonable(value: Any):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)
