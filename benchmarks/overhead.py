"""Pass overhead on a 12-layer GPT-style model (examples/gpt.py).

Measures, side by side in one process, ``--rounds`` times with fresh functions
(so no trace or compile cache is reused):

* first call.  ``jax.jit`` of the original model: trace, lower, compile.
  flashpass: trace (the same work ``jax.jit`` does: one ``make_jaxpr`` of the
  model), then the pass itself (find sites, choose kernels, rewrite), then
  ``jax.jit``'s trace, lower and compile of the rewritten program.  The
  headline ratio is the pass (what flashpass adds: match + choose + rewrite)
  over ``jax.jit``'s trace + lower + compile of the original — target
  <= 10%.  Also printed: trace + pass over lower + compile (the trace is the
  one ``jax.jit`` would do anyway, so this double-counts it) and the whole
  first call against ``jax.jit``'s (which includes compiling the kernels,
  not just the pass).
* steady state (dispatch): a cached call of the optimized function is a call
  of its ``jax.jit``; it is timed against a ``jax.jit`` of the same rewritten
  program with the same pytree arguments, so the ratio is the wrapper's
  per-call cost alone, not a kernel's speed (``reference`` kernel) — target
  <= 1.25x on a model with ~200 parameter leaves (``--layers 12``).

Times are medians over rounds, as wall time and as process CPU time (all
threads); on a loaded machine the CPU-time ratios are the steadier ones.

    python benchmarks/overhead.py [--layers 12] [--seq 256] [--reps 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import flashpass  # noqa: E402
from examples import gpt  # noqa: E402
from flashpass import compat, pipeline  # noqa: E402


class _Clock:
    """Wall and process-CPU seconds of a block."""

    def __enter__(self):
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self._w
        self.cpu = time.process_time() - self._c


def _first_call_round(params, tokens, kernel):
    """One round of fresh first calls: seconds (wall, cpu) per stage."""
    leaves = jax.tree_util.tree_leaves((params, tokens))
    stages = {}

    def timed(name, thunk):
        with _Clock() as c:
            out = thunk()
        stages[name] = (c.wall, c.cpu)
        return out

    fn = lambda p, t: gpt.forward(p, t)  # noqa: E731 - fresh, so no trace cache is reused
    traced = timed("jit.trace", lambda: jax.jit(fn).trace(params, tokens))
    lowered = timed("jit.lower", traced.lower)
    timed("jit.compile", lowered.compile)

    fn = lambda p, t: gpt.forward(p, t)  # noqa: E731
    closed = timed("fp.trace", lambda: jax.make_jaxpr(fn)(params, tokens))
    rewritten, report = timed("fp.pass", lambda: pipeline.run_pass(closed, kernel=kernel))
    call = jax.jit(compat.jaxpr_as_fun(rewritten))
    traced = timed("fp.jit.trace", lambda: call.trace(*leaves))
    lowered = timed("fp.jit.lower", traced.lower)
    timed("fp.jit.compile", lowered.compile)
    return stages, report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kernel", default="blockwise", help="kernel for the first-call rounds")
    parser.add_argument("--reps", type=int, default=100, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    cfg = gpt.GPTConfig(
        d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, max_len=args.seq
    )
    params = gpt.init_params(jax.random.key(0), cfg)
    tokens = jnp.zeros((1, args.seq), jnp.int32)

    _first_call_round(params, tokens, args.kernel)  # warm JAX's own one-time caches
    rounds = []
    for _ in range(args.rounds):
        stages, report = _first_call_round(params, tokens, args.kernel)
        rounds.append(stages)
    assert len(report.rewrites) == args.layers, str(report)

    def med(name, clock):
        return statistics.median(r[name][clock] for r in rounds)

    def total(names, clock):
        return statistics.median(sum(r[n][clock] for n in names) for r in rounds)

    jit_all = ("jit.trace", "jit.lower", "jit.compile")
    fp_all = ("fp.trace", "fp.pass", "fp.jit.trace", "fp.jit.lower", "fp.jit.compile")
    result = {"jax": jax.__version__, "layers": args.layers, "seq": args.seq, "stages": {}}
    for clock, i in (("wall", 0), ("cpu", 1)):
        stages = {name: med(name, i) for name in rounds[0]}
        jit_total = total(jit_all, i)
        result["stages"][clock] = stages
        result[f"pass_over_jit_{clock}"] = statistics.median(
            r["fp.pass"][i] / sum(r[n][i] for n in jit_all) for r in rounds
        )
        result[f"trace_and_pass_over_lower_compile_{clock}"] = statistics.median(
            (r["fp.trace"][i] + r["fp.pass"][i]) / (r["jit.lower"][i] + r["jit.compile"][i])
            for r in rounds
        )
        result[f"first_call_ratio_{clock}"] = total(fp_all, i) / jit_total
        # Everything flashpass adds before lowering: its pass, plus its two
        # traces (the model, then the rewritten jaxpr) less jit's one.
        result[f"added_front_end_over_jit_{clock}"] = statistics.median(
            (r["fp.trace"][i] + r["fp.pass"][i] + r["fp.jit.trace"][i] - r["jit.trace"][i])
            / sum(r[n][i] for n in jit_all)
            for r in rounds
        )

    # -- steady state: dispatch.  A cached call of the optimized function is a
    # call of its jax.jit; it is timed against a jax.jit of the very same
    # rewritten program with the same pytree arguments ("direct"), so the ratio
    # is the wrapper's per-call cost alone, and against the jitted original
    # for context.  Call by call, interleaved, so drifting load hits all alike.
    # A small model with the same number of parameter leaves, so that the
    # calls are short and dispatch is what is measured.
    small = gpt.GPTConfig(d_model=32, n_heads=2, n_layers=args.layers, max_len=16)
    params = gpt.init_params(jax.random.key(0), small)
    tokens = jnp.zeros((1, 16), jnp.int32)
    leaves = jax.tree_util.tree_leaves((params, tokens))
    original = jax.jit(gpt.forward)
    same = flashpass.optimize(gpt.forward, kernel="reference")
    same(params, tokens)
    rewritten = same.rewritten_jaxpr(params, tokens)
    run = compat.jaxpr_as_fun(rewritten)
    direct = jax.jit(lambda p, t: run(*jax.tree_util.tree_leaves((p, t)))[0])
    fns = {"orig": original, "opt": same, "direct": direct}
    for fn in fns.values():
        fn(params, tokens).block_until_ready()
    times = {name: [] for name in fns}
    for _ in range(args.rounds * args.reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(params, tokens).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    assert same.traces == 1
    result["leaves"] = len(leaves)
    result["dispatch_model"] = "d_model 32, seq 16"
    result["original_call_s"] = statistics.median(times["orig"])
    result["cached_call_s"] = statistics.median(times["opt"])
    result["direct_call_s"] = statistics.median(times["direct"])
    result["dispatch_ratio"] = result["cached_call_s"] / result["direct_call_s"]
    result["call_overhead"] = result["dispatch_ratio"] - 1
    result["rewritten_vs_original"] = result["direct_call_s"] / result["original_call_s"]

    w, c = result["stages"]["wall"], result["stages"]["cpu"]
    print(
        f"GPT {args.layers} layers, seq {args.seq}, d_model {args.d_model}; JAX {jax.__version__};"
        f" median of {args.rounds} rounds (wall ms / cpu ms)"
    )
    for name in rounds[0]:
        print(f"  {name:16s} {w[name] * 1e3:8.1f} {c[name] * 1e3:8.1f}")
    print(
        f"  pass (match+choose+rewrite) / jit trace+lower+compile:"
        f" {result['pass_over_jit_wall']:.1%} wall, {result['pass_over_jit_cpu']:.1%} cpu"
        "  (target <= 10%)"
    )
    print(
        f"  added before lowering (pass + both traces - jit's trace) / jit trace+lower+compile:"
        f" {result['added_front_end_over_jit_wall']:.1%} wall,"
        f" {result['added_front_end_over_jit_cpu']:.1%} cpu"
    )
    print(
        f"  (trace + pass) / jit lower+compile:"
        f" {result['trace_and_pass_over_lower_compile_wall']:.1%} wall,"
        f" {result['trace_and_pass_over_lower_compile_cpu']:.1%} cpu"
    )
    print(
        f"  whole first call, optimized / jit:"
        f" {result['first_call_ratio_wall']:.2f}x wall, {result['first_call_ratio_cpu']:.2f}x cpu"
    )
    print(
        f"  call: jitted original {result['original_call_s'] * 1e3:.2f} ms;"
        f" rewritten program called directly {result['direct_call_s'] * 1e3:.2f} ms"
        f" ({result['rewritten_vs_original']:.2f}x: the reference kernel's layout changes)"
    )
    print(
        f"  cached optimized call {result['cached_call_s'] * 1e3:.2f} ms:"
        f" {result['dispatch_ratio']:.3f}x a jax.jit call of the same program"
        f" ({result['leaves']} argument leaves, d_model 32, seq 16; target <= 1.25x)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
