"""Kernel calls as the pass emits them: a ``jit`` named ``flashpass_<kernel>``.

Shared by kernel selection (which probes the call) and rewriting (which
stages it), so neither stage imports the other.  The name makes the call
visible in printed jaxprs, HLO and profiler traces, and lets the view treat
the pass's own output as opaque (`graph.is_kernel_call`).
"""

from __future__ import annotations

import collections
import threading
import typing

import jax

from flashpass.kernels import combine

from .graph import KERNEL_PREFIX

__all__ = ["KERNEL_PREFIX", "kernel_call"]


class _KernelCalls:
    """``kernel_call(kernel, spec, interpret, kv_layout)``: a jitted, named call
    of ``kernel`` for ``spec`` (``flashpass_<name>``), k and v in ``kv_layout``
    (one of the kernel's `Kernel.kv_layouts`).

    Cached, so identical sites (every layer of a model) share one ``jit`` and
    its trace cache: the kernel is traced once, not once per layer.  The cache
    is an LRU of `MAX_SIZE` specs; an evicted call's ``jit`` caches are cleared,
    so serving many shapes does not keep every shape's kernel traces alive.
    """

    MAX_SIZE = 64

    def __init__(self):
        self._calls: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, kernel, spec, interpret: bool, kv_layout: str = "bhsd"):
        key = (kernel, spec, interpret, kv_layout)
        with self._lock:
            found = self._calls.get(key)
            if found is not None:
                self._calls.move_to_end(key)
                return found
            found = self._calls[key] = _make(kernel, spec, interpret, kv_layout)
            while len(self._calls) > self.MAX_SIZE:
                _, evicted = self._calls.popitem(last=False)
                evicted.clear_cache()
            return found

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self.MAX_SIZE, len(self._calls))

    def cache_clear(self) -> None:
        with self._lock:
            for call in self._calls.values():
                call.clear_cache()
            self._calls.clear()


class CacheInfo(typing.NamedTuple):
    maxsize: int
    currsize: int


def _make(kernel, spec, interpret: bool, kv_layout: str):
    def call(q, k, v, *extras):
        return combine.apply(
            kernel, spec, q, k, v, extras, interpret=interpret, kv_layout=kv_layout
        )

    call.__name__ = call.__qualname__ = f"{KERNEL_PREFIX}{kernel.name}"
    return jax.jit(call)


kernel_call = _KernelCalls()
