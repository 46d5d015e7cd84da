"""A server's resident memory over varied shapes: `flashpass.optimize` vs `jax.jit`.

A process serving attention without bucketing sees a new input signature on
almost every request: prompt lengths, batch sizes and dtypes vary.  This
benchmark calls two functions, a self-attention (q/k/v ``[B, T, 2, 16]``)
and a decode step (one query against a cache of S keys masked to per-row
lengths, ``[B, 2, S, 16]``), alternately, on ``--shapes`` new signatures:
the length grows by one per self-attention call (T = 66, 67, ...) and by 8
per decode call, the batch cycles through 1, 2, 4 and the dtype through
float32 and bfloat16.  Each mode runs in a fresh process:

* ``jit``: ``jax.jit`` of both functions (keeps every shape's program);
* ``optimize``: ``flashpass.optimize(fn, kernel="blockwise", cache_size=N)``
  (the kernel forced: on CPU the cost model keeps such short sequences as
  written, and the point is the rewritten programs' memory).

Printed per mode: the growth of current resident memory (VmRSS from
/proc/self/status, after ``gc.collect`` and glibc's ``malloc_trim``, so it
counts what is held, not the allocator's free pages) between a warm-up of a
few shapes and the end, in MB (2**20 bytes); how much of it the caches hold
(released by the functions' ``clear_cache()`` and ``jax.clear_caches()``);
and what is left after clearing them: memory no cache holds, which JAX and
XLA keep per compiled program whoever compiles it (``jax.jit`` leaves as
much per shape).

``--workload self-attention``: the self-attention alone on q/k/v ``[1, T, 2,
16]`` float32, T = 66 ... 66 + shapes - 1, VmRSS read after ``gc.collect``
only (no ``malloc_trim`` by the measuring code: flashpass trims on eviction
itself, ``jax.jit`` never evicts).

    python benchmarks/serving.py                     # 250 shapes, cache_size=32
    python benchmarks/serving.py --workload self-attention   # [1, T, 2, 16], gc only
    python benchmarks/serving.py --shapes 60 --cache-size 8
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

WARM = 6  # shapes called before the first reading (imports, first compilations)
HEADS, DIM = 2, 16
BATCHES = (1, 2, 4)
DTYPES = (np.float32, jnp.bfloat16)


def self_attention(q, k, v):
    """Softmax attention over ``[B, T, H, D]`` (the einsum spelling)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def decode_step(q, k, v, lengths):
    """One query per row against a cache of per-row valid lengths (``[B, H, S, D]``)."""
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
    keep = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    s = jnp.where(keep[:, None, None, :], s, -1e9)
    return jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, axis=-1), v)


def shape_args(i: int):
    """``(which function, its arguments)`` for signature ``i`` (all distinct)."""
    batch = BATCHES[(i // 2) % len(BATCHES)]
    dtype = DTYPES[(i // 6) % len(DTYPES)]
    if i % 2 == 0:
        t = 66 + i // 2
        x = np.ones((batch, t, HEADS, DIM), np.float32).astype(dtype)
        return 0, (x, x, x)
    s = 256 + 8 * (i // 2)
    kv = np.ones((batch, HEADS, s, DIM), np.float32).astype(dtype)
    q = np.ones((batch, HEADS, 1, DIM), np.float32).astype(dtype)
    return 1, (q, kv, kv, np.linspace(s // 3, s, batch).astype(np.int32))


def self_attention_args(i: int):
    """The ``--workload self-attention`` signatures: q/k/v ``[1, T, 2, 16]``
    float32, T = 66 + i (the workload of issue 41)."""
    x = np.ones((1, 66 + i, HEADS, DIM), np.float32)
    return 0, (x, x, x)


def rss_mb(trim: bool = True) -> float:
    """Current resident memory in MB, after ``gc.collect`` and (``trim``)
    returning the freed heap."""
    gc.collect()
    if trim and sys.platform.startswith("linux"):
        ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def child(mode: str, shapes: int, cache_size: int, workload: str = "mixed") -> None:
    """In a fresh process: prints the VmRSS growth (MB) over ``shapes`` signatures.

    ``workload="self-attention"``: the self-attention alone on `self_attention_args`,
    VmRSS read after ``gc.collect`` only (what a server's monitoring sees, with
    nothing but what flashpass itself does on eviction)."""
    make = shape_args if workload == "mixed" else self_attention_args
    trim = workload == "mixed"
    import flashpass

    fns = (self_attention, decode_step)
    if mode == "jit":
        calls = [jax.jit(f) for f in fns]
    else:
        calls = [flashpass.optimize(f, kernel="blockwise", cache_size=cache_size) for f in fns]
    for i in range(WARM):
        which, args = make(-2 * WARM + i)  # negative: not among the measured ones
        jax.block_until_ready(calls[which](*args))
    before = rss_mb(trim)
    for i in range(shapes):
        which, args = make(i if workload != "mixed" else 2 * WARM + i)
        jax.block_until_ready(calls[which](*args))
    grown = rss_mb(trim) - before
    for c in calls:
        if mode != "jit":
            assert c.cache_info()["size"] <= cache_size
        c.clear_cache()
    jax.clear_caches()  # every tracing, lowering and compilation cache of the process
    print(f"{grown:.2f} {rss_mb(trim) - before:.2f}")


MODES = {
    "jit": "jax.jit(fn)",
    "optimize": "optimize(fn, kernel='blockwise', cache_size={n})",
}


def measure(
    mode: str, shapes: int, cache_size: int, workload: str = "mixed"
) -> tuple[float, float]:
    """VmRSS growth (MB) of a fresh process running ``mode``, and what is left
    of it once every cache is cleared."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(shapes), str(cache_size), workload],
        capture_output=True, text=True, env=dict(os.environ), timeout=3600,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    grown, residue = out.stdout.split()[-2:]
    return float(grown), float(residue)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, default=250)
    ap.add_argument("--cache-size", type=int, default=32)
    ap.add_argument(
        "--workload",
        choices=("mixed", "self-attention"),
        default="mixed",
        help="mixed (above) or the self-attention alone, [1, T, 2, 16], read after gc only",
    )
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]), args.child[3])
        return
    if args.workload == "mixed":
        what = (
            f"self-attention and decode, batch {'/'.join(map(str, BATCHES))}, "
            "float32/bfloat16; VmRSS after gc and malloc_trim"
        )
    else:
        what = "self-attention [1, T, 2, 16] f32, T = 66, 67, ...; VmRSS after gc only"
    print(f"jax {jax.__version__}; {args.shapes} new signatures ({what}), fresh process per mode")
    print("\n| functions | VmRSS growth (MB) | per shape | held by caches | left after clearing |")
    print("|---|---|---|---|---|")
    for mode, label in MODES.items():
        grown, residue = measure(mode, args.shapes, args.cache_size, args.workload)
        print(
            f"| {label.format(n=args.cache_size)} | {grown:.1f} | {grown / args.shapes:.2f} "
            f"| {grown - residue:.1f} | {residue:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
