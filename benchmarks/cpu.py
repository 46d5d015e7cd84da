"""CPU attention benchmark: naive vs ``jax.nn.dot_product_attention`` vs flashpass.

For every sequence length S (T = S), causal and not, forward and
forward+backward, three variants run, each in a fresh subprocess:

* ``naive``: the original ``einsum -> where -> softmax -> einsum`` code;
* ``xla``: ``jax.nn.dot_product_attention(..., implementation="xla")``;
* ``flashpass``: ``flashpass.optimize`` applied to the naive code (the default
  kernel order, so below the CPU crossover it keeps the original computation;
  ``--kernel blockwise`` forces the rewrite).

Each subprocess compiles its one program, resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``; ``ru_maxrss`` is inherited across fork/exec on
Linux) and runs it once to measure its memory, then times it ``--reps`` times,
interleaved run by run with a large f32 matmul (so the achieved FLOP rate is
judged against the machine's matmul rate under the same load).  The parent
runs the variants of one configuration in turn, ``--rounds`` times
(interleaved), and reports medians.  Naive-style variants that would need more
than ``--mem-limit-gb`` are skipped (the table says so).

Useful FLOPs: 4*B*H*T*S*D for the forward (QK^T and PV), 3x that for
forward+backward (the backward's recomputation of QK^T is not counted), and
half of it under a causal mask.

    python benchmarks/cpu.py                         # S = 1k..16k, ~1 h on 2 cores
    python benchmarks/cpu.py --sizes 8192 --causal 1 --modes fwd
    python benchmarks/cpu.py --quick                 # smoke run, < 60 s
    python benchmarks/cpu.py --tile-ops              # cost of each op of one tile

``--tile-ops`` times, in one process and interleaved, each operation of one
forward tile of the blockwise kernel inside a ``fori_loop``, as the kernel runs
them, next to the large matmul: what bounds the FLOP rate.  Both default tiles
at S = 8192: the batched loops' (all B*H heads) and the head loop's (one head).

Prints a table; writes JSON (``benchmarks/results/``) and a PNG plot
(``docs/benchmarks-cpu.png``; skipped without matplotlib: ``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
VARIANTS = ("naive", "xla", "flashpass")
MODES = ("fwd", "fwd+bwd")
#: Bytes of f32 T x S arrays alive at the naive/xla peak, per score element
#: (measured: ~3 for the forward, ~5 with the backward); used to skip runs
#: that would not fit (--mem-limit-gb).
DENSE_ARRAYS = {"fwd": 3, "fwd+bwd": 5}


# --------------------------------------------------------------------------- programs


def naive(q, k, v, *, causal: bool):
    """The original code: ``[B, H, T, D]`` inputs, full ``T x S`` scores."""
    import jax
    import jax.numpy as jnp

    s = jnp.einsum("bhtd,bhsd->bhts", q, k) * (q.shape[-1] ** -0.5)
    if causal:
        t, n = s.shape[-2:]
        s = jnp.where(jnp.arange(n)[None, :] <= jnp.arange(t)[:, None], s, -1e9)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def xla_sdpa(q, k, v, *, causal: bool):
    """``jax.nn.dot_product_attention`` on its own ``[B, T, N, H]`` layout."""
    import jax

    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def useful_flops(b: int, h: int, n: int, d: int, causal: bool, mode: str) -> float:
    flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return flops * (3.0 if mode == "fwd+bwd" else 1.0)


def dense_bytes(b: int, h: int, n: int, mode: str) -> float:
    return DENSE_ARRAYS[mode] * 4.0 * b * h * n * n


# --------------------------------------------------------------------------- child


def child(args) -> dict:
    """One variant, one configuration: compile, measure memory once, time."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flashpass

    # The demo's /proc/self memory probes (the repository root is on sys.path).
    sys.path.insert(0, str(ROOT))
    from examples.demo import proc_status, reset_peak_rss

    b, h, n, d = args.batch, args.heads, args.size, args.dim
    causal, mode, variant = bool(args.child_causal), args.child_mode, args.child
    rng = np.random.default_rng(0)
    shape = (b, n, h, d) if variant == "xla" else (b, h, n, d)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    ct = jnp.asarray(rng.standard_normal(shape), jnp.float32)

    kernels = None
    if variant == "xla":
        fn = functools.partial(xla_sdpa, causal=causal)
    else:
        fn = functools.partial(naive, causal=causal)
        if variant == "flashpass":
            fn = opt = flashpass.optimize(fn, kernel=args.kernel)
    if mode == "fwd+bwd":
        f = fn
        fn = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * ct), argnums=(0, 1, 2))

    # The optimized function's first call is under this outer jax.jit, as users
    # call it: the pass runs while jit traces (its time counts as compile time).
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(q, k, v).compile()
    compile_s = time.perf_counter() - t0
    if variant == "flashpass":
        kernels = opt.reports[-1].kernels

    jax.block_until_ready((q, k, v, ct))
    before = proc_status("VmRSS") if reset_peak_rss() else None
    jax.block_until_ready(compiled(q, k, v))  # also the warm-up run
    peak = proc_status("VmHWM")
    peak_run = peak - before if before is not None and peak is not None else None

    # Timed runs, each after a matmul run: the rate the machine gives a large
    # f32 matmul at that moment, under the same load.
    m = args.mm_size
    a_mm = jnp.asarray(rng.standard_normal((m, m)), jnp.float32)
    b_mm = jnp.asarray(rng.standard_normal((m, m)), jnp.float32)
    mm = jax.jit(jnp.matmul).lower(a_mm, b_mm).compile()
    jax.block_until_ready(mm(a_mm, b_mm))
    times, mm_times = [], []
    load = os.getloadavg()[0]
    for _ in range(args.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(a_mm, b_mm))
        mm_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - t0)
    return {
        "variant": variant,
        "S": n,
        "causal": causal,
        "mode": mode,
        "status": "ok",
        "times_s": times,
        "matmul_gflops": [2.0 * m**3 / t / 1e9 for t in mm_times],
        "peak_run_bytes": peak_run,
        "peak_process_bytes": peak,
        "compile_s": compile_s,
        "kernels": kernels,
        "load_avg": [load, os.getloadavg()[0]],
    }


# --------------------------------------------------------------------------- tile ops


def tile_ops(args) -> None:
    """Per-op cost of one default forward tile, against the large matmul: the
    batched loops' tile (all heads) and the head loop's (one head)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from flashpass.kernels.blockwise import BlockwiseKernel
    from flashpass.spec import AttentionSpec

    b, h, d, n = args.batch, args.heads, args.dim, 40
    f32 = np.dtype("float32")
    spec = AttentionSpec(b, h, h, 8192, 8192, d, d, f32, f32, f32, f32, f32, f32)
    rng = np.random.default_rng(0)

    def arr(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    def looped(f, *xs):
        # Each iteration reads one of two copies of the inputs, so nothing is
        # hoisted out of the loop; the "slice" row is that read alone.
        stacks = [jnp.stack([x, x * 1.0001]) for x in xs]
        out = jax.eval_shape(f, *xs)

        def g(*stacks):
            def body(i, _):
                return f(*[lax.dynamic_index_in_dim(s, i % 2, keepdims=False) for s in stacks])

            return lax.fori_loop(0, n, body, jnp.zeros(out.shape, out.dtype))

        c = jax.jit(g).lower(*stacks).compile()
        jax.block_until_ready(c(*stacks))
        return lambda: jax.block_until_ready(c(*stacks))

    def tile(heads, bq, bk):
        q, k, s, v, m = (
            arr(heads, bq, d),
            arr(heads, bk, d),
            arr(heads, bq, bk),
            arr(heads, bk, d),
            arr(heads, bq),
        )
        return {
            "slice (input read only)": looped(lambda s: s, s),
            "q k^T": looped(lambda q, k: jnp.einsum("htd,hsd->hts", q, k), q, k),
            "p v": looped(lambda p, v: jnp.einsum("hts,hsd->htd", p, v), s, v),
            "row max": looped(lambda s: jnp.max(s, -1), s),
            "exp(s - m)": looped(lambda s, m: jnp.exp(s - m[..., None]), s, m),
            "row sum": looped(lambda s: jnp.sum(s, -1), s),
        }

    tiles = {
        "batched": (b * h, *BlockwiseKernel(head_loop=False).blocks(spec)),
        "head loop": (1, *BlockwiseKernel(head_loop=True).blocks(spec)),
    }
    ops = {name: tile(*shape) for name, shape in tiles.items()}
    mm_n = args.mm_size
    a = arr(mm_n, mm_n)
    mm = jax.jit(jnp.matmul).lower(a, a).compile()
    jax.block_until_ready(mm(a, a))
    times = {(t, name): [] for t, o in ops.items() for name in o}
    mm_times = []
    for _ in range(max(args.reps, 9)):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(a, a))
        mm_times.append(time.perf_counter() - t0)
        for t, o in ops.items():
            for name, run in o.items():
                t0 = time.perf_counter()
                run()
                times[t, name].append((time.perf_counter() - t0) / n)
    rate = 2.0 * mm_n**3 / statistics.median(mm_times) / 1e9
    print(
        f"one forward tile, D={d}, f32; f32 matmul {mm_n}^3: {rate:.0f} GFLOP/s; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for t, (heads, bq, bk) in tiles.items():
        scores = heads * bq * bk
        print(f"{t}: [{heads}, {bq}, {bk}] = {scores / 2**20:g}M scores (ms per 1M scores)")
        flops = 2.0 * scores * d
        for name in ops[t]:
            sec = statistics.median(times[t, name])
            rate_cell = ""
            if name in ("q k^T", "p v"):
                got = flops / sec / 1e9
                rate_cell = f"  {got:.0f} GFLOP/s ({got / rate:.0%} of matmul)"
            print(f"  {name:<24} {sec * 1e3 * 2**20 / scores:7.3f} ms{rate_cell}")


# --------------------------------------------------------------------------- parent


def child_argv(args, variant: str, n: int, causal: bool, mode: str) -> list[str]:
    argv = [sys.executable, str(pathlib.Path(__file__).resolve())]
    argv += ["--child", variant, "--size", str(n), "--child-causal", str(int(causal))]
    argv += ["--child-mode", mode, "--reps", str(args.reps), "--mm-size", str(args.mm_size)]
    argv += ["--batch", str(args.batch), "--heads", str(args.heads), "--dim", str(args.dim)]
    if args.kernel:
        argv += ["--kernel", args.kernel]
    return argv


def run_child(args, variant, n, causal, mode) -> dict:
    proc = subprocess.run(
        child_argv(args, variant, n, causal, mode), capture_output=True, text=True, cwd=ROOT
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "failed", "error": " | ".join(tail), "returncode": proc.returncode}
    return json.loads(lines[-1])


def merge(records: list[dict]) -> dict:
    """Rounds of one variant/configuration -> medians."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return records[0]
    times = [t for r in ok for t in r["times_s"]]
    mm = [g for r in ok for g in r["matmul_gflops"]]
    peaks = [r["peak_run_bytes"] for r in ok if r["peak_run_bytes"] is not None]
    procs = [r["peak_process_bytes"] for r in ok if r["peak_process_bytes"] is not None]
    return {
        "status": "ok",
        "time_s": statistics.median(times),
        "times_s": times,
        "matmul_gflops": statistics.median(mm),
        "peak_run_bytes": max(peaks) if peaks else None,
        "peak_process_bytes": max(procs) if procs else None,
        "compile_s": statistics.median(r["compile_s"] for r in ok),
        "kernels": ok[0]["kernels"],
        "load_avg": [x for r in ok for x in r["load_avg"]],
    }


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


def summarise(args, results: dict) -> list[dict]:
    rows = []
    for (n, causal, mode), per in results.items():
        row = {"S": n, "causal": causal, "mode": mode}
        flops = useful_flops(args.batch, args.heads, n, args.dim, causal, mode)
        fp, nv, xl = per.get("flashpass"), per.get("naive"), per.get("xla")
        for r in per.values():
            if r.get("status") == "ok":
                r["gflops"] = flops / r["time_s"] / 1e9
                r["matmul_fraction"] = r["gflops"] / r["matmul_gflops"]
        ok = lambda r: r is not None and r.get("status") == "ok"  # noqa: E731
        if ok(fp) and ok(nv):
            row["speedup_vs_naive"] = nv["time_s"] / fp["time_s"]
            if fp["peak_run_bytes"] and nv["peak_run_bytes"]:
                row["memory_vs_naive"] = fp["peak_run_bytes"] / nv["peak_run_bytes"]
        if ok(fp) and ok(xl):
            row["speedup_vs_xla"] = xl["time_s"] / fp["time_s"]
            if fp["peak_run_bytes"] and xl["peak_run_bytes"]:
                row["memory_vs_xla"] = fp["peak_run_bytes"] / xl["peak_run_bytes"]
        if ok(xl) and ok(nv):
            row["xla_speedup_vs_naive"] = nv["time_s"] / xl["time_s"]
        if ok(fp):
            row["flashpass_matmul_fraction"] = fp["matmul_fraction"]
            row["flashpass_kernels"] = fp["kernels"]
        rows.append(row)
    return rows


def fmt_mb(r) -> str:
    if r is None:
        return "-"
    if r.get("status") == "skipped":
        return "skip"
    if r.get("status") != "ok" or r.get("peak_run_bytes") is None:
        return "fail"
    return f"{r['peak_run_bytes'] / 2**20:.0f}"


def _cell(row: dict, key: str, f: str = "{:.2f}") -> str:
    return f.format(row[key]) if key in row else "-"


def print_table(args, results, rows) -> None:
    print()
    print(
        f"B={args.batch} H={args.heads} D={args.dim} f32, T=S; medians of "
        f"{args.rounds} round(s) x {args.reps} run(s); speedup = time(other) / time(flashpass)"
    )
    head = (
        f"{'S':>6} {'causal':>6} {'mode':<8} | {'vs naive':>8} {'vs xla':>7} {'xla/nv':>7} | "
        f"{'MB naive':>8} {'xla':>7} {'flash':>6} {'mem/nv':>7} | "
        f"{'GF/s':>6} {'matmul':>6} {'frac':>5}  kernel"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        per = results[(row["S"], row["causal"], row["mode"])]
        fp = per.get("flashpass") or {}
        r = functools.partial(_cell, row)
        gf = f"{fp['gflops']:.1f}" if "gflops" in fp else "-"
        mm = f"{fp['matmul_gflops']:.0f}" if "gflops" in fp else "-"
        frac = f"{fp['matmul_fraction']:.0%}" if "gflops" in fp else "-"
        kern = ",".join(fp.get("kernels") or []) or ("original" if "gflops" in fp else "-")
        mem = r("memory_vs_naive", "{:.3f}")
        print(
            f"{row['S']:>6} {'yes' if row['causal'] else 'no':>6} {row['mode']:<8} | "
            f"{r('speedup_vs_naive'):>8} {r('speedup_vs_xla'):>7} {r('xla_speedup_vs_naive'):>7} | "
            f"{fmt_mb(per.get('naive')):>8} {fmt_mb(per.get('xla')):>7} "
            f"{fmt_mb(per.get('flashpass')):>6} {mem:>7} | {gf:>6} {mm:>6} {frac:>5}  {kern}"
        )
    skipped = sorted(
        {
            (n, mode, name)
            for (n, _, mode), per in results.items()
            for name, r in per.items()
            if r.get("status") == "skipped"
        }
    )
    if skipped:
        print(
            "skip: not run, the dense T x S arrays would exceed "
            f"--mem-limit-gb={args.mem_limit_gb:g} GB: "
            + ", ".join(f"{name} {mode} S={n}" for n, mode, name in skipped)
        )
    failed = [
        (k, name, r.get("error"))
        for k, per in results.items()
        for name, r in per.items()
        if r.get("status") == "failed"
    ]
    for k, name, err in failed:
        print(f"fail: {name} {k}: {err}")


def plot(args, results, rows, path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]): no plot")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {("fwd", False): "o-", ("fwd", True): "o--", ("fwd+bwd", False): "s-"}
    styles[("fwd+bwd", True)] = "s--"
    for (mode, causal), style in styles.items():
        sel = [r for r in rows if r["mode"] == mode and r["causal"] == causal]
        label = f"{mode}{' causal' if causal else ''}"
        pts = [(r["S"], r["speedup_vs_naive"]) for r in sel if "speedup_vs_naive" in r]
        if pts:
            ax1.plot(*zip(*pts, strict=True), style, label=f"vs naive, {label}")
        pts = [(r["S"], r["speedup_vs_xla"]) for r in sel if "speedup_vs_xla" in r]
        if pts:
            ax1.plot(*zip(*pts, strict=True), style, alpha=0.45, label=f"vs xla, {label}")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("sequence length S (T = S)")
    ax1.set_ylabel("speedup of flashpass (time other / time flashpass)")
    ax1.set_title("Speedup")
    ax1.legend(fontsize=7)
    colors = {"naive": "tab:red", "xla": "tab:orange", "flashpass": "tab:blue"}
    for variant in VARIANTS:
        for mode, style in (("fwd", "o-"), ("fwd+bwd", "s--")):
            pts = []
            for (n, causal, m), per in sorted(results.items()):
                r = per.get(variant)
                if m == mode and causal and r and r.get("status") == "ok":
                    if r["peak_run_bytes"]:
                        pts.append((n, r["peak_run_bytes"] / 2**20))
            if pts:
                ax2.plot(
                    *zip(*pts, strict=True),
                    style,
                    color=colors[variant],
                    label=f"{variant} {mode} (causal)",
                )
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("sequence length S (T = S)")
    ax2.set_ylabel("peak memory of the run, MiB")
    ax2.set_title("Peak memory (RSS above inputs)")
    ax2.legend(fontsize=7)
    fig.suptitle(
        f"CPU, B={args.batch} H={args.heads} D={args.dim} f32 "
        f"({machine()['cpu']}, {os.cpu_count()} cores)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[0, 1])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per subprocess")
    ap.add_argument("--rounds", type=int, default=2, help="subprocesses per variant, interleaved")
    ap.add_argument("--mm-size", type=int, default=2048, help="the reference f32 matmul (N^3)")
    ap.add_argument("--mem-limit-gb", type=float, default=16.0)
    ap.add_argument("--kernel", default=None, help="flashpass kernel (default: platform order)")
    ap.add_argument("--json", type=pathlib.Path, default=None)
    ap.add_argument("--plot", type=pathlib.Path, default=ROOT / "docs" / "benchmarks-cpu.png")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke run: S=1024 causal, one rep")
    ap.add_argument("--tile-ops", action="store_true", help="time the ops of one kernel tile")
    # child mode (internal)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-causal", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-mode", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        print(json.dumps(child(args)), flush=True)
        return None
    if args.tile_ops:
        tile_ops(args)
        return None
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        if "--sizes" not in given:
            args.sizes = [1024]
        if "--causal" not in given:
            args.causal = [1]
        args.reps, args.rounds = 1, 1
        if "--mm-size" not in given:
            args.mm_size = 512
        if "--plot" not in given:
            args.no_plot = True

    import jax  # only the parent's metadata; children import their own

    started = datetime.datetime.now().astimezone()
    meta = {
        "date": started.isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "machine": machine(),
        "load_avg_start": list(os.getloadavg()),
        "args": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        "useful_flops": "4*B*H*T*S*D per forward, x3 with the backward, x0.5 causal",
    }
    print(
        f"JAX {jax.__version__} on {meta['machine']['cpu']} ({meta['machine']['cores']} cores); "
        f"load average {meta['load_avg_start'][0]:.2f}",
        flush=True,
    )
    results: dict = {}
    t_start = time.perf_counter()
    for n in args.sizes:
        for mode in args.modes:
            for causal in (bool(c) for c in args.causal):
                per: dict = {}
                runs: dict = {name: [] for name in args.variants}
                for name in args.variants:
                    need = dense_bytes(args.batch, args.heads, n, mode)
                    if name != "flashpass" and need > args.mem_limit_gb * 2**30:
                        per[name] = {"status": "skipped", "estimated_bytes": need}
                for _ in range(args.rounds):
                    for name in args.variants:
                        if name not in per:
                            runs[name].append(run_child(args, name, n, causal, mode))
                for name in args.variants:
                    if name not in per:
                        per[name] = merge(runs[name])
                results[(n, causal, mode)] = per
                done = ", ".join(
                    f"{k} {v['time_s'] * 1e3:.0f} ms"
                    if v.get("status") == "ok"
                    else f"{k} {v['status']}"
                    for k, v in per.items()
                )
                print(
                    f"  S={n} {mode}{' causal' if causal else ''}: {done} "
                    f"[{time.perf_counter() - t_start:.0f} s, load {os.getloadavg()[0]:.2f}]",
                    flush=True,
                )
    rows = summarise(args, results)
    meta["load_avg_end"] = list(os.getloadavg())
    meta["wall_s"] = time.perf_counter() - t_start
    mm = [r["matmul_gflops"] for per in results.values() for r in per.values() if "gflops" in r]
    meta["matmul_gflops_median"] = statistics.median(mm) if mm else None
    print_table(args, results, rows)
    if mm:
        print(
            f"f32 matmul {args.mm_size}^3, measured alongside every run: median "
            f"{meta['matmul_gflops_median']:.0f} GFLOP/s; load average "
            f"{meta['load_avg_start'][0]:.2f} -> {meta['load_avg_end'][0]:.2f}; "
            f"{meta['wall_s']:.0f} s"
        )
    out = {
        "meta": meta,
        "summary": rows,
        "results": [
            {"S": n, "causal": c, "mode": m, "variant": name, **r}
            for (n, c, m), per in results.items()
            for name, r in per.items()
        ],
    }
    path = args.json or ROOT / "benchmarks" / "results" / f"cpu-{started:%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    if not args.no_plot and plot(args, results, rows, args.plot):
        print(f"wrote {args.plot}")
    return out


if __name__ == "__main__":
    main()
