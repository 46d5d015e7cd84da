"""Decode steps against a KV cache: the original vs `flashpass.optimize`, under jit.

One (or a few) new queries attend to a KV cache of S keys, B=4, H=8, D=64,
f32, each row masked to its valid length (``jnp.arange(S) < lengths[:, None]``,
the spelling the pass reads as `KvLengths`).  Rows are *full* (every length
S) or *ragged* (lengths spread evenly from S/16 to S/2).  Both functions are
jitted (``jax.jit(fn)`` and ``jax.jit(flashpass.optimize(fn))``), compiled
first, then timed interleaved, run by run, in one process (machine noise hits
both alike).  Printed: what the pass did to the site, the median time of each
and the ratio original / optimized (> 1: the optimized step is faster).  The
thresholds in ``kernels/blockwise/cost.py`` come from this table.

    python benchmarks/decode.py                       # S = 2k..32k, q=1 and 4
    python benchmarks/decode.py --sizes 2048 32768 --queries 1 --reps 21
    python benchmarks/decode.py --plain               # the site without kv lengths
    python benchmarks/decode.py --kernel blockwise    # force the kernel (the crossover)
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashpass


def step(plain: bool):
    """The decode step as a model writes it (GPT-fast / MaxText style)."""

    def attend(q, k, v, lengths):
        d = q.shape[-1]
        s = jnp.einsum("bhtd,bhsd->bhts", q, k) / np.float32(np.sqrt(d))
        if not plain:
            valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
            s = jnp.where(valid[:, None, None, :], s, -1e9)
        return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)

    return attend


def lengths_for(batch: int, s: int, ragged: bool) -> np.ndarray:
    if not ragged:
        return np.full((batch,), s, np.int32)
    return np.linspace(s // 16, s // 2, batch).astype(np.int32)


def interleaved(fns, args, reps: int) -> list[tuple[float, float]]:
    """(median, minimum) seconds per function, timed alternately run by run
    (on a shared machine the median moves with the load; the minimum shows
    the cost when nothing else interferes)."""
    for fn in fns:
        jax.block_until_ready(fn(*args))  # compile
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - t0)
    return [(statistics.median(t), min(t)) for t in times]


def run(sizes, queries, reps, plain, kernel, batch=4, heads=8, dim=64):
    rng = np.random.default_rng(0)
    rows = []
    for s in sizes:
        k = jnp.asarray(rng.standard_normal((batch, heads, s, dim), np.float32))
        v = jnp.asarray(rng.standard_normal((batch, heads, s, dim), np.float32))
        for t in queries:
            q = jnp.asarray(rng.standard_normal((batch, heads, t, dim), np.float32))
            for ragged in (False, True) if not plain else (False,):
                lengths = jnp.asarray(lengths_for(batch, s, ragged))
                fn = step(plain)
                opt = flashpass.optimize(fn, kernel=kernel)
                report = opt.explain(q, k, v, lengths)
                if report.rewrites:
                    did = f"{report.rewrites[0].kernel} ({report.rewrites[0].mask})"
                else:
                    did = "kept" + (
                        ": faster as written" if "faster as written" in str(report) else ""
                    )
                (orig, orig_min), (new, new_min) = interleaved(
                    [jax.jit(fn), jax.jit(opt)], (q, k, v, lengths), reps
                )
                kind = "ragged" if ragged else "full"
                rows.append((s, t, kind, did, orig, new, orig / new, orig_min / new_min))
                print(
                    f"S={s:6d} q={t:2d} {kind:6s} {did:24s} original {orig * 1e3:8.3f} ms"
                    f"  optimized {new * 1e3:8.3f} ms  ratio {orig / new:5.2f}x"
                    f"  (of minima {orig_min / new_min:5.2f}x)",
                    flush=True,
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--plain", action="store_true", help="no kv lengths mask")
    ap.add_argument("--kernel", default=None, help="force a kernel (default: the pass chooses)")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, B={args.batch} H=8 D=64 f32")
    rows = run(args.sizes, args.queries, args.reps, args.plain, args.kernel, batch=args.batch)
    print("\n| S | q | rows | pass | original ms | optimized ms | ratio | ratio of minima |")
    print("|---|---|---|---|---|---|---|---|")
    for s, t, kind, did, orig, new, ratio, ratio_min in rows:
        print(
            f"| {s} | {t} | {kind} | {did} | {orig * 1e3:.2f} | {new * 1e3:.2f} "
            f"| {ratio:.2f}x | {ratio_min:.2f}x |"
        )


if __name__ == "__main__":
    main()
