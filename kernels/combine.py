"""A kernel call of a spec, through the combinator the spec's ops name.

Most ops are applied by the kernels themselves.  A combinator is an op no
kernel sees (`EmptyRows`): a spec holding one runs as several calls of the
same kernel, combined.  The op names the module of `flashpass.kernels` that
does that (`ScoreOp.combinator`, by name, as `_BUILTIN` names the adapters:
the op's own layer imports no kernel code), and the module offers

* ``check(kernel, spec, ctx)``: the kernel's reasons against the spec (each
  call's spec asked);
* ``parts(spec)``: the specs of the kernel calls it makes;
* ``apply(kernel, spec, q, k, v, extras, *, interpret)``: the combined calls.

The engine (kernel selection, the named kernel call) asks this module, never
a combinator by its kind, so a new combinator is its op and its module.
"""

from __future__ import annotations

import importlib


def runner(spec):
    """The module that runs ``spec``'s combinator op, or None (no op of the
    spec is one)."""
    names = {op.combinator for op in spec.ops if getattr(op, "combinator", None)}
    if not names:
        return None
    if len(names) > 1:
        raise ValueError(f"a spec holds one combinator op at most, not {sorted(names)}")
    return importlib.import_module(f"{__package__}.{names.pop()}")


def check(kernel, spec, ctx) -> list[str]:
    """``kernel.check`` of ``spec``, through its combinator where it has one."""
    run = runner(spec)
    if run is None:
        return list(kernel.check(spec, ctx))
    return run.check(kernel, spec, ctx)


def parts(spec) -> tuple | None:
    """The specs of the kernel calls a combinator makes for ``spec`` (None:
    the spec is one kernel call)."""
    run = runner(spec)
    return None if run is None else run.parts(spec)


def apply(kernel, spec, q, k, v, extras=(), *, interpret: bool = False, kv_layout: str = "bhsd"):
    """``kernel.apply`` for ``spec``, its combinator's calls where it has
    one; k and v in ``kv_layout`` (passed on where it is not canonical)."""
    kernel = in_layout(kernel, kv_layout)
    run = runner(spec)
    if run is None:
        return kernel.apply(spec, q, k, v, extras, interpret=interpret)
    return run.apply(kernel, spec, q, k, v, extras, interpret=interpret)


def in_layout(kernel, kv_layout: str):
    """``kernel``, its ``apply`` reading k and v in ``kv_layout``."""
    if kv_layout == "bhsd":
        return kernel
    if kv_layout not in kernel.kv_layouts:
        raise ValueError(f"{kernel.name} does not read k and v in layout {kv_layout!r}")
    return _InLayout(kernel, kv_layout)


class _InLayout:
    """``kernel`` whose ``apply`` reads k and v in ``kv_layout``."""

    def __init__(self, kernel, kv_layout: str):
        self.kernel, self.kv_layout = kernel, kv_layout

    @property
    def plain_jax(self) -> bool:
        return self.kernel.plain_jax

    def apply(self, spec, q, k, v, extras=(), *, interpret: bool = False):
        return self.kernel.apply(
            spec, q, k, v, extras, interpret=interpret, kv_layout=self.kv_layout
        )
