"""Choosing a kernel per site: ordered, constraint-checked, probe-lowered.

Each kernel in the order is asked `check(spec, ctx)` (static, explains
itself); the first that accepts is probed once per (kernel, spec, interpret):
its call is traced (the output must have the promised shape and dtype) and,
on the platform it will run on, lowered.  Any exception there rejects the
kernel with the error as the reason — never a crash.  A ring step's spec
(``step=True``) is asked the kernel's `Kernel.step_reasons` too, and its
probe traces the kernel's step forward and backward.
"""

from __future__ import annotations

import collections
import dataclasses

import jax

from flashpass.kernels import (
    CheckContext,
    Kernel,
    default_order,
    empty_rows,
    get_kernel,
    kernel_names,
)
from flashpass.kernels.dropout import dropout_reasons

from . import compat
from .calls import kernel_call

#: (kernel name, id(kernel), spec, interpret, platform) -> error string or None
_PROBES: collections.OrderedDict = collections.OrderedDict()
_PROBE_LIMIT = 512


@dataclasses.dataclass(frozen=True, eq=False)
class PlannedSite:
    """A matched site and the kernel chosen for it (stage 4's result)."""

    site: object  # AttentionSite
    kernel: object  # kernels.Kernel
    interpret: bool = False
    rejected: dict = dataclasses.field(default_factory=dict)  # kernels tried first -> reasons


def resolve_order(kernel, platform: str) -> tuple[list[Kernel], bool]:
    """Kernels to try and whether the user named them explicitly."""
    if kernel is None:
        return [get_kernel(n) for n in default_order(platform)], False
    names = [kernel] if isinstance(kernel, str | Kernel) else kernel
    if not isinstance(names, list | tuple) or not all(isinstance(n, str | Kernel) for n in names):
        raise TypeError(
            "kernel= takes a kernel name, a Kernel instance or a list of them (known names: "
            f"{', '.join(kernel_names())}); got {kernel!r}"
        )
    if not names:
        raise ValueError("kernel=... must name at least one kernel")
    return [get_kernel(n) for n in names], True


def choose(spec, kernels: list[Kernel], ctx: CheckContext, step: bool = False):
    """(kernel, rejections): the first kernel that accepts ``spec``, or None.
    ``step``: ``spec`` is one step of a ring (`flashpass.ring.cases`)."""
    rejections: dict[str, list[str]] = {}
    for kernel in kernels:
        if spec.dropout is not None and not kernel.dropout:
            rejections[kernel.name] = dropout_reasons(spec, kernel)
            continue
        try:
            reasons = empty_rows.check(kernel, spec, ctx)
            if step:
                reasons += list(kernel.step_reasons(spec))
        except Exception as err:
            reasons = [f"check() raised {type(err).__name__}: {err}"]
        if not reasons:
            error = probe(kernel, spec, ctx, step)
            if error is None:
                return kernel, rejections
            reasons = [error]
        rejections[kernel.name] = reasons
    return None, rejections


def probe(kernel: Kernel, spec, ctx: CheckContext, step: bool = False) -> str | None:
    """Trace (and, on its own platform, lower) the kernel call for ``spec``;
    with ``step``, trace its ring step forward and backward."""
    key = (kernel.name, id(kernel), spec, ctx.interpret, ctx.platform, step)
    if key in _PROBES:
        _PROBES.move_to_end(key)
        return _PROBES[key]
    error = (_probe_step if step else _probe)(kernel, spec, ctx)
    _PROBES[key] = error
    if len(_PROBES) > _PROBE_LIMIT:
        _PROBES.popitem(last=False)
    return error


def _probe(kernel: Kernel, spec, ctx: CheckContext) -> str | None:
    args = _operands(spec)
    call = kernel_call(kernel, spec, ctx.interpret)
    try:
        # Probed on its own, whatever trace or mesh the pass runs under.
        with compat.outside_mesh():
            out = jax.eval_shape(call, *args)
            if tuple(out.shape) != spec.out_shape or out.dtype != spec.out_dtype:
                return (
                    f"returned {out.dtype}{list(out.shape)}, expected "
                    f"{spec.out_dtype}{list(spec.out_shape)}"
                )
            # Plain JAX lowers wherever it traces; lowering it here would only
            # fill JAX's caches with one module per served shape.
            if ctx.platform == current_platform() and not kernel.plain_jax:
                call.lower(*args)
    except Exception as err:  # the kernel failed: the site falls back
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"raised {type(err).__name__} while tracing/lowering: {message}"[:500]
    return None


def _probe_step(kernel: Kernel, spec, ctx: CheckContext) -> str | None:
    q, k, v, *extras = _operands(spec)
    rows = jax.ShapeDtypeStruct(spec.q_shape[:3], "float32")
    out = jax.ShapeDtypeStruct(spec.out_shape, spec.out_dtype)
    wanted = tuple(False for _ in extras)

    def step(q, k, v, extras, out, m, den, dout):
        fwd = kernel.step_forward(spec, q, k, v, extras, interpret=ctx.interpret)
        bwd = kernel.step_backward(
            spec, q, k, v, extras, out, m, den, dout, wanted, interpret=ctx.interpret
        )
        return fwd, bwd

    try:
        with compat.outside_mesh():
            (o, m, den), _ = jax.eval_shape(step, q, k, v, tuple(extras), out, rows, rows, out)
            if tuple(o.shape) != spec.out_shape or (m.shape, den.shape) != (rows.shape,) * 2:
                return f"its ring step returned {list(o.shape)}, expected {list(spec.out_shape)}"
    except Exception as err:  # the step kernel failed: the case runs plain JAX
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"raised {type(err).__name__} while tracing a ring step: {message}"[:500]
    return None


def _operands(spec) -> list:
    return [
        jax.ShapeDtypeStruct(spec.q_shape, spec.q_dtype),
        jax.ShapeDtypeStruct(spec.k_shape, spec.k_dtype),
        jax.ShapeDtypeStruct(spec.v_shape, spec.v_dtype),
        *[jax.ShapeDtypeStruct(e.shape, e.dtype) for e in spec.extras],
    ]


def current_platform() -> str:
    """ "cpu", "gpu" or "tpu" for JAX's default backend."""
    backend = jax.default_backend()
    return {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend)


def clear_probe_cache() -> None:
    _PROBES.clear()
