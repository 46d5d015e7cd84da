"""What counts as a regression against the expected results.

For each (model, mode) in both the expected file and the new run:

* fewer sites rewritten than expected;
* an error (an exception, an internal error in the report) where none was;
* a numerics mismatch (forward or gradient) where there was none;
* more silent misses than expected;
* more dense ``T x S`` kernel operands (a mask a descriptor read before, now
  handed to the kernel whole), or more ``T x S`` arrays left in a training
  step, than expected;
* a model that built before and no longer does.

Improvements (more rewritten, an error gone) are not failures; the sweep
refreshes the file to pin them.  Timings and error magnitudes are never
compared.
"""

from __future__ import annotations


def _errored(rec: dict) -> bool:
    return rec["status"] in ("error", "unavailable") or bool(rec["internal_errors"])


def regressions(expected: list[dict], actual: list[dict]) -> list[str]:
    """One line per regression of ``actual`` against ``expected``."""
    want = {(r["model"], r["mode"]): r for r in expected}
    out = []
    for rec in actual:
        k = (rec["model"], rec["mode"])
        old = want.get(k)
        name = f"{rec['model']} [{rec['mode']}]"
        if old is None:
            out.append(f"{name}: no expected record (refresh the expected file)")
            continue
        if _errored(rec) and not _errored(old):
            text = rec["error"] or "; ".join(rec["internal_errors"])
            out.append(f"{name}: new error: {text}")
            continue
        if rec["status"] == "skipped" or _errored(rec):
            continue
        if rec["rewritten"] < old["rewritten"]:
            kept = "; ".join(rec["kept"] + rec["unrecognised"]) or "no reason given"
            out.append(
                f"{name}: {old['rewritten']} site(s) rewritten before, "
                f"{rec['rewritten']} now ({kept})"
            )
        if rec["silent"] > old["silent"]:
            out.append(f"{name}: {rec['silent']} silent miss(es), {old['silent']} before")
        for field, what in (
            ("dense_operands", "dense T x S kernel operand(s)"),
            ("t_by_s_left", "T x S array(s) left in the step"),
        ):
            now, before = len(rec.get(field) or []), len(old.get(field) or [])
            if now > before:
                out.append(f"{name}: {now} {what}, {before} before: {rec.get(field)}")
        if rec["numerics_ok"] is False and old["numerics_ok"] is not False:
            out.append(
                f"{name}: numerics mismatch (forward {rec['fwd_err']}, gradient {rec['grad_err']})"
            )
    return out
