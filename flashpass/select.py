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
import math

import jax

from flashpass.kernels import (
    CheckContext,
    Kernel,
    combine,
    default_order,
    get_kernel,
    kernel_names,
)
from flashpass.kernels.dropout import dropout_reasons

from . import compat
from .calls import kernel_call

#: (kernel name, id(kernel), spec, interpret, platform, step) -> (error string or
#: None, `materialises`' note or None)
_PROBES: collections.OrderedDict = collections.OrderedDict()
_PROBE_LIMIT = 512


@dataclasses.dataclass(frozen=True, eq=False)
class PlannedSite:
    """A matched site and the kernel chosen for it (stage 4's result)."""

    site: object  # AttentionSite
    kernel: object  # kernels.Kernel
    interpret: bool = False
    rejected: dict = dataclasses.field(default_factory=dict)  # kernels tried first -> reasons
    notes: tuple = ()  # e.g. that the kernel materialises T×S (`materialises`)


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
    ``step``: ``spec`` is one step of a ring (`flashpass.ring.cases`).

    Unless the user named the kernels (``ctx.explicit``), a kernel that would
    build a ``T x S`` array from the site's O(T) data (`materialises`) is
    passed over for a later one that takes the site in O(T), with the reason
    "materialises T×S"; it still runs the site when no later kernel does."""
    rejections: dict[str, list[str]] = {}
    fallback = None  # (kernel, rejections before it): the first that materialises
    for kernel in kernels:
        if spec.dropout is not None and not kernel.dropout:
            rejections[kernel.name] = dropout_reasons(spec, kernel)
            continue
        try:
            reasons = combine.check(kernel, spec, ctx)
            if step:
                reasons += list(kernel.step_reasons(spec))
        except Exception as err:
            reasons = [f"check() raised {type(err).__name__}: {err}"]
        if not reasons:
            error = probe(kernel, spec, ctx, step)
            if error is None:
                note = None if ctx.explicit or step else materialises(kernel, spec, ctx)
                if note is None:
                    return kernel, rejections
                if fallback is None:
                    fallback = (kernel, dict(rejections))
                reasons = [f"{note}; passed over for a kernel that takes the site in O(T)"]
            else:
                reasons = [error]
        rejections[kernel.name] = reasons
    if fallback is not None:
        return fallback
    return None, rejections


#: Sequences shorter than this are not judged by `materialises`: a tile of a
#: flash kernel is that large anyway.
MATERIALISE_MIN_LEN = 128


def materialises(kernel: Kernel, spec, ctx: CheckContext) -> str | None:
    """``"<kernel> materialises T×S: ..."`` when the kernel's call for ``spec``
    (its forward, outside Pallas kernels and loop bodies, whose arrays are
    tiles) holds an array of at least ``T x S`` elements with two axes of at
    least ``min(T, S)``, while no operand of the site is that large; else None.
    Read from the probe's trace (`probe`), so it costs nothing more."""
    if probe(kernel, spec, ctx) is not None:
        return None
    return _PROBES[_probe_key(kernel, spec, ctx, False)][1]


def probe(kernel: Kernel, spec, ctx: CheckContext, step: bool = False) -> str | None:
    """Trace (and, on its own platform, lower) the kernel call for ``spec``;
    with ``step``, trace its ring step forward and backward."""
    key = _probe_key(kernel, spec, ctx, step)
    if key in _PROBES:
        _PROBES.move_to_end(key)
        return _PROBES[key][0]
    _PROBES[key] = (_probe_step(kernel, spec, ctx), None) if step else _probe(kernel, spec, ctx)
    if len(_PROBES) > _PROBE_LIMIT:
        _PROBES.popitem(last=False)
    return _PROBES[key][0]


def _probe_key(kernel: Kernel, spec, ctx: CheckContext, step: bool):
    return (kernel.name, id(kernel), spec, ctx.interpret, ctx.platform, step)


def _probe(kernel: Kernel, spec, ctx: CheckContext) -> tuple[str | None, str | None]:
    """``(error, materialises note)`` of the kernel call for ``spec``."""
    args = _operands(spec)
    call = kernel_call(kernel, spec, ctx.interpret)
    note = None
    try:
        # Probed on its own, whatever trace or mesh the pass runs under.
        with compat.outside_mesh():
            closed, out = jax.make_jaxpr(call, return_shape=True)(*args)
            note = _materialised_note(kernel, spec, closed, ctx.interpret)
            if tuple(out.shape) != spec.out_shape or out.dtype != spec.out_dtype:
                error = (
                    f"returned {out.dtype}{list(out.shape)}, expected "
                    f"{spec.out_dtype}{list(spec.out_shape)}"
                )
                return error, None
            # Plain JAX lowers wherever it traces; lowering it here would only
            # fill JAX's caches with one module per served shape.
            if ctx.platform == current_platform() and not kernel.plain_jax:
                call.lower(*args)
    except Exception as err:  # the kernel failed: the site falls back
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"raised {type(err).__name__} while tracing/lowering: {message}"[:500], None
    return None, note


#: Primitives whose bodies hold tiles, not whole arrays (`materialises`).
_TILED = frozenset({"pallas_call", "while", "scan"})

#: Primitives that hold a kernel's differentiable core (its `custom_vjp`): the
#: arrays inside are the kernel's own work (one tile where a short sequence
#: fits one); an operand built for it from O(T) data is built outside.
_CORE = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call"})


def _is_t_by_s(shape, t: int, s: int) -> bool:
    """Whether an array of ``shape`` could hold a ``T x S`` score matrix:
    at least ``T * S`` elements and two axes of at least ``min(T, S)``."""
    short = min(t, s)
    return math.prod(shape) >= t * s and sum(d >= short for d in shape) >= 2


def _materialised_note(kernel: Kernel, spec, closed, interpret: bool) -> str | None:
    t, s = spec.q_len, spec.kv_len
    if min(t, s) < MATERIALISE_MIN_LEN or max(spec.head_dim, spec.v_head_dim) >= min(t, s):
        return None
    if any(_is_t_by_s(e.shape, t, s) for e in spec.extras):
        return None  # the site's own operand is T x S already
    parts = combine.parts(spec)
    if parts is not None:
        # The kernel's own calls, not the combinator's work around them (the
        # empty rows' key chunks may span a short sequence).
        for part in parts:
            call = kernel_call(kernel, part, interpret)
            note = _materialised_note(
                kernel, part, jax.make_jaxpr(call)(*_operands(part)), interpret
            )
            if note is not None:
                return note
        return None
    # q, k and v are the call's first three operands: an array computed from
    # them (scores, probabilities) is the kernel's own work, a tile when the
    # sequence fits one; what is flagged is built from the O(T) data alone.
    shape = _operand_built(
        closed.jaxpr, [True] * 3 + [False] * (len(closed.jaxpr.invars) - 3), t, s
    )
    if shape is None:
        return None
    return f"{kernel.name} materialises T×S: it builds a {shape} array from the site's O(T) data"


def _operand_built(jaxpr, from_qkv: list[bool], t: int, s: int) -> str | None:
    """``dtype[shape]`` of the first array of ``jaxpr`` (or of a body it calls,
    outside Pallas kernels and loop bodies, whose arrays are tiles) that could
    hold a ``T x S`` matrix and does not depend on q, k or v (``from_qkv``
    marks the invars that do); None if there is none."""
    derived = {v for v, flag in zip(jaxpr.invars, from_qkv, strict=True) if flag}
    for eqn in jaxpr.eqns:
        ins = [not hasattr(x, "val") and x in derived for x in eqn.invars]
        if eqn.primitive.name not in _TILED | _CORE:
            for body in compat.subjaxprs_of_params(eqn.params):
                body = getattr(body, "jaxpr", body)
                # Operands map onto a body's inputs one to one (jit, custom
                # derivatives); otherwise (cond, ...) any input taints them all.
                flags = ins if len(body.invars) == len(ins) else [any(ins)] * len(body.invars)
                found = _operand_built(body, flags, t, s)
                if found is not None:
                    return found
        for var in eqn.outvars:
            if any(ins):
                derived.add(var)
                continue
            shape = tuple(getattr(var.aval, "shape", ()))
            if _is_t_by_s(shape, t, s):
                return f"{getattr(var.aval, 'dtype', '')}{list(shape)}"
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
