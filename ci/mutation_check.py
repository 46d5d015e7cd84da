"""Mutation check: do the kernel tests fail when a kernel is wrong?

For each kernel under test and each mutation below, runs that kernel's tests
in a pytest subprocess with the kernel's ``apply`` wrapped to be wrong in one
way, and reports the first test that fails.  A mutation no test notices is a
hole in the suite: the script then exits 1.

Mutations (`MUTATIONS`), each at the kernel's entry point, so the oracle
(`reference_attention`, or a test's own dense attention) stays right:

* ``kv_length``: every kv length of 2 or more read one too long (the subtle
  case: one key among many; lengths 0 and 1 are left alone);
* ``drop_mask``: the first mask op (causal, window, chunk, prefix, segment
  ids, boolean mask, kv lengths) dropped from the spec;
* ``swap_batch``: batch entries 0 and 1 of the output swapped.

A kernel that takes no kv lengths (or no masks) cannot read them wrong: that
pair is reported ``n/a``, not run.

Two more mutations (`PASS_MUTATIONS`) break the pass's own machinery around
every kernel, each against the tests of the README's default set that must
notice it:

* ``empty_rows:second_call``: `flashpass.kernels.empty_rows.apply` runs the
  descriptors' call only, never the second call (the fill added to every
  score) for the rows an additive mask leaves with no key;
* ``ring:skip_step``: each device's ring skips step 1 (the K/V block of its
  neighbour), a step it must run, in the forward and the backward
  (`RingStep.visible` says the block holds no key the queries see); run on
  the 8 simulated devices of the sharding session.

    python ci/mutation_check.py                 # every kernel, every mutation
    python ci/mutation_check.py paged_tpu       # one kernel
    python ci/mutation_check.py splash:drop_mask
    python ci/mutation_check.py ring:skip_step

As a pytest plugin (``-p mutation_check`` with ci/ on the path), this module
applies the mutation named by ``FLASHPASS_MUTATION`` (``kernel:mutation``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = "FLASHPASS_MUTATION"

#: kernel name -> (module, class, the tests that run it); -x stops at the
#: first failure, so a caught mutation costs one test's time.
KERNELS = {
    "blockwise": (
        "flashpass.kernels.blockwise",
        "BlockwiseKernel",
        ["tests/test_decode.py", "tests/kernels/test_blockwise.py"],
    ),
    "paged_tpu": (
        "flashpass.kernels.paged_tpu",
        "PagedTpuKernel",
        ["tests/kernels/test_paged_tpu.py"],
    ),
    "pallas_tpu": (
        "flashpass.kernels.pallas_tpu",
        "PallasTpuKernel",
        ["tests/kernels/test_pallas_tpu.py"],
    ),
    "splash": ("flashpass.kernels.splash", "SplashKernel", ["tests/kernels/test_splash.py"]),
}

#: The spec ops that mask keys (`drop_mask` drops the first).
MASK_OPS = ("Causal", "Window", "Chunk", "Prefix", "Segments", "Mask", "KvLengths")
#: Descriptors (`Kernel.descriptors`) of which a kernel must declare one for
#: the mutation to apply (None: every kernel).
NEEDS = {
    "kv_length": {"kv_lengths"},
    "drop_mask": {"causal", "mask", "key_mask", "window", "chunk", "prefix", "segments"}
    | {"kv_lengths"},
    "swap_batch": None,
}


def _mask_ops(spec):
    return [op for op in spec.score_ops if type(op).__name__ in MASK_OPS]


def _declines(kernel, spec) -> bool:
    """Whether the kernel rejects ``spec`` (a test of its reasons): left as is."""
    reasons = getattr(kernel, "spec_reasons", None)
    return bool(reasons and reasons(spec))


def _kv_length(apply):
    import jax.numpy as jnp

    from flashpass.spec import KvLengths

    def mutated(self, spec, q, k, v, extras=(), **kw):
        if _declines(self, spec):
            return apply(self, spec, q, k, v, extras, **kw)
        extras = list(extras)
        for i in {op.index for op in spec.ops_of(KvLengths)}:
            lengths = extras[i]
            extras[i] = jnp.where(lengths >= 2, lengths + 1, lengths).astype(lengths.dtype)
        return apply(self, spec, q, k, v, tuple(extras), **kw)

    return mutated


def _drop_mask(apply):
    def mutated(self, spec, q, k, v, extras=(), **kw):
        masks = _mask_ops(spec)
        if masks and not _declines(self, spec):
            ops = list(spec.score_ops)
            ops.remove(masks[0])
            spec = dataclasses.replace(spec, score_ops=tuple(ops))
        return apply(self, spec, q, k, v, extras, **kw)

    return mutated


def _swap_batch(apply):
    import jax.numpy as jnp

    def mutated(self, spec, q, k, v, extras=(), **kw):
        out = apply(self, spec, q, k, v, extras, **kw)
        if out.shape[0] < 2:
            return out
        order = jnp.asarray([1, 0, *range(2, out.shape[0])])
        return jnp.take(out, order, axis=0)

    return mutated


MUTATIONS = {"kv_length": _kv_length, "drop_mask": _drop_mask, "swap_batch": _swap_batch}


def _no_second_call(apply):
    from flashpass.kernels import empty_rows

    def mutated(kernel, spec, q, k, v, extras=(), *, interpret=False):
        parts = empty_rows.split(spec)
        if parts is None:
            return apply(kernel, spec, q, k, v, extras, interpret=interpret)
        return kernel.apply(parts.masked, q, k, v, extras, interpret=interpret)

    return mutated


def _skip_step(visible):
    import jax.numpy as jnp
    from jax import lax

    def mutated(self, q0, k0, extras):
        if self.n < 2:
            return visible(self, q0, k0, extras)
        neighbour = (lax.axis_index(self.axis_name) - 1) % self.n  # step 1's block
        return visible(self, q0, k0, extras) & jnp.not_equal(k0, neighbour * self.spec.kv_len)

    return mutated


#: ``target:mutation`` -> (module, attribute, wrapper, the tests that must
#: notice, extra environment): mutations of the pass around the kernels.
PASS_MUTATIONS = {
    "empty_rows:second_call": (
        "flashpass.kernels.empty_rows",
        "apply",
        _no_second_call,
        ["tests/kernels/test_empty_rows.py", "tests/test_library_masks.py"],
        {},
    ),
    "ring:skip_step": (
        "flashpass.ring.step",
        "RingStep.visible",
        _skip_step,
        ["tests/sharding/multidevice/test_ring.py"],
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"},
    ),
}


def _applies(kernel: str, mutation: str) -> bool:
    import importlib

    module, cls, _ = KERNELS[kernel]
    declared = getattr(importlib.import_module(module), cls).descriptors
    return NEEDS[mutation] is None or bool(NEEDS[mutation] & declared)


# ------------------------------------------------------------------- the plugin


def pytest_configure(config):
    """Apply ``FLASHPASS_MUTATION`` (``kernel:mutation``) before tests import."""
    import importlib

    if os.environ[ENV] in PASS_MUTATIONS:
        module, attribute, wrapper, _, _ = PASS_MUTATIONS[os.environ[ENV]]
        owner = importlib.import_module(module)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, wrapper(getattr(owner, name)))
        return
    kernel, mutation = os.environ[ENV].split(":")
    module, cls, _ = KERNELS[kernel]
    klass = getattr(importlib.import_module(module), cls)
    klass.apply = MUTATIONS[mutation](klass.apply)


# ------------------------------------------------------------------- the driver


def run(kernel: str, mutation: str, timeout: int = 900) -> tuple[str, str, float]:
    """``(verdict, detail, seconds)``: 'killed' and the first failing test, or
    'SURVIVED'."""
    env = dict(os.environ)
    env[ENV] = f"{kernel}:{mutation}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ci"), env.get("PYTHONPATH")]))
    if env[ENV] in PASS_MUTATIONS:
        *_, tests, extra = PASS_MUTATIONS[env[ENV]]
        env.update(extra)
    else:
        tests = KERNELS[kernel][2]
    # (The default set only: a mutation must fail a test of `python -m pytest -q`.)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "no:cacheprovider"]
    cmd += ["-m", "not slow", "-p", "mutation_check", *tests]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - start
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    if proc.returncode == 1 and failed:
        why = " ".join(re.findall(r"^E +(\S.*)$", proc.stdout, re.MULTILINE)[:3])
        return "killed", failed[0] + (f"\n    {why[:200]}" if why else ""), seconds
    if proc.returncode == 0:
        return "SURVIVED", "every test passed", seconds
    return (
        "ERROR",
        f"pytest exit {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}",
        seconds,
    )


def main(argv: list[str]) -> int:
    pairs = [(k, m) for k in KERNELS for m in MUTATIONS]
    pairs += [tuple(name.split(":")) for name in PASS_MUTATIONS]
    if argv:  # kernels (or empty_rows, ring), or kernel:mutation pairs
        pairs = [(k, m) for k, m in pairs if k in argv or f"{k}:{m}" in argv]
    survived = 0
    for kernel, mutation in pairs:
        if f"{kernel}:{mutation}" not in PASS_MUTATIONS and not _applies(kernel, mutation):
            print(f"{kernel:10s} {mutation:10s} n/a (the kernel declares no such input)")
            continue
        verdict, detail, seconds = run(kernel, mutation)
        print(f"{kernel:10s} {mutation:10s} {verdict} ({seconds:.0f} s): {detail}", flush=True)
        survived += verdict != "killed"
    print(
        "mutation check:",
        "every mutation fails a test" if not survived else f"{survived} not caught",
    )
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
