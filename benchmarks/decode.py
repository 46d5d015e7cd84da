"""Decode steps against a KV cache: the original vs `flashpass.optimize`, under jit.

One (or a few) new queries attend to a KV cache of S keys, B=4, H=8, D=64,
f32, each row masked to its valid length (``jnp.arange(S) < lengths[:, None]``,
the spelling the pass reads as `KvLengths`).  Rows are *full* (every length
S) or *ragged* (lengths S/8, S/4, S/16, S/2, repeated over the batch: 23% of
the keys are read, the longest row holds half).  Both functions are
jitted (``jax.jit(fn)`` and ``jax.jit(flashpass.optimize(fn))``), compiled
first, then timed interleaved, run by run, in one process (machine noise hits
both alike).  Printed: what the pass did to the site, the median time of each
and the ratio original / optimized (> 1: the optimized step is faster).  The
thresholds in ``kernels/blockwise/cost.py`` come from this table.

    python benchmarks/decode.py                       # S = 2k..32k, q=1 and 4, both layouts
    python benchmarks/decode.py --layout bshd         # the cache as [B, S, H, D] only
    python benchmarks/decode.py --sizes 2048 32768 --queries 1 --reps 21
    python benchmarks/decode.py --plain               # the site without kv lengths
    python benchmarks/decode.py --kernel blockwise    # force the kernel (the crossover)
    python benchmarks/decode.py --table               # the cost model's table (below)
    python benchmarks/decode.py --memory 250          # resident memory over new shapes

``--table`` measures the decode path forced (``kernel="blockwise"``) against
the original over batch, heads, dtype, cache length and query count, full
and ragged rows, and prints for each shape the smaller of the two ratios
(a static choice cannot know at trace time which rows it will get) next to
what `cost.faster_as_written` decides: ``DECODE_MIN_ROW_BYTES`` in
``kernels/blockwise/cost.py`` is read from it.

``--memory N`` calls a decode step on N new cache lengths, each in a fresh
process, as ``jax.jit(fn)`` and as ``flashpass.optimize(fn, cache_size=32)``,
and prints each one's growth of current resident memory (VmRSS) after a
warm-up of 5 shapes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashpass


def step(plain: bool, layout: str = "bhsd"):
    """The decode step as a model writes it: heads-major (``bhsd``: GPT-fast)
    or sequence-major (``bshd``: Hugging Face Flax, keras-hub, MaxText)."""
    x = "bhtd" if layout == "bhsd" else "bthd"
    c = "bhsd" if layout == "bhsd" else "bshd"
    seq = 2 if layout == "bhsd" else 1

    def attend(q, k, v, lengths):
        d = q.shape[-1]
        s = jnp.einsum(f"{x},{c}->bhts", q, k) / np.float32(np.sqrt(d))
        if not plain:
            valid = jnp.arange(k.shape[seq])[None, :] < lengths[:, None]
            s = jnp.where(valid[:, None, None, :], s, -1e9)
        return jnp.einsum(f"bhts,{c}->{x}", jax.nn.softmax(s, axis=-1), v)

    return attend


def shape(layout: str, b: int, h: int, s: int, d: int) -> tuple[int, ...]:
    """A q/k/v shape in ``layout`` (s: the sequence length)."""
    return (b, h, s, d) if layout == "bhsd" else (b, s, h, d)


#: Ragged rows' lengths as fractions of the cache, repeated over the batch:
#: 23% of the keys are valid on average, the longest row holds half.
RAGGED = (8, 4, 16, 2)


def lengths_for(batch: int, s: int, ragged: bool) -> np.ndarray:
    if not ragged:
        return np.full((batch,), s, np.int32)
    return np.asarray([s // RAGGED[i % len(RAGGED)] for i in range(batch)], np.int32)


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


def run(
    sizes,
    queries,
    reps,
    plain,
    kernel,
    batch=4,
    heads=8,
    dim=64,
    dtype=np.float32,
    quiet=False,
    layout="bhsd",
):
    rng = np.random.default_rng(0)
    rows = []
    for s in sizes:
        kv_shape = shape(layout, batch, heads, s, dim)
        k = jnp.asarray(rng.standard_normal(kv_shape, np.float32), dtype)
        v = jnp.asarray(rng.standard_normal(kv_shape, np.float32), dtype)
        for t in queries:
            q_shape = shape(layout, batch, heads, t, dim)
            q = jnp.asarray(rng.standard_normal(q_shape, np.float32), dtype)
            for ragged in (False, True) if not plain else (False,):
                lengths = jnp.asarray(lengths_for(batch, s, ragged))
                fn = step(plain, layout)
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
                row = (s, t, kind, did, orig, new, orig / new, orig_min / new_min)
                rows.append(row if quiet else (layout, *row))
                if quiet:
                    continue
                print(
                    f"{layout} S={s:6d} q={t:2d} {kind:6s} {did:24s} original {orig * 1e3:8.3f} ms"
                    f"  optimized {new * 1e3:8.3f} ms  ratio {orig / new:5.2f}x"
                    f"  (of minima {orig_min / new_min:5.2f}x)",
                    flush=True,
                )
    return rows


#: The --table sweep: (batch, heads) pairs, dtypes, cache lengths, queries.
TABLE_SHAPES = ((1, 8), (4, 2), (4, 8), (4, 32), (16, 8))
TABLE_DTYPES = (np.float32, jnp.bfloat16)
TABLE_SIZES = (1024, 2048, 4096, 8192)
TABLE_QUERIES = (1, 4)
TABLE_MAX_BYTES = 1 << 28  # skip shapes whose K and V exceed this


def table(reps: int) -> None:
    """The forced decode path against the original over batch, heads and dtype
    (see the module doc); prints one Markdown row per shape."""
    from flashpass.kernels.blockwise.cost import faster_as_written
    from flashpass.spec import AttentionSpec, ExtraSpec, KvLengths, Scale

    print("| B | H | dtype | S | q | row KV bytes | full | ragged | min | cost model |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, heads in TABLE_SHAPES:
        for dtype in TABLE_DTYPES:
            name = np.dtype(dtype).name
            for s in TABLE_SIZES:
                if 2 * batch * heads * s * 64 * np.dtype(dtype).itemsize > TABLE_MAX_BYTES:
                    continue
                shape = dict(batch=batch, heads=heads, dtype=dtype, quiet=True)
                measured = run([s], TABLE_QUERIES, reps, False, "blockwise", **shape)
                for t in TABLE_QUERIES:
                    full, ragged = (r[6] for r in measured if r[1] == t)
                    spec = AttentionSpec(
                        batch, heads, heads, t, s, 64, 64, *[name] * 6,
                        score_ops=(Scale(0.125), KvLengths(0, (batch, 1, 1, 1), -1e9, 0)),
                        extras=(ExtraSpec((batch, 1, 1, 1), np.int32),),
                    )  # fmt: skip
                    kept = faster_as_written(spec, "cpu")
                    row_bytes = 2 * heads * s * 64 * np.dtype(dtype).itemsize
                    print(
                        f"| {batch} | {heads} | {name} | {s} | {t} | {row_bytes >> 10} KiB "
                        f"| {full:.2f}x | {ragged:.2f}x | {min(full, ragged):.2f}x "
                        f"| {'kept' if kept else 'rewritten'} |",
                        flush=True,
                    )


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def memory_child(mode: str, shapes: int, cache_size: int = 32) -> None:
    """Run in a fresh process: one decode step (B=4, H=8, D=64, one query,
    half-full rows, rewritten to the decode path) on ``shapes`` new cache
    lengths from 2048 on; prints the VmRSS growth after a 5-shape warm-up."""
    fn = step(False)
    call = jax.jit(fn)
    if mode != "jit":  # forced: one-query caches under 8k are kept as written on CPU
        call = flashpass.optimize(fn, kernel="blockwise", cache_size=cache_size)

    def args(s):
        kv = np.zeros((4, 8, s, 64), np.float32)
        return np.zeros((4, 8, 1, 64), np.float32), kv, kv, np.full((4,), s // 2, np.int32)

    for i in range(5):
        jax.block_until_ready(call(*args(2048 - 16 * (i + 1))))
    before = _rss_mib()
    for i in range(shapes):
        jax.block_until_ready(call(*args(2048 + 16 * i)))
    print(f"{_rss_mib() - before:.1f}")


def memory(shapes: int) -> None:
    print(f"resident memory growth over {shapes} new cache lengths (fresh process each):")
    labels = {"jit": "jax.jit(fn)", "opt": "optimize(fn, kernel='blockwise', cache_size=32)"}
    for mode, label in labels.items():
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", mode, str(shapes)],
            capture_output=True, text=True, check=True, env=dict(os.environ),
        )  # fmt: skip
        print(f"  {label:50s} {float(out.stdout.split()[-1]):7.1f} MB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--plain", action="store_true", help="no kv lengths mask")
    ap.add_argument(
        "--layout",
        nargs="+",
        choices=("bhsd", "bshd"),
        default=["bhsd", "bshd"],
        help="the cache's layout: [B, H, S, D] (GPT-fast) or [B, S, H, D] (HF, keras-hub)",
    )
    ap.add_argument("--kernel", default=None, help="force a kernel (default: the pass chooses)")
    ap.add_argument("--table", action="store_true", help="the cost model's table")
    ap.add_argument("--memory", type=int, metavar="N", help="VmRSS growth over N shapes")
    ap.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], int(args.memory_child[1]))
        return
    if args.memory:
        memory(args.memory)
        return
    if args.table:
        print(f"jax {jax.__version__}, {jax.devices()[0].platform}, D=64, kernel='blockwise'")
        table(args.reps)
        return
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, B={args.batch} H=8 D=64 f32")
    rows = []
    for layout in args.layout:
        rows += run(
            args.sizes, args.queries, args.reps, args.plain, args.kernel, batch=args.batch,
            layout=layout,
        )  # fmt: skip
    print(
        "\n| layout | S | q | rows | pass | original ms | optimized ms | ratio | ratio of minima |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for layout, s, t, kind, did, orig, new, ratio, ratio_min in rows:
        print(
            f"| {layout} | {s} | {t} | {kind} | {did} | {orig * 1e3:.2f} | {new * 1e3:.2f} "
            f"| {ratio:.2f}x | {ratio_min:.2f}x |"
        )


if __name__ == "__main__":
    main()
