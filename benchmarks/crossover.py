"""Where does the blockwise kernel start beating the naive computation?

Times, in one process and interleaved run by run (so machine noise hits both
sides alike), the naive ``einsum -> softmax -> einsum`` attention against
`BlockwiseKernel`, jitted, forward and forward+backward, causal and not, and
prints the median times and the ratio naive / blockwise (> 1: blockwise wins).
The result sets ``CPU_MIN_KV_LEN`` in ``kernels/blockwise/plan.py``.

    python benchmarks/crossover.py                # B=1, H=8, D=64, f32, S=128..4096
    python benchmarks/crossover.py --sizes 512 1024 --reps 9

``--tiles`` compares tile sizes instead (blockwise only, each against the
default of `default_blocks`; ``QxK`` for both passes, ``QxK/QxK`` for the
forward's and the backward's), e.g. the sweep behind ``TILE_ELEMENTS``:

    python benchmarks/crossover.py --tiles 1024x512 512x512 256x512 256x256 \
        --sizes 8192 --causal-only --modes fwd --reps 7
    python benchmarks/crossover.py --tiles 512x256/512x512 512x256/1024x512 \
        --sizes 4096 --causal-only --modes fwd+bwd --reps 15

``--head-loop`` compares the kernel run one (batch, head) unit at a time
(``head_loop=True``) against the batched loops (``head_loop=False``), the
measurement behind ``HEAD_LOOP_BLOCK`` and ``HEAD_LOOP_MIN_CAUSAL_LEN``:

    python benchmarks/crossover.py --head-loop --sizes 1024 2048 4096 8192 --reps 5

Both print the median and the minimum of each, relative to the first (the
default tiles of the batched loops): on a machine shared with other jobs the
median moves with the load, the minimum shows what a variant costs when nothing
else interferes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

# The same original code as benchmarks/cpu.py measures (this folder is on sys.path
# when a script here runs).
from cpu import naive

from flashpass.kernels.blockwise import BlockSizes, BlockwiseKernel
from flashpass.spec import AttentionSpec, Causal, Scale


def blockwise_spec(b, h, n, d, causal: bool) -> AttentionSpec:
    ops = (Scale(d**-0.5),) + ((Causal(0, -1e9),) if causal else ())
    f32 = jnp.float32
    return AttentionSpec(b, h, h, n, n, d, d, f32, f32, f32, f32, f32, f32, score_ops=ops)


def blockwise_fn(kernel, spec: AttentionSpec):
    return lambda q, k, v: kernel.apply(spec, q, k, v)


def fwd_bwd(f):
    return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))


def timed(fn, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=0, help="runs per point (default: by size)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block-q", type=int, default=None, help="default: default_blocks")
    ap.add_argument("--block-k", type=int, default=None, help="default: default_blocks")
    ap.add_argument("--tiles", nargs="+", default=None, help="compare tile sizes, e.g. 512x256")
    ap.add_argument("--head-loop", action="store_true", help="compare head_loop on and off")
    ap.add_argument("--causal-only", action="store_true")
    ap.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    args = ap.parse_args()

    kernel = BlockwiseKernel(block_q=args.block_q, block_k=args.block_k)
    b, h, d = 1, args.heads, args.dim
    if args.tiles:
        return compare(args, b, h, d, tile_kernels)
    if args.head_loop:
        return compare(args, b, h, d, head_loop_kernels)
    n = args.sizes[-1]
    blocks = kernel.blocks(blockwise_spec(b, h, n, d, False))
    print(f"backend={jax.default_backend()} B={b} H={h} D={d} f32 T=S blocks={blocks} at S={n}")
    print("times in ms (median); ratio = naive / blockwise, > 1 means blockwise is faster")
    header = f"{'S':>5} {'mode':<15} {'naive':>9} {'blockwise':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    started = time.perf_counter()

    def variants(spec, causal):
        naive_fn = lambda q, k, v: naive(q, k, v, causal=causal)  # noqa: E731
        return {"naive": naive_fn, "blockwise": blockwise_fn(kernel, spec)}

    for n, label, samples in interleaved(args, b, h, d, variants, warm_up_to=1024):
        t_naive, t_ours = (statistics.median(s) * 1e3 for s in samples.values())
        print(
            f"{n:>5} {label:<15} {t_naive:>9.2f} {t_ours:>9.2f} {t_naive / t_ours:>6.2f}",
            flush=True,
        )
    print(f"total {time.perf_counter() - started:.0f} s")


def interleaved(args, b, h, d, variants, warm_up_to=None, reps=None):
    """For each size, causal setting and mode: compile ``variants(spec, causal)``
    (name -> ``f(q, k, v)``) and time them run by run, interleaved; yields
    ``(S, label, {name: times})``.  ``--reps`` runs each, else ``reps``, else
    7/5/3 by size.  Sizes up to ``warm_up_to`` (all when None) get a warm-up
    run; long ones are their own warm-up."""
    for n in args.sizes:
        reps_n = args.reps or reps or (7 if n <= 512 else 5 if n <= 2048 else 3)
        key = jax.random.split(jax.random.PRNGKey(n), 3)
        q, k, v = (jax.random.normal(kk, (b, h, n, d), jnp.float32) for kk in key)
        for causal in (True,) if args.causal_only else (False, True):
            fns = variants(blockwise_spec(b, h, n, d, causal), causal)
            for mode, wrap in (("fwd", lambda f: f), ("fwd+bwd", fwd_bwd)):
                if mode not in args.modes:
                    continue
                compiled = {
                    name: jax.jit(wrap(f)).lower(q, k, v).compile() for name, f in fns.items()
                }
                if warm_up_to is None or n <= warm_up_to:
                    for fn in compiled.values():
                        timed(fn, (q, k, v))
                samples = {name: [] for name in compiled}
                for _ in range(reps_n):
                    for name, fn in compiled.items():
                        samples[name].append(timed(fn, (q, k, v)))
                yield n, f"{mode}{' causal' if causal else ''}", samples


def tile_kernels(args, spec) -> dict:
    """The batched loops with their default tiles, then with each of ``--tiles``."""
    default = BlockwiseKernel(head_loop=False)
    kernels = {"default {}x{}".format(*default.blocks(spec)): default}
    for tile in args.tiles:
        fwd, bwd = (_tile(t) for t in (tile.split("/") * 2)[:2])
        kernels[tile] = BlockwiseKernel(block_sizes=BlockSizes(*fwd, *bwd), head_loop=False)
    return kernels


def head_loop_kernels(args, spec) -> dict:
    return {
        "batched": BlockwiseKernel(head_loop=False),
        "head loop": BlockwiseKernel(head_loop=True),
    }


def compare(args, b, h, d, make_kernels) -> None:
    """Blockwise variants (``make_kernels``), interleaved, against the first."""
    print(f"B={b} H={h} D={d} f32 T=S; median time / median time of the first variant")
    started = time.perf_counter()

    def variants(spec, causal):
        kernels = make_kernels(args, spec)
        return {name: blockwise_fn(kern, spec) for name, kern in kernels.items()}

    for n, label, samples in interleaved(args, b, h, d, variants, reps=5):
        first = next(iter(samples.values()))
        base, base_min = statistics.median(first), min(first)
        cells = "  ".join(
            f"{name} {statistics.median(ts) / base:.2f} (min {min(ts) / base_min:.2f})"
            for name, ts in samples.items()
        )
        print(f"{n:>5} {label:<15} {cells}", flush=True)
    print(f"total {time.perf_counter() - started:.0f} s")


def _tile(text: str) -> tuple[int, int]:
    bq, bk = (int(x) for x in text.split("x"))
    return bq, bk


if __name__ == "__main__":
    main()
