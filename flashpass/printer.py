"""A jaxpr printer that is stable across JAX versions, for golden tests.

It prints primitive names, shapes and dtypes, and only the parameters that
decide what an equation computes (axes, dimension numbers, permutations...);
no source info, no sharding annotations, and variables renamed in order.
Kernel calls (``jit[name=flashpass_*]``) print as one opaque line, so a golden
pins *that* a site was rewritten and how its operands were laid out, not the
kernel's internals.
"""

from __future__ import annotations

import numpy as np

from . import compat
from .calls import KERNEL_PREFIX

#: Parameters that decide semantics; everything else is omitted.  Only params
#: that every supported JAX spells the same way are listed: ``scan``'s
#: ``num_consts``/``num_carry`` (JAX < 0.11; ``ft_in``/``ft_out`` since) are left
#: out, its body's signature and the equation's operands pin the same thing.
PARAMS = (
    "axes",
    "dimension_numbers",
    "permutation",
    "broadcast_dimensions",
    "new_sizes",
    "dimensions",
    "new_dtype",
    "dimension",
    "shape",
    "y",
    "start_indices",
    "limit_indices",
    "strides",
    "slice_sizes",
    "length",
    "reverse",
    "name",
)


def format_jaxpr(closed) -> str:
    """The stable text of a (Closed)Jaxpr."""
    jaxpr, _ = compat.closed_parts(closed)
    names: dict = {}
    lines: list[str] = []
    _format(jaxpr, names, lines, indent="")
    return "\n".join(lines) + "\n"


def _name(names: dict, var) -> str:
    if compat.is_literal(var):
        value = np.asarray(compat.literal_value(var))
        return f"{value.item() if value.ndim == 0 else value.tolist()}:{_type(var.aval)}"
    if compat.is_drop_var(var):
        return "_"
    if var not in names:
        names[var] = f"v{len(names)}"
    return names[var]


def _type(aval) -> str:
    dtype = getattr(aval, "dtype", None)
    shape = getattr(aval, "shape", None)
    if dtype is None or shape is None:
        return str(aval)
    return f"{np.dtype(dtype).name}[{','.join(str(d) for d in shape)}]"


def _decl(names: dict, var) -> str:
    return f"{_name(names, var)}:{_type(var.aval)}"


def _format(jaxpr, names: dict, lines: list[str], indent: str) -> None:
    ins = " ".join(_decl(names, v) for v in [*jaxpr.constvars, *jaxpr.invars])
    lines.append(f"{indent}in {ins}")
    for eqn in jaxpr.eqns:
        outs = " ".join(_decl(names, v) for v in eqn.outvars)
        args = " ".join(_name(names, v) for v in eqn.invars)
        name = eqn.params.get("name")
        if isinstance(name, str) and name.startswith(KERNEL_PREFIX):
            lines.append(f"{indent}{outs} = {name}({args})")
            continue
        params = _params(eqn.params)
        lines.append(f"{indent}{outs} = {eqn.primitive.name}{params} {args}".rstrip())
        for key, index, body in compat.bodies_in_params(eqn.params):
            lines.append(f"{indent}  {key if index is None else f'{key}[{index}]'}:")
            _format(compat.closed_parts(body)[0], names, lines, indent + "    ")
    outs = " ".join(_name(names, v) for v in jaxpr.outvars)
    lines.append(f"{indent}out {outs}")


def _params(params: dict) -> str:
    shown = []
    for key in PARAMS:
        if key in params and params[key] is not None:
            shown.append(f"{key}={_value(params[key])}")
    return f"[{' '.join(shown)}]" if shown else ""


def _value(value) -> str:
    if isinstance(value, np.dtype) or hasattr(value, "dtype") and not hasattr(value, "shape"):
        return np.dtype(value).name
    if isinstance(value, type) and issubclass(value, np.generic):
        return np.dtype(value).name
    if isinstance(value, tuple | list):
        return "(" + ",".join(_value(v) for v in value) + ")"
    try:
        return np.dtype(value).name if _looks_like_dtype(value) else str(value)
    except TypeError:
        return str(value)


def _looks_like_dtype(value) -> bool:
    return type(value).__name__.endswith("DType")


def count_kernel_calls(closed, prefix: str = KERNEL_PREFIX) -> dict[str, int]:
    """``{kernel call name: count}`` over a jaxpr and all its nested bodies."""
    counts: dict[str, int] = {}
    jaxpr, _ = compat.closed_parts(closed)
    for eqn in jaxpr.eqns:
        name = eqn.params.get("name")
        if isinstance(name, str) and name.startswith(prefix):
            counts[name] = counts.get(name, 0) + 1
            continue
        for sub in compat.subjaxprs_of_params(eqn.params):
            for k, v in count_kernel_calls(sub, prefix).items():
                counts[k] = counts.get(k, 0) + v
    return counts
