"""One platform vocabulary for both front ends.

``flashpass.optimize(platform=...)`` chooses a *kernel family*: ``"cpu"``,
``"gpu"`` or ``"tpu"`` (the GPU kernels serve NVIDIA and AMD alike, each
kernel declining what its hardware lacks).  ``flashpass.export`` and
``python -m flashpass`` name *lowering platforms*, as ``jax.export`` does:
``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"`` (an artifact lowered for CUDA
does not run on ROCm).  Each front end accepts the other's spellings:

* ``optimize(platform="cuda")`` and ``platform="rocm"`` mean ``"gpu"``;
* ``--platform gpu`` (``platforms=("gpu",)``) means the artifact's GPU
  platform (``cuda`` or ``rocm``, whichever it has), else this host's GPU
  backend; where neither says which, it is an error naming both.
"""

from __future__ import annotations

#: The kernel families `flashpass.optimize` takes (``platform=``).
KERNEL_PLATFORMS = ("cpu", "gpu", "tpu")
#: The lowering platforms of `jax.export` (``--platform`` and ``platforms=``).
EXPORT_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
#: Lowering platform -> kernel family.
KERNEL_PLATFORM_OF = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
_GPU_BACKENDS = ("cuda", "rocm")


def kernel_platform(name) -> str:
    """``name`` as a kernel family (``"cuda"``/``"rocm"`` are ``"gpu"``), or a
    ValueError listing the names."""
    if isinstance(name, str) and name in KERNEL_PLATFORM_OF:
        return KERNEL_PLATFORM_OF[name]
    if isinstance(name, str) and name in KERNEL_PLATFORMS:
        return name
    raise ValueError(
        f"platform must be one of {KERNEL_PLATFORMS} or None (aliases: 'cuda' and 'rocm' "
        f"for 'gpu'), got {name!r}"
    )


def export_platform(name, artifact=(), host: str | None = None) -> str:
    """``name`` as a lowering platform: ``"gpu"`` resolves to the one GPU
    platform of ``artifact`` (its platforms), else to ``host`` (JAX's default
    backend) when that is a GPU; anything else is a ValueError saying why."""
    if isinstance(name, str) and name in EXPORT_PLATFORMS:
        return name
    if name == "gpu":
        gpus = [p for p in artifact if p in _GPU_BACKENDS]
        if len(gpus) == 1:
            return gpus[0]
        if not gpus and host in _GPU_BACKENDS:
            return host
        why = "the artifact has both" if gpus else "neither the artifact nor this host says which"
        raise ValueError(f"platform 'gpu' is ambiguous here ({why}): name 'cuda' or 'rocm'")
    raise ValueError(
        f"unknown platform {name!r}; known: {', '.join(EXPORT_PLATFORMS)} (and 'gpu' for "
        "the artifact's cuda or rocm)"
    )
