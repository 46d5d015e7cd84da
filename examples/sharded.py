"""flashpass on a sharded model: data parallel x tensor parallel on 8 devices.

A causal self-attention block whose batch is sharded over the ``data`` mesh
axis and whose heads (the columns of the q/k/v projections, the rows of the
output projection) are sharded over ``model``, Megatron style, run under
``jax.jit`` with Explicit mesh axes.  The script prints:

  1. the rewrite report, and where the kernel runs: inside a ``shard_map``,
     on each device's own batch elements and heads;
  2. numerics against the unsharded original (output and gradients), and the
     collectives of the compiled programs (the rewrite adds none);
  3. the same attention with its queries sharded along the sequence and its
     keys whole: each device runs its own query rows against every key (its
     causal edge at its rows' offset), with no collective; its numerics.

    python examples/sharded.py                        # 8 simulated CPU devices
    python examples/sharded.py --kernel pallas_tpu    # Pallas TPU kernel, interpret mode

On CPU the script asks XLA for 8 host devices (it must do so before JAX
starts); on a machine with 8 accelerators it uses them.  See docs/sharding.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

if "jax" not in sys.modules:  # XLA reads the flag once, when JAX starts
    flag = "--xla_force_host_platform_device_count=8"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
if __package__ in (None, ""):  # run as `python examples/sharded.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flashpass  # noqa: E402

_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = .*? (all-gather|all-to-all|collective-permute|all-reduce)(?:-start)?\(",
    re.MULTILINE,
)


def attention(q, k, v):
    """Causal multi-head attention, ``[batch, seq, heads, head_dim]``."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def block(params, x):
    """Self-attention block: q/k/v projections, attention, output projection."""
    q, k, v = (jnp.einsum("btc,chd->bthd", x, params[n]) for n in ("wq", "wk", "wv"))
    # Contracting the sharded heads: say how the (all-reduced) output is sharded.
    out = None if jax.sharding.get_abstract_mesh().empty else P("data")
    return jnp.einsum("bthd,hdc->btc", attention(q, k, v), params["wo"], out_sharding=out)


def make_inputs(batch=4, seq=128, channels=64, heads=8, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale)

    params = {
        n: normal(channels, heads, head_dim, scale=channels**-0.5) for n in ("wq", "wk", "wv")
    }
    params["wo"] = normal(heads, head_dim, channels, scale=(heads * head_dim) ** -0.5)
    return params, normal(batch, seq, channels)


def shard(mesh, params, x):
    """Batch over ``data``; heads over ``model`` (Megatron-style tensor parallelism)."""
    specs = {"wq": P(None, "model"), "wk": P(None, "model"), "wv": P(None, "model")}
    specs["wo"] = P("model")
    params = {n: jax.device_put(w, NamedSharding(mesh, specs[n])) for n, w in params.items()}
    return params, jax.device_put(x, NamedSharding(mesh, P("data")))


def loss(fn):
    return lambda params, x: jnp.sum(fn(params, x) ** 2)


def compiled(fn, *args):
    """The compiled ``(output, gradients)`` program of ``fn``."""

    def program(params, x):
        return fn(params, x), jax.grad(loss(fn), argnums=(0, 1))(params, x)

    return jax.jit(program).lower(*args).compile()


def collectives(executable) -> dict:
    return dict(collections.Counter(_COLLECTIVE.findall(executable.as_text())))


def _spec_str(spec) -> str:
    """``P('data', None)``, whatever ``PartitionSpec``'s repr is in this JAX version."""
    return "P(" + ", ".join(repr(a) for a in spec) + ")"


def kernel_calls(closed) -> list[str]:
    """``"<kernel> on q <shape> inside shard_map(in_specs=...)"`` for every
    kernel call in a rewritten jaxpr (per-device shapes)."""
    found = []

    def visit(jaxpr, where):
        for eqn in jaxpr.eqns:
            name = str(eqn.params.get("name", ""))
            if name.startswith("flashpass_"):
                shape = "x".join(map(str, eqn.invars[0].aval.shape))
                found.append(f"{name} on q {shape}{where}")
                continue
            inner = where
            if eqn.primitive.name == "shard_map":
                specs = ", ".join(_spec_str(s) for s in eqn.params["in_specs"][:3])
                inner = f" inside shard_map(in_specs=({specs}, ...))"
            for value in eqn.params.values():
                for item in value if isinstance(value, tuple | list) else (value,):
                    sub = getattr(item, "jaxpr", item)  # ClosedJaxpr or Jaxpr
                    if hasattr(sub, "eqns"):
                        visit(sub, inner)

    visit(closed.jaxpr, "")
    return found


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def run(kernel: str = "blockwise", log=print) -> bool:
    """Print the three sections; return whether the numerics check passed."""
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, found {jax.device_count()} (set XLA_FLAGS first)")
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes: shardings in types
    interpret = kernel == "pallas_tpu" and jax.default_backend() != "tpu"
    opt = flashpass.optimize(block, kernel=kernel, interpret=interpret)
    params, x = make_inputs()
    sharded = shard(mesh, params, x)

    log("== 1. report (mesh data=2 x model=4, Explicit axes) ==")
    with jax.set_mesh(mesh):
        log(str(opt.explain(*sharded)))
        for call in kernel_calls(opt.rewritten_jaxpr(*sharded)):
            log(f"  {call}")
        got, orig = compiled(opt, *sharded), compiled(block, *sharded)
        (out, grads), (out_orig, _) = got(*sharded), orig(*sharded)
    ref_out, ref_grads = compiled(block, params, x)(params, x)

    log("\n== 2. numerics vs the unsharded original, and collectives ==")
    errors = {"output": relative_error(out, ref_out)}
    flat, ref_flat = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)
    errors["gradients"] = max(relative_error(g, r) for g, r in zip(flat, ref_flat, strict=True))
    passed = all(e <= 1e-4 for e in errors.values())
    for name, err in errors.items():
        log(f"  {name:<10} max relative error {err:.1e}")
    log(
        f"  output sharding: {_spec_str(out.sharding.spec)}"
        f" (original: {_spec_str(out_orig.sharding.spec)})"
    )
    log(f"  collectives, original:  {collectives(orig)}")
    log(f"  collectives, flashpass: {collectives(got)}")
    passed = passed and collectives(got) == collectives(orig)
    log(f"  numerics: {'PASS' if passed else 'FAIL'}")

    log("\n== 3. queries sharded along the sequence, keys whole ==")
    seq_mesh = jax.make_mesh((4,), ("seq",), devices=jax.devices()[:4])
    rng = np.random.default_rng(1)
    x = [jnp.asarray(rng.standard_normal((2, 128, 4, 16)), jnp.float32) for _ in range(3)]
    q = jax.device_put(x[0], NamedSharding(seq_mesh, P(None, "seq")))
    k, v = (jax.device_put(a, NamedSharding(seq_mesh, P())) for a in x[1:])
    opt = flashpass.optimize(attention, kernel=kernel)
    with jax.set_mesh(seq_mesh):
        log(str(flashpass.explain(opt, q, k, v)))
        out = jax.jit(opt)(q, k, v)
        moved = collectives(jax.jit(opt).lower(q, k, v).compile())
    error = float(jnp.max(jnp.abs(out - attention(*x))))
    ok = error < 1e-5 and not moved
    log(f"  output: error {error:.1e}, sharded {_spec_str(out.sharding.spec)}; collectives {moved}")
    log(f"  numerics: {'PASS' if ok else 'FAIL'}")
    return passed and ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="blockwise", help="blockwise (default) or pallas_tpu")
    args = ap.parse_args(argv)
    return 0 if run(args.kernel) else 1


if __name__ == "__main__":
    sys.exit(main())
