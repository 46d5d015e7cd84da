"""Kernel calls as the pass emits them: a ``jit`` named ``flashpass_<kernel>``.

Shared by kernel selection (which probes the call) and rewriting (which
stages it), so neither stage imports the other.  The name makes the call
visible in printed jaxprs, HLO and profiler traces, and lets the view treat
the pass's own output as opaque (`graph.is_kernel_call`).
"""

from __future__ import annotations

import functools

import jax

from .graph import KERNEL_PREFIX

__all__ = ["KERNEL_PREFIX", "kernel_call"]


@functools.lru_cache(maxsize=256)
def kernel_call(kernel, spec, interpret: bool):
    """A jitted, named call of ``kernel`` for ``spec``: ``flashpass_<name>``.

    Cached, so identical sites (every layer of a model) share one ``jit`` and
    its trace cache: the kernel is traced once, not once per layer.
    """

    def call(q, k, v, *extras):
        return kernel.apply(spec, q, k, v, extras, interpret=interpret)

    call.__name__ = call.__qualname__ = f"{KERNEL_PREFIX}{kernel.name}"
    return jax.jit(call)
