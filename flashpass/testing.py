"""Helpers for users' own test suites.

* `assert_rewrites(fn, *args, count=..., kernel=...)` — the sites you expect
  are rewritten, with ``kernel`` (chosen for a plain ``fn``); the report is in
  the failure message.
* `assert_golden(fn, *args, path=...)` — pin the rewritten jaxpr of your model
  in a checked-in file; when a JAX upgrade stops a rewrite, the diff and the
  report say so.  ``FLASHPASS_UPDATE_GOLDENS=1`` rewrites the files.
* `assert_same_function(fn, optimized, *args)` — the rewrite computes the
  original's output and gradients, within the dtype's tolerance.
* `stablehlo_shapes(fn, *args)` / `custom_call_targets(...)` — read the
  lowered StableHLO (e.g. to check no ``T x S`` tensor remains).
"""

from __future__ import annotations

import difflib
import os
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import compat
from .api import Optimized, optimize
from .methods import BoundMethod
from .printer import count_kernel_calls, format_jaxpr
from .report import Report

UPDATE_ENV = "FLASHPASS_UPDATE_GOLDENS"


class GoldenWritten(UserWarning):
    """`assert_golden` wrote a golden file (its message names the file)."""


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _optimized(fn, kwargs) -> Optimized:
    if isinstance(fn, Optimized | BoundMethod):  # already optimized (a method, too)
        return fn
    return optimize(fn, **kwargs)


def assert_rewrites(
    fn,
    *args,
    count: int | None = None,
    kernel: str | None = None,
    fallbacks: int | None = None,
    optimize_kwargs: dict | None = None,
    **kwargs,
) -> Report:
    """Assert that ``fn(*args, **kwargs)`` has ``count`` rewritten sites (at
    least one if ``count`` is None), and exactly ``fallbacks`` kept sites if given.

    ``fn`` is a plain function (then ``optimize(fn, kernel=kernel,
    **optimize_kwargs)`` is used: ``kernel`` *chooses* the kernel, as in
    ``optimize``, and every site must use it) or an optimized one (whose own
    ``kernel=`` chose; ``kernel`` here then checks that every site uses it).
    Returns the `Report`.
    """
    settings = dict(optimize_kwargs or {})
    if kernel is not None and not isinstance(fn, Optimized | BoundMethod):
        if settings.get("kernel", kernel) != kernel:
            raise TypeError(
                f"kernel={kernel!r} and optimize_kwargs['kernel']={settings['kernel']!r} differ"
            )
        settings["kernel"] = kernel
    opt = _optimized(fn, settings)
    report = opt.explain(*args, **kwargs)
    problems = []
    if count is not None and len(report.rewrites) != count:
        problems.append(f"expected {count} rewritten site(s), got {len(report.rewrites)}")
    if count is None and not report.rewrites:
        problems.append("expected at least one rewritten site, got none")
    if kernel is not None:
        others = [r.kernel for r in report.rewrites if r.kernel != kernel]
        if others:
            problems.append(f"expected every site to use {kernel!r}, got {others}")
    if fallbacks is not None and len(report.fallbacks) != fallbacks:
        problems.append(f"expected {fallbacks} fallback(s), got {len(report.fallbacks)}")
    calls = count_kernel_calls(opt.rewritten_jaxpr(*args, **kwargs))
    if sum(calls.values()) != len(report.rewrites):
        problems.append(
            f"the report lists {len(report.rewrites)} rewrites but the jaxpr has {calls}"
        )
    chosen = getattr(opt, "_kernel", None)
    if problems and opt is fn and kernel is not None and chosen != kernel:
        problems.append(
            f"fn was optimized with kernel={chosen!r}, so kernel={kernel!r} here only checks; "
            "pass the plain function to choose the kernel"
        )
    if problems:
        raise AssertionError("; ".join(problems) + "\n" + str(report))
    return report


def assert_same_function(fn, optimized, *args, argnums=None, rtol=None, atol=None) -> None:
    """Assert that ``optimized(*args)`` computes ``fn(*args)``: the same shape
    and dtype, values within ``rtol``/``atol`` (default: 2e-2 for bfloat16
    outputs, else 2e-5), and gradients of a random linear loss with respect
    to ``argnums`` (default: every floating-point argument) within five times
    that (the kernel's backward recomputes the weights)."""
    ref, out = fn(*args), optimized(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out, ref)
    default = 2e-2 if jnp.dtype(ref.dtype) == jnp.bfloat16 else 2e-5
    rtol, atol = rtol or default, atol or default
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=rtol, atol=atol
    )
    if argnums is None:
        argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(ref.shape), ref.dtype)

    def loss(f):
        return lambda *a: jnp.sum((f(*a) * ct).astype(jnp.float32))

    got = jax.grad(loss(optimized), argnums=argnums)(*args)
    want = jax.grad(loss(fn), argnums=argnums)(*args)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol * 5, atol=atol * 5
        )


def golden_text(fn, *args, **kwargs) -> str:
    """The golden file content for ``fn`` at these arguments (body only)."""
    opt = _optimized(fn, {})
    report = opt.explain(*args, **kwargs)
    header = [
        f"# rewrites: {len(report.rewrites)} "
        f"({', '.join(sorted(r.kernel for r in report.rewrites)) or 'none'})",
        f"# fallbacks: {len(report.fallbacks)}",
        *(f"# site: {r.kernel} {_ops_summary(r.spec)}" for r in report.rewrites),
    ]
    return "\n".join(header) + "\n" + format_jaxpr(opt.rewritten_jaxpr(*args, **kwargs))


def _ops_summary(spec: dict) -> str:
    def fmt(value):
        return f"{value:.6g}" if isinstance(value, float) else str(value)

    ops = [
        op["op"] + "(" + ",".join(f"{k}={fmt(v)}" for k, v in op.items() if k != "op") + ")"
        for op in spec.get("score_ops", [])
    ]
    extras = [f"{e['dtype']}{e['shape']}" for e in spec.get("extras", [])]
    return f"ops=[{' '.join(ops)}] extras=[{' '.join(extras)}]"


def assert_golden(fn, *args, path, update: bool | None = None, **kwargs) -> None:
    """Compare the rewritten jaxpr of ``fn(*args, **kwargs)`` with the file ``path``.

    The file starts with a ``# jax X.Y.Z`` stamp (not compared).  With
    ``update=True`` or ``FLASHPASS_UPDATE_GOLDENS=1`` the file is (re)written.
    A missing file is created on the first run (``update=None``), except under
    CI (``CI`` set in the environment, as CI services set it) or with
    ``update=False``, where it is an error saying how to create it.  Each
    write warns (`GoldenWritten`) and prints which file it wrote.
    A mismatch raises AssertionError with a unified diff and, when the number
    of rewritten sites changed, a note that an upgrade stopped a rewrite.
    """
    path = pathlib.Path(path)
    body = golden_text(fn, *args, **kwargs)
    env_update = os.environ.get(UPDATE_ENV, "") not in ("", "0")
    if update is None:
        update = env_update
        if not path.exists() and not _in_ci():
            update = True  # the first run writes the file (and says so)
    if update or not path.exists():
        if not update:
            why = "CI is set, so it is not created here" if _in_ci() else "update=False"
            raise AssertionError(
                f"golden file {path} does not exist ({why}); create it with "
                f"{UPDATE_ENV}=1 python -m pytest <your test> and commit it"
            )
        existed = path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# jax {jax.__version__}\n" + body)
        summary = body.split("\n", 1)[0].lstrip("# ")
        message = (
            f"flashpass: {'updated' if existed else 'created'} golden file {path} ({summary}); "
            "review and commit it"
        )
        print(message, file=sys.stderr)
        warnings.warn(message, GoldenWritten, stacklevel=2)
        return
    expected = path.read_text().split("\n", 1)[1] if path.read_text().startswith("#") else ""
    if expected == body:
        return
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            body.splitlines(keepends=True),
            fromfile=str(path),
            tofile="now",
        )
    )
    note = ""
    if expected.splitlines()[:1] != body.splitlines()[:1]:
        note = (
            "\nThe number of rewritten sites changed: a JAX upgrade (or a code change) "
            "stopped or added a rewrite.  See the report (flashpass.explain) for why."
        )
    raise AssertionError(
        f"rewritten jaxpr differs from {path} (regenerate with {UPDATE_ENV}=1):{note}\n{diff}"
    )


def stablehlo_ops(fn, *args, **kwargs):
    """``(op, result shapes, custom-call target)`` of ``jax.jit(fn)`` lowered here."""
    module = jax.jit(fn).lower(*args, **kwargs).compiler_ir("stablehlo")
    return compat.stablehlo_ops(module)


def stablehlo_shapes(fn, *args, **kwargs) -> set[tuple[int, ...]]:
    """Every tensor shape produced in the lowered StableHLO of ``fn``."""
    return {s for _, shapes, _ in stablehlo_ops(fn, *args, **kwargs) for s in shapes}


def custom_call_targets(fn, *args, platform: str | None = None, **kwargs) -> list[str]:
    """Custom-call targets in ``fn``'s StableHLO; ``platform="tpu"`` cross-lowers."""
    if platform == "tpu":
        module = compat.parse_stablehlo(compat.lower_for_tpu(fn, *args))
        ops = compat.stablehlo_ops(module)
    else:
        ops = stablehlo_ops(fn, *args, **kwargs)
    return [t for _, _, t in ops if t]
