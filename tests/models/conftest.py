"""Model-integration tests: real library attention code, random small weights.

Each test builds a tiny model (1-2 layers, d_model 32, sequences of 16-24),
wraps its forward pass with ``flashpass.optimize(fn, kernel="blockwise")`` (the
kernel is forced: the default order skips short sequences) and calls the
``check_model`` fixture, which asserts that

* every attention site is rewritten (``len(report.rewrites) == sites``, no
  fallbacks) with the blockwise kernel,
* every report location points at the library's own source file,
* no softmax-like ``exp`` is left without a report entry (tests/no_silent.py),
* outputs and gradients with respect to the parameters (of a scalar loss of
  the forward pass) match the original function's.

Cases the matcher does not handle yet are marked
``xfail(strict=True, raises=AssertionError, reason=<the fallback reason>)``:
they start failing as soon as the matcher learns them, so the mark is removed
with the fix.  ``FLASHPASS_COVERAGE=docs/coverage.md`` writes the coverage
table (see coverage.py).  Nothing is downloaded: Hugging Face runs offline.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

# Before any test module imports keras or transformers.
os.environ["KERAS_BACKEND"] = "jax"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from no_silent import assert_no_silent_miss  # noqa: E402

import flashpass  # noqa: E402

from contexts import CONTEXTS, in_context  # noqa: E402

#: First-call contexts checked for every model (abstractly: traced, not run);
#: "direct" is the explain above, and the numerics run under jit(grad).
MODEL_CONTEXTS = tuple(c for c in CONTEXTS if c != "direct")


def _load_coverage():
    # By path, under a private name: a module called ``coverage`` on sys.path
    # must not stand in for coverage.py.
    path = pathlib.Path(__file__).with_name("coverage.py")
    spec = importlib.util.spec_from_file_location("_flashpass_model_coverage", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


coverage = _load_coverage()
TABLE = coverage.Table()

#: Default tolerances, relative to the largest magnitude of each compared array
#: (see `assert_close`).  Measured on CPU: errors of at most 3e-6 in float32,
#: single layers and two-layer stacks alike (the stacks use 5e-5, STACK_TOL in
#: their modules), and 2.2e-3 in bfloat16.
F32_TOL = 2e-5
BF16_TOL = 2e-2


@pytest.fixture
def check_model(request):
    """``check_model(fn, params, *inputs, library=, case=, sites=, where=, ...)``.

    ``fn(params, *inputs)`` returns one array.  ``where`` is a substring (or a
    tuple of them) every rewrite location must contain; ``scope`` one every
    rewrite scope must contain.  ``tol`` bounds outputs and gradients relative
    to each array's largest magnitude (see `assert_close`).  ``not_attention``
    lists reason substrings of the model's softmaxes that are not attention
    (e.g. an MoE router's): each must be kept, with that reason, and nothing
    else.  Returns the Report.
    """

    def check(*args, **kwargs):
        # Off CPU, full-precision f32 matmuls (no TF32 / bf16 passes) for the
        # trace (flashpass caches it) and the runs alike, so the two functions
        # differ only by the kernel's own rounding.  On CPU they already are,
        # and the traced program stays exactly the one users get.
        if jax.default_backend() == "cpu":
            return _check(*args, **kwargs)
        with jax.default_matmul_precision("highest"):
            return _check(*args, **kwargs)

    def _check(
        fn,
        params,
        *inputs,
        library: str,
        case: str,
        sites: int,
        where,
        scope: str | None = None,
        tol: float | None = None,
        not_attention: tuple[str, ...] = (),
    ):
        opt = flashpass.optimize(fn, kernel="blockwise")
        report = opt.explain(params, *inputs)
        _record(request, report, library, case, sites, not_attention)
        assert_no_silent_miss(opt, report, params, *inputs)
        kept = sorted(
            next((i for i, w in enumerate(not_attention) if w in f.reason), -1)
            for f in report.fallbacks
        )
        assert kept == list(range(len(not_attention))) and len(report.rewrites) == sites, (
            f"expected {sites} rewritten site(s) and no fallback but {not_attention}\n{report}"
        )
        wheres = (where,) if isinstance(where, str) else tuple(where)
        for r in report.rewrites:
            assert r.kernel == "blockwise", str(report)
            loc = (r.location or "").replace("\\", "/")
            assert any(w in loc for w in wheres), f"location {r.location!r} not in {wheres}"
            if scope is not None:
                assert scope in r.scope, f"scope {r.scope!r} lacks {scope!r}"

        # The first call in every context finds the same sites (traced only).
        for context in MODEL_CONTEXTS:
            fresh = flashpass.optimize(fn, kernel="blockwise")
            args = (params, *inputs)
            jax.eval_shape(
                lambda *a, c=context, f=fresh: in_context(
                    c, f, a, grad_argnums=0, batched=tuple(range(1, len(a)))
                ),
                *args,
            )
            got = fresh.reports[-1]
            ok = len(got.fallbacks) == len(not_attention) and not got.errors
            assert len(got.rewrites) == sites and ok, (
                f"first call under {context}: expected {sites} rewritten site(s)\n{got}"
            )

        out_ref, g_ref = _value_and_grad(fn, params, inputs)
        # A fresh optimized function whose first call is jax.jit(value_and_grad(...)).
        out_opt, g_opt = _value_and_grad(flashpass.optimize(fn, kernel="blockwise"), params, inputs)
        if tol is None:
            tol = BF16_TOL if out_ref.dtype == jnp.bfloat16 else F32_TOL
        assert out_opt.shape == out_ref.shape and out_opt.dtype == out_ref.dtype
        assert_close(out_opt, out_ref, tol, "output")
        assert_tree_close(g_opt, g_ref, tol, "grad")
        return report

    return check


def _record(request, report, library: str, case: str, sites: int, not_attention=()) -> None:
    """The coverage-table row of the running test (fallbacks the test expects
    because they are not attention, e.g. an MoE router, say so)."""
    TABLE.record(
        request.node.nodeid,
        library=library,
        case=case,
        rewritten=len(report.rewrites),
        expected=sites,
        fallbacks=[
            f"not attention, kept: {f.reason}"
            if any(w in f.reason for w in not_attention)
            else f.reason
            for f in report.fallbacks
        ],
    )


@pytest.fixture
def record_coverage(request):
    """``record_coverage(report, library=, case=, sites=, not_attention=())``: the
    coverage-table row of a test that checks its numerics itself (`check_model`
    records its own)."""

    def record(report, *, library: str, case: str, sites: int, not_attention=()) -> None:
        _record(request, report, library, case, sites, not_attention)

    return record


@pytest.fixture
def random_params():
    """``random_params(init, *args)``: the pytree ``init(*args)`` would return
    (found with ``jax.eval_shape``, nothing runs), filled with seeded random
    values: matrices ~ N(0, 1/fan_in) with fan_in = shape[0] (so scores are
    O(1) and softmaxes far from uniform), norm scales 1 + N(0, 0.1^2), other
    vectors N(0, 0.1^2).  Much faster than running library initialisers
    eagerly, op by op."""

    def make(init, *args, seed: int = 0):
        shapes = jax.eval_shape(init, *args)
        rng = np.random.default_rng(seed)

        def fill(path, leaf):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                return jnp.zeros(leaf.shape, leaf.dtype)
            x = rng.standard_normal(leaf.shape).astype(np.float32)
            name = str(getattr(path[-1], "key", getattr(path[-1], "name", ""))) if path else ""
            if len(leaf.shape) >= 2:
                x = x / np.sqrt(leaf.shape[0])
            elif name in ("scale", "weight", "gamma"):
                x = 1.0 + 0.1 * x
            else:
                x = 0.1 * x
            return jnp.asarray(x, leaf.dtype)

        return jax.tree_util.tree_map_with_path(fill, shapes)

    return make


def _value_and_grad(fn, params, inputs):
    """Output and d/dparams of ``sum(fn(params, *inputs) * ct)`` (a fixed random ct)."""
    shape = jax.eval_shape(fn, params, *inputs)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(shape.shape), jnp.float32)

    def loss(p, *xs):
        out = fn(p, *xs)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, *inputs)
    return out, grads


def assert_close(actual, expected, tol: float, name: str, floor: float = 0.0) -> None:
    """Elementwise ``|a - e| <= tol * (|e| + max(max|e|, floor))``."""
    a = np.asarray(actual, np.float32)
    e = np.asarray(expected, np.float32)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a) == np.isfinite(e)), f"{name}: non-finite values differ"
    scale = max(float(np.max(np.abs(e), initial=0.0)), floor)
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol * scale, err_msg=name)


def assert_tree_close(actual, expected, tol: float, name: str) -> None:
    """`assert_close` per leaf.  A leaf whose exact gradient is zero (a key bias:
    softmax ignores per-row constants) holds only rounding noise, so each leaf's
    scale is at least a tenth of the largest gradient in the tree."""
    a_leaves = jax.tree_util.tree_leaves_with_path(actual)
    e_leaves = jax.tree_util.tree_leaves(expected)
    assert len(a_leaves) == len(e_leaves), f"{name}: trees differ"
    top = max((float(np.max(np.abs(np.asarray(e, np.float32)))) for e in e_leaves), default=0.0)
    for (path, a), e in zip(a_leaves, e_leaves, strict=True):
        assert_close(a, e, tol, f"{name}{jax.tree_util.keystr(path)}", floor=0.1 * top)


# --------------------------------------------------------------------------- coverage table


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" or (report.when == "setup" and report.skipped):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
        note = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            note = str(report.longrepr[2]).removeprefix("Skipped: ")
        TABLE.outcome(item.nodeid, outcome, note)
    return report


def pytest_collectreport(report):
    # A module skipped as a whole (its library is not installed) gets one row.
    if report.skipped and "models/test_" in report.nodeid:
        note = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
        TABLE.outcome(report.nodeid, "skipped", note.removeprefix("Skipped: "))


def pytest_sessionfinish(session, exitstatus):
    path = coverage.target_path()
    if path is None or not TABLE.rows:
        return
    versions = {"jax": jax.__version__}
    for name in (
        "flax", "equinox", "haiku", "keras", "keras_hub", "transformers", "penzai",
        "torch", "torchax", "diffusers",
    ):  # fmt: skip
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            versions[name] = module.__version__
    written = TABLE.write(path, versions)
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"flashpass coverage table written to {written}")
