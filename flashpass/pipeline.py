"""The pass as data flow: trace → view → match → choose → plan → rewrite → report.

`trace` turns a function into a ``ClosedJaxpr``; `run_pass` does the rest.
Each stage is a function that returns its result and its failures; the
report is assembled from them at the end.  Nothing here evaluates on the
trace that is active around the pass: the only values it computes (constant
folding in `graph.Scope.fold`, kernel probes in `select.probe`) are computed
eagerly on concrete values (`compat.compile_time_eval`) or traced abstractly
on their own.

Internal errors (an exception in a stage, see errors.py) keep the affected
sites as written, are listed in the report's ``errors`` and warned about on
the ``flashpass`` logger; under the strict switch they re-raise.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pathlib
import re

import jax
import numpy as np

from flashpass.kernels import CheckContext
from flashpass.patterns import SoftmaxLike, match_scopes

from . import compat, errors, layers
from .graph import build_scopes
from .ops import KINDS
from .placement import PLACED_AT_PARTITIONING as PLACED_AT_PARTITIONING  # (the report's word)
from .placement import Placed, place
from .report import Fallback, InternalError, Report, Rewrite, Unrecognised
from .rewrite import Plan, rewrite
from .select import PlannedSite, choose, materialises, resolve_order
from .spec import Alibi, Bias, Causal

logger = logging.getLogger("flashpass")


def trace(fn, avals):
    """Stage 1: ``fn``'s ``ClosedJaxpr`` and output shapes for ``avals``.

    ``avals`` are abstract values (``jax.typeof`` of the arguments, or of the
    tracers of an enclosing trace): their shardings and varying manual axes
    (inside a user's ``shard_map``) are part of the program's types.
    """
    return jax.make_jaxpr(fn, return_shape=True)(*avals)


@dataclasses.dataclass
class _Matched:
    """Stage 3's result: sites found, per scope, and what was not."""

    sites: list  # (scope, AttentionSite)
    fallbacks: list  # Fallback
    errors: list  # InternalError
    unrecognised: list = dataclasses.field(default_factory=list)  # Unrecognised


def _unrecognised(miss: SoftmaxLike, scope_name: str) -> Unrecognised:
    return Unrecognised(
        miss.location,
        miss.reason,
        scope_name,
        miss.broke.prim,
        miss.broke.location,
        layer=layers.layer_of(miss.node),
    )


def match(scopes, where_is: dict) -> _Matched:
    """Stage 3: every site of every scope, and the near misses."""
    found = _Matched([], [], [])
    found.sites, kept = match_scopes(scopes)
    # A backward body's recompute of a softmax belongs to a site found elsewhere.
    claimed = {n for _, site in found.sites for n in site.nodes}
    for scope, miss in kept:
        if miss.node is not None and miss.node in claimed and miss.internal is None:
            continue
        scope_name = where_is[scope.prefix]
        if isinstance(miss, SoftmaxLike):
            found.unrecognised.append(_unrecognised(miss, scope_name))
        elif miss.internal is not None:
            error = InternalError(
                miss.location, "match", miss.internal, scope_name, hint=errors.HOW_TO_REPORT
            )
            found.errors.append(error)
        else:
            found.fallbacks.append(
                Fallback(miss.location, miss.reason, scope_name, layer=layers.layer_of(miss.node))
            )
    return found


def choose_kernels(sites, kernels, ctx: CheckContext, interpret: bool, where_is: dict):
    """Stage 4: ``(planned sites, fallbacks)``: the first kernel that accepts
    each site, or the reasons every kernel gave."""
    planned, fallbacks = [], []
    for scope, site in sites:
        # A site whose backward is replaced needs the kernel's gradient.
        usable = [k for k in kernels if k.grad or site.backward is None]
        # Cost models read how the program holds k and v (kernels/blockwise/cost.py).
        site_ctx = dataclasses.replace(ctx, kv_layout=site.kv_layout())
        chosen, rejections = choose(site.spec, usable, site_ctx)
        before = kernels if chosen is None else kernels[: kernels.index(chosen)]
        for k in before:
            if k not in usable:
                rejections[k.name] = [f"{k.name} has no backward, and this site is differentiated"]
        if chosen is None:
            fallbacks.append(
                Fallback(
                    site.location,
                    _rejection_summary(rejections),
                    where_is[scope.prefix],
                    site.pattern,
                    rejections,
                    layer=layers.layer_of(site.root),
                )
            )
            continue
        note = materialises(chosen, site.spec, ctx)
        notes = () if note is None else (note,)
        planned.append(PlannedSite(site, chosen, interpret, rejections, notes))
    return planned, fallbacks


def run_pass(
    closed,
    *,
    kernel=None,
    platform: str = "cpu",
    interpret: bool = False,
    zigzag: bool = True,
) -> tuple[object, Report]:
    """Stages 2-7 on a traced program: ``(rewritten ClosedJaxpr, Report)``.
    ``zigzag``: balance causal rings where they can be (`flashpass.ring.zigzag`)."""
    kernels, explicit = resolve_order(kernel, platform)
    ctx = CheckContext(platform=platform, interpret=interpret, explicit=explicit)
    report = Report(platform=platform, jax_version=jax.__version__)

    # Dead equations are dropped first: autodiff leaves some (a reduce_max's unused
    # tangent), and a dead reader of an intermediate would block its site
    # (attention weights a layer returns and its caller drops), in while
    # bodies too (JAX's own DCE keeps a while loop whole).
    original, closed = closed, compat.dce_closed_jaxpr(compat.dce_loop_bodies(closed))
    scopes = build_scopes(closed)  # stage 2: the use-def view
    where_is = _scope_names(scopes)

    matched = match(scopes, where_is)  # stage 3
    report.fallbacks += matched.fallbacks
    report.errors += matched.errors
    report.unrecognised += matched.unrecognised

    planned, unfit = choose_kernels(matched.sites, kernels, ctx, interpret, where_is)  # stage 4
    report.fallbacks += unfit
    if not planned:
        return original, _logged(report)

    # Stage 5: where each site runs (per shard, as a ring...); those that cannot are kept.
    placed = place(planned, {s.prefix: s for s in scopes}, kernels, ctx, zigzag)
    for p in placed:
        if p.placement.kept:
            _kept(report, p, where_is)
    placed = [p for p in placed if not p.placement.kept]
    if not placed:
        return original, _logged(report)

    try:
        rewritten, failures = rewrite(closed, Plan(placed, scopes))  # stage 6
    except Exception as err:  # a rewriter bug must never break the user's program
        if errors.strict():
            raise
        _internal(report, placed, where_is, "rewrite", errors.describe(err))
        return original, _logged(report)

    for p in placed:  # stage 7: the report
        scope_name = where_is[p.site.scope_prefix]
        failure = _failure_for(failures, p.site.scope_prefix)
        if failure is not None:
            report.errors.append(
                InternalError(
                    p.site.location,
                    "rewrite",
                    f"rewriting the enclosing body failed: {failure}",
                    scope_name,
                    p.site.pattern,
                    errors.HOW_TO_REPORT,
                )
            )
            continue
        report.rewrites.append(_rewrite_entry(p, scope_name))
    return rewritten, _logged(report)


def _kept(report: Report, p: Placed, where_is: dict) -> None:
    """Report a site stage 5 keeps: a fallback, or an internal error."""
    site, scope_name = p.site, where_is[p.site.scope_prefix]
    if p.placement.internal:
        error = InternalError(
            site.location, "plan", p.placement.reason, scope_name, site.pattern,
            errors.HOW_TO_REPORT,
        )  # fmt: skip
        report.errors.append(error)
    else:
        fallback = Fallback(
            site.location,
            p.placement.reason,
            scope_name,
            site.pattern,
            layer=layers.layer_of(site.root),
        )
        report.fallbacks.append(fallback)


def _internal(report: Report, planned, where_is: dict, stage: str, error: str) -> None:
    for p in planned:
        report.errors.append(
            InternalError(
                p.site.location,
                stage,
                error,
                where_is[p.site.scope_prefix],
                p.site.pattern,
                errors.HOW_TO_REPORT,
            )
        )


def distinguish_layers(report: Report) -> None:
    """Number the sites that share a layer (``examples/gpt.py:150 #1``, ``#2``...):
    one attention function called by every layer of a loop has one line and
    no name stack, and its rows must still be told apart."""
    for field in ("rewrites", "fallbacks"):
        entries = getattr(report, field)
        counts: dict = {}
        for e in entries:
            counts[e.layer] = counts.get(e.layer, 0) + 1
        seen: dict = {}
        for i, e in enumerate(entries):
            if e.layer and counts[e.layer] > 1:
                seen[e.layer] = seen.get(e.layer, 0) + 1
                entries[i] = dataclasses.replace(e, layer=f"{e.layer} #{seen[e.layer]}")


def _logged(report: Report) -> Report:
    """Warn about internal errors (always: they are bugs the user should see);
    tell apart the rows that share a layer (`distinguish_layers`)."""
    distinguish_layers(report)
    for e in report.errors:
        logger.warning(
            "internal error while %s attention at %s: %s; %s",
            {"match": "matching", "plan": "planning", "rewrite": "rewriting"}.get(e.stage, e.stage),
            e.location or "?",
            e.error,
            e.hint,
        )
    return report


def _rejection_summary(rejections: dict) -> str:
    """The fallback reason: the single kernel's first reason, or one per kernel."""
    if len(rejections) == 1:
        return next(iter(rejections.values()))[0]
    return "no kernel accepts this site: " + "; ".join(
        f"{name}: {reasons[0]}" for name, reasons in rejections.items()
    )


def _failure_for(failures: dict, prefix: tuple) -> str | None:
    for failed, error in failures.items():
        if prefix[: len(failed)] == failed:
            return error
    return None


def _rewrite_entry(placed: Placed, scope_name: str) -> Rewrite:
    p, placement = placed.planned, placed.placement
    spec = p.site.spec
    # Name each structured descriptor (e.g. "causal+window"), so a site the
    # kernel runs as an O(T) descriptor is told apart from a dense mask.
    # A Mask says what the kernel received ("key mask", "dense"...).
    kinds = []
    for kind in KINDS:
        for op in spec.ops_of(kind) if kind.word else ():
            word = op.report_word(spec)
            if word and word not in kinds:
                kinds.append(word)
    return Rewrite(
        pattern=p.site.pattern,
        kernel=placement.kernel(p),  # "ring" for a sequence-sharded site
        ring_steps=placement.ring_steps,
        location=p.site.location,
        q_shape=layers.shown_shape(p.site.q, p.site.layout),
        k_shape=p.site.k.shape,
        v_shape=p.site.v.shape,
        dtype=np.dtype(spec.q_dtype).name,
        causal=bool(spec.ops_of(Causal)),
        mask="+".join(kinds) or "none",
        bias=bool(spec.ops_of(Bias) or spec.ops_of(Alibi)),
        scale=spec.scale,
        scope=scope_name,
        spec=spec.describe(),
        rejected=dict(p.rejected),
        dense=tuple(p.site.dense) + tuple(p.notes),
        backward=p.site.backward is not None,
        layer=layers.layer_of(p.site.root),
        dropout=spec.dropout is not None,
        placement=placement.note,
    )


def _scope_names(scopes) -> dict:
    names = {(): "top level"}
    for scope in scopes:
        for child in scope.children:
            loc = child.node.location
            names[child.prefix] = f"{child.node.prim} body" + (f" at {loc}" if loc else "")
    return names


def log_report(report: Report, name: str) -> None:
    """One INFO line per site (once per input signature)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    for r in report.rewrites:
        logger.info(
            "%s: rewrote attention at %s with %s (%s)", name, r.location, r.kernel, r.pattern
        )
    for f in report.fallbacks:
        logger.info("%s: kept attention at %s as written: %s", name, f.location, f.reason)


#: Debug switch: ``FLASHPASS_DUMP=<folder>`` writes, for every pass run, the
#: traced program, the rewritten program and the report (text and JSON) to
#: ``<folder>/<function>-<n>/``; ``FLASHPASS_DUMP_FILTER=<substring>`` limits it
#: to functions whose qualified name contains the substring.
DUMP_ENV = "FLASHPASS_DUMP"
DUMP_FILTER_ENV = "FLASHPASS_DUMP_FILTER"
_DUMP_COUNTER = itertools.count()


def dump(name: str, closed, rewritten, report: Report) -> pathlib.Path | None:
    """Write each stage's program and the report when the debug switch is on."""
    folder = os.environ.get(DUMP_ENV)
    if not folder or os.environ.get(DUMP_FILTER_ENV, "") not in name:
        return None
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80] or "function"
    out = pathlib.Path(folder) / f"{safe}-{next(_DUMP_COUNTER)}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "1-traced.jaxpr.txt").write_text(str(closed) + "\n")
    (out / "2-rewritten.jaxpr.txt").write_text(str(rewritten) + "\n")
    (out / "report.txt").write_text(str(report) + "\n")
    (out / "report.json").write_text(report.to_json(indent=2) + "\n")
    logger.info("flashpass: wrote the stages of %s to %s", name, out)
    return out
