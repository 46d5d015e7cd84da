"""A platform guard: an identity whose lowering refuses the wrong platform.

A program optimized for another platform (``optimize(fn, platform="gpu")``)
may hold kernels that cannot be lowered on this host; JAX's own error then
names neither flashpass nor ``platform=``.  The guard sits on the program's
first input: lowered for a platform its kernels run on it is the identity,
for any other it raises the caller's error first.  Lowering, not tracing,
decides, so cross-lowering (``jax.export(..., platforms=["tpu"])`` on a CPU
host) still works.  It uses ``jax.extend.core.Primitive`` and the
``jax.interpreters`` registries (``mlir``, ``ad``, ``batching``).
"""

from __future__ import annotations

import functools

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

guard_p = Primitive("flashpass_platform_guard")

#: JAX lowering platform -> flashpass platform name.
_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def platform_guard(x, runs_on: tuple, error):
    """``x``, refusing to be lowered for a platform not in ``runs_on``
    (``"cpu"``, ``"gpu"``, ``"tpu"``): there ``error(platform)``, an
    exception, is raised.  ``error`` must be hashable (an equation parameter)."""
    return guard_p.bind(x, runs_on=tuple(runs_on), error=error)


def _lower(platform, ctx, x, *, runs_on, error):
    if _PLATFORMS[platform] not in runs_on:
        raise error(_PLATFORMS[platform])
    return [x]


def _jvp(primals, tangents, **params):
    return guard_p.bind(*primals, **params), tangents[0]


def _batch(args, dims, **params):
    return guard_p.bind(*args, **params), dims[0]


guard_p.def_impl(lambda x, **_: x)
guard_p.def_abstract_eval(lambda x, **_: x)
ad.primitive_jvps[guard_p] = _jvp
batching.primitive_batchers[guard_p] = _batch
for _name in _PLATFORMS:
    mlir.register_lowering(guard_p, functools.partial(_lower, _name), platform=_name)
