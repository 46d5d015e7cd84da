"""The path the traced program takes through the pass: stops, modules, returns.

Runs the pass on one program (the README's causal attention, first called
under ``jax.jit``: every stage runs, placement included) with a profiler hook
that records each call, inside ``flashpass`` (patterns and kernels included),
of a function handed the program or what the pass derived from it: the
``ClosedJaxpr``, a scope of the view (`flashpass.graph.Scope`), a site
(`AttentionSite`), a planned or placed site.  A *stop* is such a function that
is handed it from another module and passes it on (calls another such
function): a hand-off between modules, counted once, in the order first
called.  Helpers that only read it (a scope's ``shape``, a site's
``atoms``), methods of its own objects, and calls within one module are not
stops.  A *return* is a stop in a module the path had already left.  Kernel
bodies and the traced user function are not stops (they receive arrays, not
the program), nor is anything handed only the spec (kernel selection, the
ring's step plan).

    python benchmarks/path.py            # the table and the totals
    python benchmarks/path.py --sharded  # a training step on a 2-device mesh (a ring)

This is how the redesign issue's "stops / returns" are measured; the path is
printed so a reader can check each stop.
"""

from __future__ import annotations

import argparse
import os
import sys


def _program(sharded: bool):
    """The README's causal attention and its arguments.  ``sharded``: q, k and
    v sharded along the sequence on a 2-device mesh (Explicit axes), k and v
    gathered by the program, and the value with its gradient (a training
    step): stage 5 places a ring, whose backward matching proved."""
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        if sharded:
            whole = jax.sharding.PartitionSpec()
            k, v = jax.sharding.reshard(k, whole), jax.sharding.reshard(v, whole)
        s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        t = q.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        p = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
        return jnp.einsum("bhts,bshd->bthd", p, v)

    shape = (2, 256, 4, 32)
    keys = jax.random.split(jax.random.key(0), 3)
    args = [jax.random.normal(key, shape, jnp.float32) for key in keys]
    if not sharded:
        return attention, args, None
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2,), ("seq",), (AxisType.Explicit,), devices=jax.devices()[:2])
    spec = NamedSharding(mesh, PartitionSpec(None, "seq", None, None))
    return attention, [jax.device_put(a, spec) for a in args], mesh


#: Folders under the checkout that are not the pass.
_NOT_THE_PASS = (".venv", "benchmarks", "tests", "site-packages")


def _is_program(value, kinds) -> bool:
    """``value`` is one of ``kinds``, or a list, tuple or dict holding one
    (the sites of a scope, the planned sites, scopes by prefix)."""
    if isinstance(value, dict):
        value = list(value.values())[:4]
    if isinstance(value, list | tuple):
        return any(_is_program(v, kinds) for v in value[:4])
    return isinstance(value, kinds)


def trace_path(sharded: bool = False) -> list[tuple[str, str]]:
    """The stops, in order: ``(module, function)``."""
    import jax

    import flashpass
    from flashpass.graph import Scope
    from flashpass.placement import Placed
    from flashpass.select import PlannedSite
    from flashpass.site import AttentionSite

    kinds = (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr, Scope, AttentionSite)
    kinds += (PlannedSite, Placed)
    root = os.path.dirname(os.path.dirname(os.path.abspath(flashpass.__file__)))
    fn, args, mesh = _program(sharded)
    if sharded:
        attention = fn

        def fn(*a):  # a training step: value and gradient, optimized whole
            return jax.value_and_grad(lambda *x: jax.numpy.sum(attention(*x) ** 2), (0, 1, 2))(*a)

    step = flashpass.optimize(fn, kernel="blockwise")

    order: list[tuple[str, str]] = []  # every function handed the program, first call first
    passes_on: set = set()  # those that called another
    handed: set = set()  # those called from another module (or from outside the pass)
    held = {}  # frame -> its key, for the frames handed the program

    def hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        path = os.path.abspath(code.co_filename)
        if not path.startswith(root) or any(f"/{d}/" in path for d in _NOT_THE_PASS):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        names = [n for n in names if n not in ("self", "cls")]  # (a method of the program's own)
        if not any(_is_program(frame.f_locals.get(n), kinds) for n in names):
            return
        key = (frame.f_globals.get("__name__", "?"), code.co_qualname)
        if key not in order:
            order.append(key)
        held[frame] = key
        caller = frame.f_back
        while caller is not None and caller not in held:
            caller = caller.f_back
        if caller is not None:
            passes_on.add(held[caller])
        if caller is None or held[caller][0] != key[0]:
            handed.add(key)

    sys.setprofile(hook)
    try:
        if mesh is None:
            jax.jit(step)(*args)
        else:
            with jax.set_mesh(mesh):
                jax.jit(step)(*args)
                report = step.explain(*args)
            assert report.kernels == ["ring"], str(report)
    finally:
        sys.setprofile(None)
    return [key for key in order if key in passes_on and key in handed]


def summary(stops) -> tuple[int, int, int]:
    """``(stops, modules, returns)``."""
    left, modules, returns, current = set(), [], 0, None
    for module, _ in stops:
        if module != current:
            if module in left:
                returns += 1
            if current is not None:
                left.add(current)
            current = module
            if module not in modules:
                modules.append(module)
    return len(stops), len(modules), returns


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharded", action="store_true", help="on a 2-device mesh")
    args = parser.parse_args(argv)
    if args.sharded:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        )
    stops = trace_path(args.sharded)
    for i, (module, name) in enumerate(stops, 1):
        print(f"{i:3d}  {module:40s} {name}")
    n, m, r = summary(stops)
    print(f"\n{n} stops in {m} modules, {r} returns to a module already left")


if __name__ == "__main__":
    main()
