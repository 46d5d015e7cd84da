"""One process of the two-process ring test (tests/sharding/test_multiprocess.py).

Run as ``python multiprocess_ring.py PROCESS_ID PORT``: joins a 2-process JAX
cluster on 127.0.0.1 with four CPU devices per process and gloo collectives,
then runs a causal attention site whose q/k/v are sharded along the sequence
over all eight devices, optimized (a ring across both processes) and as
written, and prints ``RESULT <max abs error of output> <of gradients> <kernels>``;
then the same site with nothing annotated (placed at partitioning) and prints
``DEFERRED <errors> <placement> <partitioner's decisions> <all-gathers>``.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flashpass  # noqa: E402
from flashpass import placement  # noqa: E402


def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def main():
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P(None, "seq"))
    shape = (2, 64, 2, 16)
    full = [np.random.default_rng(i).standard_normal(shape).astype(np.float32) for i in range(3)]
    args = [jax.make_array_from_callback(shape, sharding, lambda idx, x=x: x[idx]) for x in full]

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) ** 2)

    def constrained(q, k, v):  # Auto axes: the program says how q/k/v are laid out
        q, k, v = (jax.lax.with_sharding_constraint(x, sharding) for x in (q, k, v))
        return attention(q, k, v)

    opt = flashpass.optimize(constrained, kernel="blockwise")
    out = opt(*args)
    report = opt.reports[-1]
    kernels = ",".join(f"{r.kernel}[{r.ring_steps}]" for r in report.rewrites) or "none"
    grads = jax.jit(jax.grad(loss(opt), argnums=(0, 1, 2)))(*args)
    ref_out = attention(*[jnp.asarray(x) for x in full])
    ref_grads = jax.grad(loss(attention), argnums=(0, 1, 2))(*[jnp.asarray(x) for x in full])

    def local_error(a, ref):
        worst = 0.0
        for shard in a.addressable_shards:
            worst = max(worst, float(np.max(np.abs(np.asarray(shard.data) - ref[shard.index]))))
        return worst

    out_err = local_error(out, np.asarray(ref_out))
    grad_err = max(local_error(g, np.asarray(r)) for g, r in zip(grads, ref_grads, strict=True))
    print(f"RESULT {out_err:.3e} {grad_err:.3e} {kernels.replace(' ', '_')}", flush=True)

    # The same program with nothing annotated: placed at partitioning.
    plain = flashpass.optimize(attention, kernel="blockwise")
    placement.clear_decisions()
    out = jax.jit(plain)(*args)
    where = ",".join(r.placement for r in plain.reports[-1].rewrites).replace(" ", "_")
    compiled = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2))).lower(*args).compile()
    grads = compiled(*args)
    gathers = compiled.as_text().count(" all-gather(") + compiled.as_text().count(
        "all-gather-start("
    )
    how = "|".join(sorted({d.how for d in placement.decisions()})).replace(" ", "_")
    out_err = local_error(out, np.asarray(ref_out))
    grad_err = max(local_error(g, np.asarray(r)) for g, r in zip(grads, ref_grads, strict=True))
    print(f"DEFERRED {out_err:.3e} {grad_err:.3e} {where} {how} {gathers}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
