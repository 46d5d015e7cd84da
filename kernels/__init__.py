"""Kernel adapters and the per-platform registry.

Adding a kernel is one adapter module here plus one line in `_BUILTIN` (and,
if it should be tried by default, in `DEFAULT_ORDER`).
"""

from __future__ import annotations

import importlib

from flashpass import compat
from flashpass.spec import (
    EXCLUDING_FILL,
    AttentionSpec,
    Bias,
    Causal,
    ExtraSpec,
    Mask,
    Scale,
    ScoreOp,
    Softcap,
)

from .base import CheckContext, Kernel, PlainJaxKernel

__all__ = [
    "EXCLUDING_FILL",
    "AttentionSpec",
    "Bias",
    "Causal",
    "CheckContext",
    "ExtraSpec",
    "Kernel",
    "Mask",
    "PlainJaxKernel",
    "Scale",
    "ScoreOp",
    "Softcap",
    "DEFAULT_ORDER",
    "default_order",
    "gpu_order",
    "get_kernel",
    "kernel_names",
    "register_kernel",
    "unregister_kernel",
    "BlockwiseKernel",
]

#: name -> "module:Class" of the built-in adapters, imported lazily so that a
#: kernel whose JAX module is missing only fails when it is asked for.
_BUILTIN = {
    "blockwise": "blockwise:BlockwiseKernel",
    "chunked": "chunked:ChunkedKernel",
    "cudnn": "cudnn:CudnnKernel",
    "flash_gpu": "flash_gpu:FlashGpuKernel",
    "flash_tpu": "flash_tpu:FlashTpuKernel",
    "pallas_gpu": "pallas_gpu:PallasGpuKernel",
    "paged_tpu": "paged_tpu:PagedTpuKernel",
    "pallas_tpu": "pallas_tpu:PallasTpuKernel",
    "reference": "reference:ReferenceKernel",
    "splash": "splash:SplashKernel",
    # Optional: needs the `tokamax` package (the `gpu` extra); see `gpu_order`.
    "tokamax": "tokamax:TokamaxKernel",
}


def gpu_order(triton_attention: bool, tokamax: bool) -> tuple[str, ...]:
    """The GPU default order, given whether JAX's Triton flash attention may be
    used (`flashpass.compat.TRITON_ATTENTION`: before JAX 0.11.1) and whether the
    optional tokamax package is installed.  From JAX 0.11.1 `pallas_gpu` declines
    every site (saying why) and tokamax's kernels are tried after it.  Before
    it, `flash_gpu` (our own op-protocol kernel on Pallas Triton) takes what
    cuDNN and ``pallas_gpu`` cannot, in O(T), before ``blockwise``."""
    if triton_attention:
        return ("cudnn", "pallas_gpu", "flash_gpu", "blockwise")
    if not tokamax:
        return ("cudnn", "pallas_gpu", "blockwise")
    return ("cudnn", "pallas_gpu", "tokamax", "blockwise")


#: Kernels tried, in order, when the user names none (see docs/kernels.md).
DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
    "tpu": ("paged_tpu", "splash", "flash_tpu", "pallas_tpu", "blockwise"),
    "gpu": gpu_order(compat.TRITON_ATTENTION, compat.tokamax_installed()),
    "cpu": ("blockwise",),
}

_registry: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel, *, replace: bool = False) -> Kernel:
    """Register a kernel instance under ``kernel.name`` (returns it)."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"expected a flashpass.kernels.Kernel instance, got {kernel!r}")
    if not kernel.name:
        raise ValueError("a kernel needs a non-empty `name`")
    if not replace and (kernel.name in _registry or kernel.name in _BUILTIN):
        raise ValueError(f"a kernel named {kernel.name!r} is already registered")
    _registry[kernel.name] = kernel
    return kernel


def unregister_kernel(name: str) -> None:
    """Remove a kernel registered with `register_kernel` (built-ins stay known)."""
    _registry.pop(name, None)


def kernel_names() -> list[str]:
    """All known kernel names (built-in and registered)."""
    return sorted(set(_BUILTIN) | set(_registry))


def get_kernel(name: str) -> Kernel:
    """The kernel registered as ``name``; a clear ValueError lists the known ones."""
    if isinstance(name, Kernel):
        return name
    if name in _registry:
        return _registry[name]
    if name not in _BUILTIN:
        raise ValueError(
            f"unknown flashpass kernel {name!r}; known kernels: {', '.join(kernel_names())}"
        )
    module, cls = _BUILTIN[name].split(":")
    kernel = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    _registry[name] = kernel
    return kernel


def default_order(platform: str) -> tuple[str, ...]:
    """The kernels tried by default on ``platform``."""
    return DEFAULT_ORDER.get(platform, ("blockwise",))


def __getattr__(name: str):
    """The built-in adapter classes by name (``from flashpass.kernels import
    BlockwiseKernel``), imported on first use like the kernels themselves."""
    for path in _BUILTIN.values():
        module, cls = path.split(":")
        if cls == name:
            return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
