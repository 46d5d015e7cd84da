"""Ring attention vs the all-gather program, on simulated CPU devices.

q, k and v are sharded along the sequence (``P(None, "seq")``, Auto axes) over
``--devices`` simulated CPU devices.  Side by side, for each sequence length:

* ``gather``: the naive causal attention as written (q/k/v annotated with
  ``with_sharding_constraint``); XLA all-gathers K and V to full length on
  every device;
* ``ring``: the same function through ``flashpass.optimize`` (a ring of
  per-block steps with collective-permutes, flashpass/ring/).

Printed per program: the compiled per-device temporary memory
(``memory_analysis().temp_size_in_bytes``), the all-gathers and
collective-permutes in the HLO, and the median time of a jitted forward+
backward step.  Simulated devices share this machine's cores, so times say
little about a real multi-chip run (see docs/benchmarks.md); memory and
collectives are what the program itself does.

With ``--shard-map`` the attention is the user's own ``shard_map`` body
instead: k and v gathered there with ``lax.all_gather``, the causal mask on
``lax.axis_index`` positions (the ring then runs where the site stands).

    python benchmarks/ring.py [--devices 8] [--sizes 2048 4096 8192] [--reps 3]
    python benchmarks/ring.py --shard-map
    python benchmarks/ring.py --sizes 16384 --no-gather --chunk-scores 4194304 1073741824

``--chunk-scores`` runs the ring once per budget of `flashpass.ring.ROW_CHUNK_SCORES`
(the most scores a step computes at a time): its memory falls with the chunks.
``--no-gather`` leaves out the all-gather program (it needs O(T·S/n) memory per device).
``--plain-steps`` adds ``ring/plain``: the ring with every step in its own plain JAX
(``kernel="reference"``, which declares no ring steps) beside ``ring``, whose steps
run the blockwise kernel (`Kernel.ring_step`).  ``--contiguous`` adds ``ring/contig``:
the causal ring in the user's contiguous order (`optimize(..., zigzag=False)`) beside
``ring``, load-balanced in zig-zag order; on simulated devices both do the same total
work, and the slowest device's work per ring, which bounds a real ring's time, is
printed as computed from the schedule (`zigzag.critical_path`).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--shard-map", action="store_true", help="the user's shard_map body")
    parser.add_argument("--no-gather", action="store_true", help="time the ring only")
    parser.add_argument("--chunk-scores", type=int, nargs="+", default=None)
    parser.add_argument("--plain-steps", action="store_true", help="also the plain-JAX steps")
    parser.add_argument("--contiguous", action="store_true", help="also the unbalanced ring")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import flashpass
    from flashpass import ring
    from flashpass.ring import zigzag

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    mesh = jax.make_mesh((args.devices,), ("seq",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P(None, "seq"))
    where = "in the user's shard_map" if args.shard_map else "Auto axes"
    print(
        f"causal attention, B=1, H={args.heads}, D={args.head_dim}, f32, sequence sharded over "
        f"{args.devices} simulated CPU devices ({where}); JAX {jax.__version__}"
    )
    print(
        f"{'S':>6} {'program':>10} {'temp MiB/device':>16} {'all-gathers':>11} "
        f"{'permutes':>8} {'fwd+bwd ms':>10}"
    )
    for n in args.sizes:
        rng = np.random.default_rng(0)
        shape = (1, n, args.heads, args.head_dim)
        qkv = [jax.device_put(rng.standard_normal(shape, np.float32), sharding) for _ in range(3)]

        def constrained(q, k, v):  # Auto axes: annotated, as logical-axis rules do
            q, k, v = (jax.lax.with_sharding_constraint(x, sharding) for x in (q, k, v))
            return attention(q, k, v)

        def body(q, k, v):  # the user's shard_map: gather k/v, causal on global rows
            k = jax.lax.all_gather(k, "seq", axis=1, tiled=True)
            v = jax.lax.all_gather(v, "seq", axis=1, tiled=True)
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
            rows = jax.lax.axis_index("seq") * q.shape[1] + jnp.arange(q.shape[1])
            s = jnp.where(jnp.arange(k.shape[1])[None, :] <= rows[:, None], s, -jnp.inf)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

        if args.shard_map:
            spec = P(None, "seq")
            constrained = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)

        programs = [] if args.no_gather else [("gather", constrained, None, True)]
        for budget in args.chunk_scores or [ring.ROW_CHUNK_SCORES]:
            name = "ring" if args.chunk_scores is None else f"ring/{budget}"
            opt = flashpass.optimize(constrained, kernel="blockwise")
            programs.append((name, opt, budget, True))
        if args.plain_steps:
            opt = flashpass.optimize(constrained, kernel="reference")
            programs.append(("ring/plain", opt, None, True))
        if args.contiguous:
            opt = flashpass.optimize(constrained, kernel="blockwise", zigzag=False)
            programs.append(("ring/contig", opt, None, False))
        rows = {}
        for name, fn, budget, _balanced in programs:
            if budget is not None:
                ring.ROW_CHUNK_SCORES = budget
            step = jax.jit(jax.grad(lambda *a, f=fn: jnp.sum(f(*a)), argnums=(0, 1, 2)))
            compiled = step.lower(*qkv).compile()
            hlo = compiled.as_text()
            jax.block_until_ready(compiled(*qkv))
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(*qkv))
                times.append(time.perf_counter() - t0)
            rows[name] = (
                compiled.memory_analysis().temp_size_in_bytes / 2**20,
                len(re.findall(r"all-gather(?:-start)?\(", hlo)),
                len(re.findall(r"collective-permute(?:-start)?\(", hlo)),
                statistics.median(times) * 1e3,
            )
            temp, gathers, permutes, ms = rows[name]
            print(f"{n:>6} {name:>10} {temp:>16.1f} {gathers:>11} {permutes:>8} {ms:>10.1f}")
        if "gather" in rows and "ring" in rows:
            g, r = rows["gather"], rows["ring"]
            print(f"{n:>6}   ratio  memory ring/gather {r[0] / g[0]:.3f}, time {r[3] / g[3]:.2f}")
        if "ring/contig" in rows and "ring" in rows:
            c, r = rows["ring/contig"], rows["ring"]
            print(
                f"{n:>6}   ratio  zig-zag/contiguous: memory {r[0] / c[0]:.3f}, time "
                f"{r[3] / c[3]:.2f}; slowest device's score blocks (computed): "
                f"{zigzag.critical_path(args.devices, True):g} vs "
                f"{zigzag.critical_path(args.devices, False):g}"
            )
        if "ring/plain" in rows and "ring" in rows:
            p, r = rows["ring/plain"], rows["ring"]
            print(
                f"{n:>6}   ratio  kernel steps/plain steps: memory {r[0] / p[0]:.3f}, "
                f"time {r[3] / p[3]:.2f}"
            )


if __name__ == "__main__":
    main()
