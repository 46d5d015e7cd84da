"""flashpass on a GPT: what it rewrites, whether the numbers agree, and what it buys.

Builds a small but real decoder-only transformer (`examples/gpt.py`, random
weights), runs ``flashpass.optimize`` on its forward pass and its loss, and
prints:

  1. the rewrite report (one attention site per layer), and the ``lax.scan``
     variant's report (the site inside the scan body);
  2. numerics: optimized vs original logits and loss gradients (PASS/FAIL);
  3. speed: jitted original vs optimized, forward and forward+backward;
  4. memory: XLA's temporary buffer size of each compiled program and, unless
     ``--no-rss``, the peak RSS of each variant run alone in a subprocess.

    python examples/demo.py                  # T=2048, 4 layers (~2 min on 2 CPU cores)
    python examples/demo.py --seq 1024 --layers 2
    python examples/demo.py --quick          # tiny smoke test (~10 s)
    python -m examples.demo --kernel reference

The exit status is 1 when the numerics check fails.  On CPU the default
kernel (``blockwise``) declines sequences shorter than its cut-off (1024), so
``--quick`` keeps the original attention unless ``--kernel blockwise`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python examples/demo.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import flashpass  # noqa: E402
from examples import gpt  # noqa: E402

#: Relative tolerances (max |opt - ref| / max |ref|) for float32.
LOGITS_RTOL = 1e-4
GRAD_RTOL = 1e-4

VARIANTS = ("forward/original", "forward/flashpass", "fwd+bwd/original", "fwd+bwd/flashpass")


# --------------------------------------------------------------------------- setup


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 2048)")
    ap.add_argument("--layers", type=int, default=None, help="transformer layers (default 4)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default 1)")
    ap.add_argument("--d-model", type=int, default=None, help="model width (default 256)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 1024)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per variant (default 3)")
    ap.add_argument(
        "--kernel", default=None, help="kernel name for flashpass.optimize (default: platform's)"
    )
    ap.add_argument(
        "--quick", action="store_true", help="tiny sizes for a CI smoke test (implies --no-rss)"
    )
    ap.add_argument(
        "--no-rss", dest="rss", action="store_false", help="skip the per-variant RSS subprocesses"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        defaults = dict(seq=128, layers=2, batch=2, d_model=64, heads=4, vocab=128, reps=2)
        args.rss = False
    else:
        defaults = dict(seq=2048, layers=4, batch=1, d_model=256, heads=4, vocab=1024, reps=3)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def make_config(args) -> gpt.GPTConfig:
    return gpt.GPTConfig(
        vocab=args.vocab,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        max_len=args.seq,
        dtype=jnp.float32,
    )


def make_inputs(args):
    """``(cfg, params, tokens [B, T], train_tokens [B, T + 1])``, deterministic in the seed."""
    cfg = make_config(args)
    k_params, k_tokens = jax.random.split(jax.random.PRNGKey(args.seed))
    params = jax.jit(gpt.init_params, static_argnums=1)(k_params, cfg)  # one compile
    train = jax.random.randint(k_tokens, (args.batch, args.seq + 1), 0, cfg.vocab)
    return cfg, params, train[:, :-1], train


def programs(args, params, tokens, train, opt_forward=None, opt_loss=None) -> dict:
    """variant -> (function, arguments).

    The flashpass variants use ``opt_forward`` / ``opt_loss`` (`Optimized`
    wrappers of `gpt.forward` and of ``jax.value_and_grad(gpt.loss_fn)``, the
    whole differentiated step: attention is rewritten forward and backward),
    made here when not given.
    """
    if opt_forward is None:
        opt_forward = flashpass.optimize(gpt.forward, kernel=args.kernel)
    if opt_loss is None:
        opt_loss = flashpass.optimize(jax.value_and_grad(gpt.loss_fn), kernel=args.kernel)
    return {
        "forward/original": (gpt.forward, (params, tokens)),
        "forward/flashpass": (opt_forward, (params, tokens)),
        "fwd+bwd/original": (jax.value_and_grad(gpt.loss_fn), (params, train)),
        "fwd+bwd/flashpass": (opt_loss, (params, train)),
    }


# --------------------------------------------------------------------------- measuring


def rel_err(got, want) -> tuple[float, float]:
    """``(max |got - want|, max |got - want| / max |want|)`` in float64."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    abs_err = float(np.max(np.abs(got - want))) if got.size else 0.0
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return abs_err, abs_err / scale if scale else abs_err


@dataclasses.dataclass
class Check:
    name: str
    abs_err: float
    rel_err: float
    rtol: float
    worst: str = ""  # for pytrees: the leaf with the largest relative error

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.rel_err)) and self.rel_err <= self.rtol


def check_tree(name, got, want, rtol) -> Check:
    """`rel_err` over all leaves of a pytree taken as one vector.

    Per-leaf relative errors would be meaningless for leaves whose exact
    gradient is zero (e.g. the key bias: softmax ignores a per-row constant,
    so its gradient is pure rounding noise); the leaf with the largest
    absolute error is named instead.
    """
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree_util.tree_leaves(want)
    abs_err, scale, worst = 0.0, 0.0, ""
    for (path, g), w in zip(got_leaves, want_leaves, strict=True):
        a, _ = rel_err(g, w)
        scale = max(scale, float(np.max(np.abs(np.asarray(w)))) if np.size(w) else 0.0)
        if not np.isfinite(a) or a > abs_err or not worst:
            abs_err, worst = a, jax.tree_util.keystr(path)
    return Check(name, abs_err, abs_err / scale if scale else abs_err, rtol, worst)


def time_interleaved(compiled: dict, inputs: dict, reps: int, warmup=True) -> dict[str, float]:
    """Median seconds per variant; variants alternate run by run so load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for name, fn in compiled.items() if warmup else ():
        jax.block_until_ready(fn(*inputs[name]))
    for _ in range(reps):
        for name, fn in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*inputs[name]))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def proc_status(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status, in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    Linux: ``VmHWM``, the high-water mark of this program's own address space.
    Not ``ru_maxrss``: Linux carries it over ``execve`` from the parent's
    memory (Python spawns with vfork), so every child would report the demo
    process's peak.
    """
    hwm = proc_status("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB elsewhere


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def child_argv(args, variant: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve())]
    for name in ("seq", "layers", "batch", "d_model", "heads", "vocab", "seed"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.kernel:
        argv += ["--kernel", args.kernel]
    return argv + ["--rss-child", variant]


def rss_child(args) -> int:
    """Subprocess body: compile one variant, run it once, print its memory as JSON.

    ``run`` is the peak RSS while executing above the RSS just before (the
    peak is reset after compiling); where the peak cannot be reset it is the
    whole process's peak, compilation included, and ``mode`` says so.
    """
    _, params, tokens, train = make_inputs(args)
    fn, fn_args = programs(args, params, tokens, train)[args.rss_child]
    compiled = jax.jit(fn).lower(*fn_args).compile()
    jax.block_until_ready((params, tokens, train))
    if reset_peak_rss() and (before := proc_status("VmRSS")) is not None:
        mode = "run"
    else:
        before, mode = 0, "process"
    jax.block_until_ready(compiled(*fn_args))
    peak = peak_rss_bytes()
    record = {"variant": args.rss_child, "mode": mode, "before": before, "run": peak - before}
    print(json.dumps({**record, "peak": peak}))
    return 0


def measure_rss(args) -> dict[str, dict]:
    """Run `rss_child` for every variant, one fresh process each."""
    out = {}
    for variant in VARIANTS:
        proc = subprocess.run(child_argv(args, variant), capture_output=True, text=True)
        try:
            out[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            out[variant] = {"error": tail}
    return out


# --------------------------------------------------------------------------- the demo


@dataclasses.dataclass
class Result:
    report: flashpass.Report  # forward
    loss_report: flashpass.Report  # value_and_grad(loss_fn): forward and backward
    scan_report: flashpass.Report  # forward_scan
    checks: list[Check]
    times: dict[str, float]
    temp_bytes: dict[str, int | None]
    rss: dict[str, dict]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


def run(args, log: Callable[[str], None] = print) -> Result:
    """The whole demo; ``log`` receives every line printed."""
    start = time.perf_counter()
    cfg, params, tokens, train = make_inputs(args)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    log(
        f"GPT: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
        f"(head dim {cfg.head_dim}), vocab {cfg.vocab}, {n_params / 1e6:.2f}M params, "
        f"{np.dtype(cfg.dtype).name}; batch {args.batch}, seq {args.seq}"
    )
    kernel = args.kernel or "the platform's default order (--kernel to name one)"
    log(f"JAX {jax.__version__} on {jax.default_backend()}, kernel: {kernel}")

    opt_forward = flashpass.optimize(gpt.forward, kernel=args.kernel)
    opt_loss = flashpass.optimize(jax.value_and_grad(gpt.loss_fn), kernel=args.kernel)
    progs = programs(args, params, tokens, train, opt_forward, opt_loss)

    # 1. what flashpass does ------------------------------------------------
    # The first calls are made the way users make them: under an outer jax.jit
    # (the forward, and the gradient of the loss).  The pass runs while jit
    # traces; explain() then reads the same report back without re-running it.
    log("\n== 1. rewrite report: forward(params, tokens) ==")
    t0 = time.perf_counter()
    jax.jit(opt_forward).trace(params, tokens)
    t1 = time.perf_counter()
    jax.jit(opt_loss).trace(params, train)
    t2 = time.perf_counter()
    report = opt_forward.explain(params, tokens)
    loss_report = opt_loss.explain(params, train)
    assert opt_forward.traces == 1 and opt_loss.traces == 1, "explain re-ran the pass"
    log(str(report))
    if not report.rewrites:
        log(
            "(no site rewritten: every attention runs as written, so the rest compares "
            "a program with itself)"
        )

    log(f"(first call under jax.jit: traced, matched and rewritten in {t1 - t0:.1f} s)")
    log(
        f"\nvalue_and_grad(loss_fn), optimized as a whole (fwd+bwd): "
        f"{len(loss_report.rewrites)} rewritten "
        f"({sum(r.backward for r in loss_report.rewrites)} forward+backward), "
        f"{len(loss_report.fallbacks)} kept as written ({t2 - t1:.1f} s)"
    )
    for f in loss_report.fallbacks:
        log(f"  kept as written at {f.location or '?'}: {f.reason}")

    scan_params = gpt.stack_blocks(params)
    scan_opt = flashpass.optimize(gpt.forward_scan, kernel=args.kernel)
    jax.jit(scan_opt).trace(scan_params, tokens)  # first call under jit, as users make it
    scan_report = scan_opt.reports[-1]
    log("\n== forward_scan (layers under lax.scan) ==")
    for r in scan_report.rewrites:
        log(f"  rewritten with {r.kernel} in {_where(r.scope)}")
    for f in scan_report.fallbacks:
        log(f"  kept as written in {_where(f.scope)}: {f.reason}")

    # 2. compile everything once: used for numerics, timing and memory -----
    compiled, temp, compile_s = {}, {}, {}
    for name, (fn, fn_args) in progs.items():
        t0 = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(*fn_args).compile()
        compile_s[name] = time.perf_counter() - t0  # flashpass: trace + rewrite + XLA
        temp[name] = _temp_bytes(compiled[name])
    inputs = {name: fn_args for name, (_, fn_args) in progs.items()}

    log("\n== 2. numerics (float32; error relative to max |original|) ==")
    logits_ref = compiled["forward/original"](*inputs["forward/original"])
    logits_opt = compiled["forward/flashpass"](*inputs["forward/flashpass"])
    loss_ref, grads_ref = compiled["fwd+bwd/original"](*inputs["fwd+bwd/original"])
    loss_opt, grads_opt = compiled["fwd+bwd/flashpass"](*inputs["fwd+bwd/flashpass"])
    checks = [
        Check("logits", *rel_err(logits_opt, logits_ref), LOGITS_RTOL),
        Check("loss", *rel_err(loss_opt, loss_ref), LOGITS_RTOL),
        check_tree("grads", grads_opt, grads_ref, GRAD_RTOL),
    ]
    if scan_report.rewrites:
        scan_ref = jax.jit(gpt.forward_scan)(scan_params, tokens)
        scan_out = jax.jit(scan_opt)(scan_params, tokens)
        checks.append(Check("scan logits", *rel_err(scan_out, scan_ref), LOGITS_RTOL))
    for c in checks:
        worst = f"  (largest at {c.worst})" if c.worst else ""
        log(
            f"  {c.name:<12} max abs {c.abs_err:.2e}  rel {c.rel_err:.2e}  (tol {c.rtol:.0e})  "
            f"{'PASS' if c.passed else 'FAIL'}{worst}"
        )
    log(f"  loss: original {float(loss_ref):.6f}, flashpass {float(loss_opt):.6f}")

    # 3./4. speed and memory -------------------------------------------------
    log(f"\n== 3. speed and memory (jitted; median of {args.reps} interleaved runs) ==")
    times = time_interleaved(compiled, inputs, args.reps, warmup=False)  # step 2 warmed up
    rss = measure_rss(args) if args.rss else {}
    same = {
        "forward": not report.rewrites,
        "fwd+bwd": not loss_report.rewrites,
    }  # nothing rewritten: the two programs are one, and a ratio would be noise
    for line in _table(times, temp, rss, compile_s, same):
        log(line)
    if any(same.values()):
        log(
            "  same: no site was rewritten there, so flashpass's program is the original's; "
            "its timings differ from the original's by noise only"
        )
    log(
        "  time/temp ratios: flashpass / original (< 1 is better); temp: XLA temp buffers "
        "of the compiled program (memory_analysis().temp_size_in_bytes); compile: "
        "jit lower + XLA compile (the flashpass pass itself ran, and is cached, in step 1)"
    )
    if rss:
        if all(r.get("mode") == "run" for r in rss.values()):
            before = max(r["before"] for r in rss.values())
            log(
                "  run RSS: peak resident memory while executing, above the resident memory "
                f"just before (<= {_mib(before)}), in a fresh process per variant"
            )
        else:
            log("  run RSS: peak RSS of a fresh process per variant, compilation included")

    seconds = time.perf_counter() - start
    passed = all(c.passed for c in checks)
    log(f"\nnumerics: {'PASS' if passed else 'FAIL'}    total time {seconds:.1f} s")
    return Result(report, loss_report, scan_report, checks, times, temp, rss, seconds)


def _where(scope: str) -> str:
    return scope.replace(str(Path(__file__).resolve().parent.parent) + os.sep, "")


def _temp_bytes(compiled) -> int | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        return None
    return getattr(stats, "temp_size_in_bytes", None) if stats is not None else None


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def _ratio(a, b) -> str:
    return "n/a" if a is None or b is None or not b else f"{a / b:.2f}x"


def _table(times, temp, rss, compile_s, same=None) -> list[str]:
    """The speed and memory rows; ``same[prefix]``: that pair is one program
    (no site rewritten), so its ratios read ``same`` rather than noise."""
    same = same or {}
    header = ["variant", "time", "ratio", "temp mem", "ratio"]
    if rss:
        header += ["run RSS", "ratio"]
    header += ["compile"]
    rows = [header]
    for name in VARIANTS:
        base = name.split("/")[0] + "/original"
        one_program = same.get(name.split("/")[0], False) and name != base

        def ratio(a, b, one_program=one_program):
            return "same" if one_program else _ratio(a, b)

        row = [
            name,
            _ms(times[name]),
            ratio(times[name], times[base]),
            _mib(temp[name]),
            ratio(temp[name], temp[base]),
        ]
        if rss:
            used = rss[name].get("run")
            row += [
                _mib(used) if used is not None else "error: " + rss[name].get("error", "?")[:40],
                ratio(used, rss[base].get("run")),
            ]
        row += [f"{compile_s[name]:.1f} s"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for j, row in enumerate(rows):
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells))
        if j == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rss_child:
        return rss_child(args)
    result = run(args)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
