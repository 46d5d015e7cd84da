"""Sweep one `ZooModel` in every mode and record what the pass did.

A record per (model, mode) holds the independent site count (the softmax-like
scan of the *original* program), the sites rewritten, kept (with reasons) and
not recognised, silent misses, forward and gradient numerics against the
original, dense ``T x S`` kernel operands, ``T x S`` arrays left in a
training step, errors (with the exception text) and the pass time.  Every
exception is caught and recorded: one model never stops a sweep.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import re
import signal
import time
import traceback

import jax
import jax.numpy as jnp

import flashpass
import flashpass.export

from . import checks, truth
from .model import Built, ZooModel

#: Every mode a model can be swept in (``export`` in `ZooModel.modes` means both routes).
MODES = ("direct", "jit", "train", "generate", "export_lift", "export_splice")

#: Relative tolerances (to each array's largest magnitude) in float32: the
#: model tests measure at most 3e-6 per layer; the zoo's sequences are longer
#: and its stacks deeper, so the bounds leave an order of magnitude.
FWD_TOL = 1e-4
GRAD_TOL = 1e-3

#: Seconds one mode may take before it is recorded as an error.
MODE_TIMEOUT = 300


class ModeTimeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    """Raise `ModeTimeout` in the main thread after ``seconds`` (no-op elsewhere)."""

    def fire(signum, frame):
        raise ModeTimeout(f"mode took longer than {seconds} s")

    try:
        old = signal.signal(signal.SIGALRM, fire)
    except ValueError:  # not the main thread
        yield
        return
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _error_text(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    text = re.sub(r"[^\s'\"]*site-packages/", "", text).replace(_ROOT, "")
    frames = traceback.extract_tb(err.__traceback__)
    where = f" [at {_display(frames[-1].filename)}:{frames[-1].lineno}]" if frames else ""
    return (text.splitlines()[0] if text else type(err).__name__)[:400] + where


_ROOT = str(pathlib.Path(__file__).resolve().parents[2]) + "/"


def _display(path: str) -> str:
    """A source path without this machine's prefix: package-relative for an
    installed library, repository-relative for ours."""
    path = path.replace("\\", "/")
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[-1]
    return path.removeprefix(_ROOT)


def _modes_of(model: ZooModel) -> list[str]:
    out = []
    for mode in model.modes:
        out += ["export_lift", "export_splice"] if mode == "export" else [mode]
    return [m for m in MODES if m in out]


def _seq(built: Built) -> tuple[int, int]:
    if built.seq is not None:
        return tuple(built.seq)
    first = jax.tree_util.tree_leaves(built.inputs)[0]
    n = int(first.shape[1]) if first.ndim >= 2 else int(first.shape[0])
    return n, n


def _report_fields(report) -> dict:
    """What a `Report` says: counts, kept reasons, dense masks, errors."""
    return {
        "rewritten": len(report.rewrites),
        "backward": sum(bool(r.backward) for r in report.rewrites),
        "kernels": sorted({r.kernel for r in report.rewrites}),
        "kept": [f.reason for f in report.fallbacks],
        "unrecognised": [u.reason for u in report.unrecognised],
        "internal_errors": [f"{e.stage}: {e.error}" for e in report.errors],
        "dense_reasons": sorted({d for r in report.rewrites for d in r.dense}),
    }


def _accounted(rec: dict) -> int:
    return (
        rec["rewritten"] + len(rec["kept"]) + len(rec["unrecognised"]) + len(rec["internal_errors"])
    )


def _silent(rec: dict, left: int | None = None) -> int:
    """Sites nobody accounts for: the independent count beyond the report's
    entries, or softmax-like exps left in the rewritten program beyond its
    kept/unrecognised/error entries, whichever is larger."""
    entries = len(rec["kept"]) + len(rec["unrecognised"]) + len(rec["internal_errors"])
    by_count = rec["sites"] - _accounted(rec)
    by_left = 0 if left is None else left - entries
    return max(0, by_count, by_left)


def _options(model: ZooModel) -> dict:
    # Never strict: an internal error of the pass is a recorded site, not a
    # raised exception, whatever FLASHPASS_STRICT says (the test suite sets it).
    return {"strict": False} | ({} if model.kernel is None else {"kernel": model.kernel})


def _optimize(model: ZooModel, fn):
    return flashpass.optimize(fn, **_options(model))


def _block(x):
    return jax.block_until_ready(x)


# --------------------------------------------------------------------------- modes


class _Reference:
    """The original forward's site count, trace time and output, computed once
    per model and shared by the modes that read them."""

    def __init__(self, built: Built):
        self.built = built
        self._done = False
        self._grad = None  # (gradient, error) of the original artifact

    def get(self):
        if not self._done:
            args = (self.built.params, *self.built.inputs)
            t0 = time.perf_counter()
            with _original_runs("the original forward"):
                original = jax.make_jaxpr(self.built.forward)(*args)
                self.trace_s = time.perf_counter() - t0
                self.want = _block(jax.jit(self.built.forward)(*args))
            self.original = original
            self._exact = None
            self.sites = checks.independent_sites(original)
            self._done = True
        return self.sites, self.trace_s, self.want

    def exact(self):
        """The original forward's float64 truth, computed once (on first need)."""
        if self._exact is None:
            args = (self.built.params, *self.built.inputs)
            self._exact = truth.evaluate_like(self.original, self.want, *args)
        return self._exact

    def artifact_gradient(self, exp):
        """The original artifact's gradient (`_artifact_gradient`), computed
        once and shared by both export routes (each exports the same
        function); raises what computing it raised."""
        if self._grad is None:
            try:
                self._grad = (_artifact_gradient(self.built, exp.call), None)
            except Exception as err:
                self._grad = (None, err)
        grad, err = self._grad
        if err is not None:
            raise err
        return grad


def _forward_mode(model, built, mode, rec, t, s, ref):
    args = (built.params, *built.inputs)
    rec["sites"], trace_s, want = ref.get()
    opt = _optimize(model, built.forward)
    t0 = time.perf_counter()
    if mode == "direct":
        report = opt.explain(*args)
        rec["pass_s"] = round(max(0.0, time.perf_counter() - t0 - trace_s), 3)
        got = _block(opt(*args))
    else:  # the first call is under jax.jit
        got = _block(jax.jit(opt)(*args))
        report = opt.reports[-1]
    rec.update(_report_fields(report))
    rewritten = opt.rewritten_jaxpr(*args)
    rec["silent"] = _silent(rec, len(checks.softmax_like_exps(rewritten)))
    rec["dense_operands"] = [list(x) for x in checks.dense_kernel_operands(rewritten, t, s)]
    rec["fwd_err"] = checks.tree_rel_error(got, want)
    _truth_errors(rec, ref.exact, got, want, train=False)


def _train_mode(model, built, rec, t, s):
    import optax

    tx = optax.sgd(1e-2)

    def step(params, opt_state, *inputs):
        loss, grads = jax.value_and_grad(built.loss)(params, *inputs)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, grads, optax.apply_updates(params, updates), opt_state

    args = (built.params, tx.init(built.params), *built.inputs)
    t0 = time.perf_counter()
    with _original_runs("the original training step"):
        original = jax.make_jaxpr(step)(*args)
        trace_s = time.perf_counter() - t0
        want = _block(jax.jit(step)(*args))
    rec["sites"] = checks.independent_sites(original)
    opt = _optimize(model, step)
    t0 = time.perf_counter()
    report = opt.explain(*args)
    rec["pass_s"] = round(max(0.0, time.perf_counter() - t0 - trace_s), 3)
    got = _block(jax.jit(opt)(*args))
    rec.update(_report_fields(report))
    rewritten = opt.rewritten_jaxpr(*args)
    rec["silent"] = _silent(rec, len(checks.softmax_like_exps(rewritten)))
    rec["dense_operands"] = [list(x) for x in checks.dense_kernel_operands(rewritten, t, s)]
    rec["t_by_s_left"] = [list(x) for x in checks.t_by_s_left(rewritten, t, s)]
    rec["t_by_s_original"] = len(checks.t_by_s_left(original, t, s))
    rec["fwd_err"] = checks.rel_error(got[0], want[0])
    rec["grad_err"] = checks.tree_rel_error(got[1], want[1])
    _truth_errors(rec, lambda: truth.evaluate_like(original, want, *args), got, want, train=True)


def _generate_mode(model, built, rec, t, s):
    args = (built.params, *(built.generate_inputs or built.inputs))
    with _original_runs("the original generation loop"):
        original = jax.make_jaxpr(built.generate)(*args)
        want = _block(jax.jit(built.generate)(*args))
    rec["sites"] = checks.independent_sites(original)
    opt = _optimize(model, built.generate)
    t0 = time.perf_counter()
    report = opt.explain(*args)
    rec["pass_s"] = round(time.perf_counter() - t0, 3)
    got = _block(opt(*args))
    rec.update(_report_fields(report))
    rewritten = opt.rewritten_jaxpr(*args)
    rec["silent"] = _silent(rec, len(checks.softmax_like_exps(rewritten)))
    rec["dense_operands"] = [list(x) for x in checks.dense_kernel_operands(rewritten, t, s)]
    # Greedy tokens: the share that differs (argmax ties may flip on rounding).
    a, b = jnp.asarray(got), jnp.asarray(want)
    rec["fwd_err"] = float("inf") if a.shape != b.shape else float(jnp.mean(a != b))


def _export_mode(model, built, route, rec, t, s, ref):
    args = (built.params, *built.inputs)
    rec["sites"], _, want = ref.get()
    try:
        exp = jax.export.export(jax.jit(built.forward))(*args)
    except Exception as err:  # JAX cannot serialize the model: no artifact to rewrite
        raise Unavailable(f"jax.export: {_error_text(err)}") from err
    t0 = time.perf_counter()
    try:
        new, report = flashpass.export.rewrite_and_explain(exp, route=route, **_options(model))
        rec["pass_s"] = round(time.perf_counter() - t0, 3)
        got = _block(new.call(*args))
    except Exception:
        # Where the original artifact cannot run either, there is no input
        # for the pass; otherwise the error is the pass's.
        with _original_runs("the original artifact"):
            _block(exp.call(*args))
        raise
    rec.update(_report_fields(report))
    if report.route == "kept":  # every site of the artifact is kept, for that reason
        # (one with no site and no report entry keeps nothing: it holds no attention)
        held = rec["sites"] or rec["kept"] or rec["unrecognised"] or rec["internal_errors"]
        rec["kept"] = [f"artifact kept unchanged: {report.kept_reason}"] * (
            max(1, rec["sites"]) if held else 0
        )
    rec["kept"] += [f"not spliced: {n}" for n in getattr(report, "splice_notes", ())]
    rec["islands"] = sorted({i.op for i in report.islands})
    rec["silent"] = _silent(rec)
    rec["dense_operands"] = [list(x) for x in checks.dense_module_operands(new.mlir_module(), t, s)]
    rec["fwd_err"] = checks.tree_rel_error(got, want)
    _export_gradient(rec, built, exp, new, ref)
    _truth_errors(rec, ref.exact, got, want, train=False)


def _export_gradient(rec, built, exp, new, ref) -> None:
    """``grad_err``: the rewritten artifact's gradient (of the mean square of
    its floating outputs, in its floating params) against the original
    artifact's.  Where the original has none (JAX cannot differentiate it),
    ``grad_note`` says so and nothing is compared; where only the rewritten
    one has none (an island without a derivative), the error is infinite."""
    try:
        want = ref.artifact_gradient(exp)
    except Exception as err:
        rec["grad_note"] = f"the original artifact has no gradient: {_error_text(err)}"
        return
    if new is exp:  # kept unchanged: the same program
        rec["grad_err"] = 0.0
        return
    try:
        got = _artifact_gradient(built, new.call)
    except Exception as err:
        rec["grad_note"] = f"the rewritten artifact has no gradient: {_error_text(err)}"
        rec["grad_err"] = float("inf")
        return
    rec["grad_err"] = checks.tree_rel_error(got, want)
    if rec["grad_err"] > GRAD_TOL and math.isfinite(rec["grad_err"]):
        # As in training: both against the float64 truth of the original
        # program's gradient (`_numerics_pass` judges).
        try:
            loss, values = _gradient_loss(built, built.forward)
            exact = truth.evaluate_like(jax.make_jaxpr(jax.grad(loss))(values), want, values)
        except Exception as err:  # unsupported primitive: keep the f32 verdict
            rec["truth_error"] = _error_text(err)
            return
        rec["grad_err_truth"] = checks.tree_rel_error(got, exact)
        rec["orig_grad_err_truth"] = checks.tree_rel_error(want, exact)


def _artifact_gradient(built, call):
    loss, values = _gradient_loss(built, call)
    return _block(jax.jit(jax.grad(loss))(values))


def _gradient_loss(built, call):
    """``(loss, values)``: the mean square of ``call``'s floating outputs as
    a function of the floating params, and those params."""
    leaves, tree = jax.tree_util.tree_flatten(built.params)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]

    def loss(values):
        full = list(leaves)
        for i, x in zip(floats, values, strict=True):
            full[i] = x
        out = call(jax.tree_util.tree_unflatten(tree, full), *built.inputs)
        outs = [x for x in jax.tree_util.tree_leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
        return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in outs)

    return loss, [leaves[i] for i in floats]


def _above(rec: dict) -> bool:
    return any(
        rec.get(f"{q}_err") is not None and not rec[f"{q}_err"] <= tol
        for q, tol in (("fwd", FWD_TOL), ("grad", GRAD_TOL))
    )


def _truth_errors(rec, exact_of, got, want, train: bool) -> None:
    """Where the numerics are off against the float32 original, both programs'
    errors against the original's float64 evaluation (`truth`): fields
    ``fwd_err_truth``/``orig_fwd_err_truth`` (and ``grad_`` in training), or
    ``truth_error`` saying why there is no truth.  The f32 original's own
    error can exceed flashpass's; the verdict then judges against the truth.
    ``exact_of()`` computes the truth (only called here, where needed)."""
    if not _above(rec):
        return
    try:
        exact = exact_of()
    except Exception as err:  # unsupported primitive, timeout: keep the old verdict
        rec["truth_error"] = _error_text(err)
        return
    if train:  # (loss, grads, new params, optimiser state)
        rec["fwd_err_truth"] = checks.rel_error(got[0], exact[0])
        rec["orig_fwd_err_truth"] = checks.rel_error(want[0], exact[0])
        rec["grad_err_truth"] = checks.tree_rel_error(got[1], exact[1])
        rec["orig_grad_err_truth"] = checks.tree_rel_error(want[1], exact[1])
    else:
        rec["fwd_err_truth"] = checks.tree_rel_error(got, exact)
        rec["orig_fwd_err_truth"] = checks.tree_rel_error(want, exact)


_WHAT = {"fwd": "forward", "grad": "gradient"}


def _numerics_pass(rec: dict, q: str, tol: float) -> str | None:
    """Why ``q`` (``fwd``/``grad``) passes although off against the f32
    original, or None where it fails.  It passes against the float64 truth
    when within ``tol`` of it, or no further from it than the f32 original
    (then the original's own float32 error is the larger one)."""
    err, mine, orig = rec[f"{q}_err"], rec.get(f"{q}_err_truth"), rec.get(f"orig_{q}_err_truth")
    if mine is None or not math.isfinite(mine):
        return None
    head = f"{_WHAT[q]}: {err:.1e} from the f32 original, but {mine:.1e} from the float64 truth"
    if mine <= tol:
        return f"{head} (within tolerance {tol:.0e}; the f32 original is {orig:.1e} off)"
    if orig is not None and mine <= orig:
        return f"{head}, whose f32 original is {orig:.1e} off (no worse than the original)"
    return None


def _verdict(rec: dict) -> None:
    """``ok``: no error, no silent miss, numerics within tolerance of the f32
    original or, where not, passing against the float64 truth
    (`_numerics_pass`; ``numerics_notes`` says which)."""
    bad, notes = [], []
    if rec["internal_errors"]:
        bad.append("internal error")
    if rec["silent"]:
        bad.append("silent miss")
    for q, tol in (("fwd", FWD_TOL), ("grad", GRAD_TOL)):
        if rec.get(f"{q}_err") is None or rec[f"{q}_err"] <= tol:
            continue
        why = _numerics_pass(rec, q, tol)
        if why is None:
            bad.append(f"{_WHAT[q]} numerics")
        else:
            notes.append(why)
    if notes:
        rec["numerics_notes"] = notes
    else:
        rec.pop("numerics_notes", None)
    rec["numerics_ok"] = "forward numerics" not in bad and "gradient numerics" not in bad
    rec["status"] = "ok" if not bad else "fail"
    rec["problems"] = bad


def account(rec: dict) -> dict:
    """``rec`` with its silent count and verdict redone from its measured
    values (an artifact kept unchanged keeps each of its sites)."""
    rec = dict(rec)
    if rec["status"] not in ("ok", "fail"):
        return rec
    whole = [k for k in rec["kept"] if k.startswith("artifact kept unchanged")]
    if whole and len(whole) < rec["sites"]:
        rec["kept"] = [k for k in rec["kept"] if k not in whole] + [whole[0]] * rec["sites"]
    if rec["mode"].startswith("export"):
        rec["silent"] = _silent(rec)
    _verdict(rec)
    return rec


def _empty(model: ZooModel, mode: str) -> dict:
    return {
        "suite": model.suite,
        "model": model.name,
        "family": model.family,
        "mode": mode,
        "kernel": model.kernel or "default",
        "status": "error",
        "sites": 0,
        "rewritten": 0,
        "backward": 0,
        "kernels": [],
        "kept": [],
        "unrecognised": [],
        "internal_errors": [],
        "dense_reasons": [],
        "dense_operands": [],
        "silent": 0,
        "fwd_err": None,
        "grad_err": None,
        "numerics_ok": None,
        "error": "",
        "pass_s": None,
        "sizes": "",
        "problems": [],
    }


class Unavailable(Exception):
    """A mode's input cannot be made (the artifact ``jax.export`` fails to
    serialize, or the original program itself fails to trace or run, before
    flashpass runs): the record is ``unavailable``, not an error of the pass."""


@contextlib.contextmanager
def _original_runs(what: str):
    """Any exception inside becomes `Unavailable`: ``what`` (the original
    program, before flashpass touches it) fails on its own, so the library,
    not the pass, cannot run this mode."""
    try:
        yield
    except (Unavailable, ModeTimeout):
        raise
    except Exception as err:
        raise Unavailable(f"{what} fails without flashpass: {_error_text(err)}") from err


def run_model(model: ZooModel, modes=None, timeout: int = MODE_TIMEOUT) -> list[dict]:
    """One record per mode of ``model`` (``modes`` narrows them)."""
    wanted = [m for m in _modes_of(model) if modes is None or m in modes]
    try:
        with _deadline(timeout):
            built = model.build()
    except Exception as err:  # the model could not be built: no mode runs
        records = []
        for mode in wanted:
            rec = _empty(model, mode)
            rec["status"] = "unavailable"
            rec["error"] = f"build: {_error_text(err)}"
            records.append(rec)
        return records
    t, s = _seq(built)
    ref = _Reference(built)
    records = []
    for mode in wanted:
        rec = _empty(model, mode)
        rec["sizes"] = f"T={t} S={s}" + (f"; {built.notes}" if built.notes else "")
        start = time.perf_counter()
        try:
            with _deadline(timeout):
                if mode == "generate" and built.generate is None:
                    rec["status"] = "skipped"
                    rec["error"] = "no generation with a KV cache in this library's model"
                elif mode == "train" and built.loss is None:
                    rec["status"] = "skipped"
                    rec["error"] = "no training loss"
                elif mode.startswith("export") and not built.export:
                    rec["status"] = "skipped"
                    rec["error"] = "not exportable with jax.export"
                elif mode in ("direct", "jit"):
                    _forward_mode(model, built, mode, rec, t, s, ref)
                elif mode == "train":
                    _train_mode(model, built, rec, t, s)
                elif mode == "generate":
                    _generate_mode(model, built, rec, t, s)
                else:
                    _export_mode(model, built, mode.removeprefix("export_"), rec, t, s, ref)
            if rec["status"] != "skipped":
                _verdict(rec)
        except Unavailable as err:
            rec["status"] = "unavailable"
            rec["error"] = str(err)
        except Exception as err:
            rec["status"] = "error"
            rec["error"] = _error_text(err)
        rec["wall_s"] = round(time.perf_counter() - start, 2)
        records.append(rec)
    jax.clear_caches()
    return records
