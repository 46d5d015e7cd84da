"""Helpers of the multi-device tests: meshes, sharded inputs, and one compiled
program per (function, inputs) giving the output, the gradients and the HLO."""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

#: Collectives that move q/k/v (or sequence) data between devices.
MOVING = ("all-gather", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (.*?) "
    r"(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)(?:-start)?\(",
    re.MULTILINE,
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
F32_TOL = 2e-5  # observed <= 3e-6 (blockwise, pallas_tpu vs the float32 original)


def mesh(shape, names, *, explicit=True):
    """A mesh on the first ``prod(shape)`` devices (Explicit axes by default)."""
    n = int(np.prod(shape))
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, (kind,) * len(shape), devices=jax.devices()[:n])


def normal(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def put(mesh_, spec, x):
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh_, spec))


def collectives(hlo: str) -> collections.Counter:
    """``(kind, dtype, elements)`` of every array a collective of a compiled HLO
    module moves (a combined all-reduce of a tuple counts each element; sizes,
    not shapes: XLA may squeeze size-1 axes differently in two programs)."""
    found = collections.Counter()
    for m in _COLLECTIVE.finditer(hlo):
        for dtype, dims in _ARRAY.findall(m.group(1)):
            size = int(np.prod([int(d) for d in dims.split(",") if d]))
            found[(m.group(2), dtype, size)] += 1
    return found


@dataclasses.dataclass
class Run:
    out: jax.Array
    grads: tuple
    hlo: str

    @property
    def collectives(self) -> collections.Counter:
        return collectives(self.hlo)


def run(fn, args, argnums=(0, 1, 2)) -> Run:
    """``fn(*args)`` and the gradient of ``0.5 * sum(fn(*args) ** 2)`` w.r.t.
    ``argnums``, from one jitted program (whose compiled HLO is kept)."""

    def program(*a):
        def f(*diff):
            full = list(a)
            for i, x in zip(argnums, diff, strict=True):
                full[i] = x
            return fn(*full)

        out, vjp = jax.vjp(f, *(a[i] for i in argnums))
        return out, vjp(out)

    compiled = jax.jit(program).lower(*args).compile()
    out, grads = compiled(*args)
    return Run(out, tuple(grads), compiled.as_text())


def assert_close(a, b, tol=F32_TOL):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    scale = max(1.0, float(np.max(np.abs(b))))
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)


def assert_like_original(opt: Run, orig: Run, ref: Run):
    """Numerics of the optimized program equal the unsharded original's
    (``ref``); output and gradient shardings equal the sharded original's;
    no collective is added (in particular none that moves q/k/v or a sequence)."""
    assert_close(opt.out, ref.out)
    for g, r in zip(opt.grads, ref.grads, strict=True):
        assert_close(g, r)
    for a, b in zip((opt.out, *opt.grads), (orig.out, *orig.grads), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    added = opt.collectives - orig.collectives
    assert not added, f"collectives added by the rewrite: {dict(added)}"


def unsharded(args):
    """The arguments as plain single-device arrays."""
    return [jnp.asarray(np.asarray(a)) for a in args]


__all__ = ["MOVING", "P", "Run", "assert_like_original", "mesh", "normal", "put", "run"]
