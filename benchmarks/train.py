"""A GPT training step on CPU: the original vs `flashpass.optimize`, under jit.

The model is a small GPT written the way model code usually is: token +
position embeddings, pre-LayerNorm blocks of causal multi-head self-attention
(``einsum`` scores, a causal mask applied with ``jnp.where``,
``jax.nn.softmax``, ``einsum`` with V) and a GELU MLP, a final LayerNorm and a
tied output head; float32.  One step is ``jax.value_and_grad(loss)`` (next-token
cross-entropy) and an update: plain SGD (the default) or a small hand-written
Adam (``--optimizer adam``).

Two programs are compiled from the same step: ``jax.jit(step)`` (original) and
``jax.jit(flashpass.optimize(step))`` (optimized; the pass runs while ``jit``
traces).  Both are compiled first (``lower(...).compile()``), then timed
interleaved, call by call, in one process, so machine noise hits both alike.
Printed:

1. correctness: the largest relative difference between the two programs'
   updated parameters (per leaf ``max|a - b| / max|b|``; goal <= 1e-5), and,
   stricter, between their gradients (``jax.value_and_grad(loss)`` alone,
   jitted and optimized the same way; not timed) and losses.  Adam's first
   step moves each parameter by about ``lr * sign(g)``, so gradient entries
   at the level of float32 rounding flip and the original program itself is
   ~1e-4 away from a float64 run: use SGD for the parameter check;
2. every attention site rewritten forward *and* backward (the report's
   ``passes`` column: ``forward+backward`` for each of the ``--layers`` sites);
3. compiled temporary memory (``memory_analysis().temp_size_in_bytes``),
   optimized / original (goal <= 0.25x);
4. step time, median of ``--repeats`` interleaved calls, optimized / original
   (goal <= 0.67x).

Exits non-zero when (1) or (2) fails; memory and time only print their status.

    python benchmarks/train.py                       # T = 2048, 2 layers, a few minutes
    python benchmarks/train.py --seq 4096 --repeats 5
    python benchmarks/train.py --quick               # smoke run, < 30 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashpass

GOAL_REL_DIFF = 1e-5
GOAL_MEMORY = 0.25
GOAL_TIME = 0.67

# --------------------------------------------------------------------------- model


def init_params(rng: np.random.Generator, layers: int, dim: int, heads: int, vocab: int, seq: int):
    """A plain pytree of f32 arrays (GPT-2 style initialisation)."""

    def normal(*shape, std):
        return jnp.asarray(rng.standard_normal(shape) * std, jnp.float32)

    def ln():
        return {"scale": jnp.ones((dim,), jnp.float32), "bias": jnp.zeros((dim,), jnp.float32)}

    out = (2 * layers) ** -0.5
    blocks = []
    for _ in range(layers):
        blocks.append(
            {
                "ln1": ln(),
                "wqkv": normal(dim, 3 * dim, std=dim**-0.5),
                "wo": normal(dim, dim, std=dim**-0.5 * out),
                "ln2": ln(),
                "w1": normal(dim, 4 * dim, std=dim**-0.5),
                "b1": jnp.zeros((4 * dim,), jnp.float32),
                "w2": normal(4 * dim, dim, std=(4 * dim) ** -0.5 * out),
                "b2": jnp.zeros((dim,), jnp.float32),
            }
        )
    return {
        "wte": normal(vocab, dim, std=0.02),
        "wpe": normal(seq, dim, std=0.01),
        "blocks": blocks,
        "ln_f": ln(),
    }


def layer_norm(x, p, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def attention(x, p, heads: int):
    """Causal self-attention, by hand: the site flashpass rewrites."""
    b, t, d = x.shape
    dh = d // heads
    q, k, v = jnp.split(x @ p["wqkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, dh) for a in (q, k, v))
    s = jnp.einsum("bthd,bshd->bhts", q, k) * (dh**-0.5)
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    s = jnp.where(causal, s, -1e9)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
    return o.reshape(b, t, d) @ p["wo"]


def forward(params, tokens, heads: int):
    x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]
    for p in params["blocks"]:
        x = x + attention(layer_norm(x, p["ln1"]), p, heads)
        h = layer_norm(x, p["ln2"])
        x = x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return layer_norm(x, params["ln_f"]) @ params["wte"].T


def loss_fn(params, tokens, heads: int):
    """Next-token cross-entropy."""
    logits = forward(params, tokens[:, :-1], heads)
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# --------------------------------------------------------------------------- steps


def make_step(heads: int, optimizer: str, lr: float):
    """``step(params, opt_state, tokens) -> (loss, params, opt_state)``."""
    b1, b2, eps = 0.9, 0.999, 1e-8

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, heads)
        if optimizer == "sgd":
            params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
            return loss, params, opt_state
        count = opt_state["count"] + 1
        mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, opt_state["mu"], grads)
        nu = jax.tree_util.tree_map(lambda n, g: b2 * n + (1 - b2) * g * g, opt_state["nu"], grads)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)

        def update(p, m, n):
            return p - lr * (m / c1) / (jnp.sqrt(n / c2) + eps)

        params = jax.tree_util.tree_map(update, params, mu, nu)
        return loss, params, {"count": count, "mu": mu, "nu": nu}

    return step


def init_opt_state(params, optimizer: str):
    if optimizer == "sgd":
        return {}
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"count": jnp.zeros((), jnp.int32), "mu": zeros, "nu": zeros}


# --------------------------------------------------------------------------- measures


def rel_diff(a, b) -> float:
    """Largest per-leaf ``max|a - b| / max|b|`` over two pytrees."""
    worst = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = np.max(np.abs(y)) if y.size else 0.0
        diff = np.max(np.abs(x - y)) if y.size else 0.0
        worst = max(worst, float(diff / scale) if scale > 0 else float(diff))
    return worst


def interleaved(fns, args, repeats: int) -> list[tuple[float, float]]:
    """(median, minimum) seconds per compiled function, timed alternately call
    by call (the first call of each is a warm-up and not timed)."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - t0)
    return [(statistics.median(t), min(t)) for t in times]


def status(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048, help="tokens per row (T)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256, help="d_model (head dim = dim / heads)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7, help="timed calls of each program")
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--kernel", default=None, help="force a kernel (default: the pass chooses)")
    ap.add_argument("--quick", action="store_true", help="small config for a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        # Long enough for the default CPU order to pick the kernel (kv_len >= 1024).
        args.seq, args.layers, args.batch, args.heads, args.dim = 1024, 2, 1, 2, 64
        args.vocab, args.repeats = 128, 2
    if args.dim % args.heads:
        ap.error(f"--dim {args.dim} is not divisible by --heads {args.heads}")

    rng = np.random.default_rng(0)
    # The model sees T = --seq tokens; one more gives the targets.
    params = init_params(rng, args.layers, args.dim, args.heads, args.vocab, args.seq)
    tokens = jnp.asarray(rng.integers(0, args.vocab, (args.batch, args.seq + 1)), jnp.int32)
    opt_state = init_opt_state(params, args.optimizer)
    call = (params, opt_state, tokens)

    step = make_step(args.heads, args.optimizer, args.lr)
    opt = flashpass.optimize(step, kernel=args.kernel)
    print(
        f"JAX {jax.__version__} on {jax.default_backend()}; GPT {args.layers} layers, "
        f"B={args.batch} T={args.seq} D={args.dim} H={args.heads} "
        f"(head dim {args.dim // args.heads}), vocab {args.vocab}, f32, "
        f"value_and_grad + {args.optimizer}"
    )

    t0 = time.perf_counter()
    original = jax.jit(step).lower(*call).compile()
    compile_original = time.perf_counter() - t0
    t0 = time.perf_counter()
    optimized = jax.jit(opt).lower(*call).compile()
    compile_optimized = time.perf_counter() - t0
    report = opt.reports[-1]
    print(report)

    # (1) the same update.
    loss_a, params_a, _ = jax.block_until_ready(original(*call))
    loss_b, params_b, _ = jax.block_until_ready(optimized(*call))
    d_params = rel_diff(params_b, params_a)

    # The gradients themselves (the SGD update's ``new - old`` cancels in f32).
    def grads(params, tokens):
        return jax.value_and_grad(loss_fn)(params, tokens, args.heads)

    grads_a = jax.jit(grads)(params, tokens)[1]
    grads_b = jax.jit(flashpass.optimize(grads, kernel=args.kernel))(params, tokens)[1]
    d_grads = rel_diff(grads_b, grads_a)
    del grads_a, grads_b
    d_loss = abs(float(loss_b) - float(loss_a)) / abs(float(loss_a))
    same = d_params <= GOAL_REL_DIFF and bool(np.isfinite(float(loss_b)))

    # (2) every site, forward and backward.
    both = sum(1 for r in report.rewrites if r.backward)
    rewritten = both == args.layers and len(report.rewrites) == args.layers and not report.errors

    # (3) compiled temporary memory.
    mem_a = original.memory_analysis().temp_size_in_bytes
    mem_b = optimized.memory_analysis().temp_size_in_bytes
    mem_ratio = mem_b / mem_a

    # (4) step time.
    (med_a, min_a), (med_b, min_b) = interleaved((original, optimized), call, args.repeats)
    time_ratio = med_b / med_a

    mib = 2.0**20
    rows = [
        ("temp memory (MiB)", mem_a / mib, mem_b / mib, f"{mem_ratio:.3f}x"),
        ("step time, median (ms)", med_a * 1e3, med_b * 1e3, f"{time_ratio:.3f}x"),
        ("step time, minimum (ms)", min_a * 1e3, min_b * 1e3, f"{min_b / min_a:.3f}x"),
        ("compile (s)", compile_original, compile_optimized, ""),
    ]
    print(f"\n{'':26s} {'original':>10s} {'flashpass':>10s} {'ratio':>8s}")
    for name, a, b, ratio in rows:
        print(f"{name:26s} {a:10.1f} {b:10.1f} {ratio:>8s}".rstrip())
    print(f"{'loss':26s} {float(loss_a):10.6f} {float(loss_b):10.6f}\n")
    mem_ok, time_ok = mem_ratio <= GOAL_MEMORY, time_ratio <= GOAL_TIME
    print(
        f"(1) updated params rel. diff {d_params:.2e} (goal <= {GOAL_REL_DIFF:g}): {status(same)}"
    )
    print(f"    gradients rel. diff {d_grads:.2e}; loss rel. diff {d_loss:.2e}")
    print(
        f"(2) sites rewritten forward+backward: {both} of {args.layers} "
        f"({len(report.rewrites)} rewritten, {len(report.fallbacks)} kept, "
        f"{len(report.errors)} internal errors): {status(rewritten)}"
    )
    print(f"(3) temp memory {mem_ratio:.3f}x (goal <= {GOAL_MEMORY}x): {status(mem_ok)}")
    print(f"(4) step time {time_ratio:.3f}x (goal <= {GOAL_TIME}x): {status(time_ok)}")
    kernels = ",".join(sorted(set(report.kernels))) or "none"
    print(
        f"summary: T={args.seq} L={args.layers} {both}/{args.layers} sites forward+backward "
        f"({kernels}), params rel diff {d_params:.1e}, memory {mem_ratio:.3f}x, "
        f"time {time_ratio:.3f}x"
    )
    return 0 if same and rewritten else 1


if __name__ == "__main__":
    sys.exit(main())
