"""What the report says about where a site is: its layer and display paths.

``location`` is the source line that wrote the attention (for a library's
layer, a line of the library: the same for every layer of a model).
``layer`` tells the layers apart: the JAX name stack of the site's equations
(Flax module paths, ``jax.named_scope``), e.g. ``Model/decoder/layers_3/attn``,
or, without one, the nearest frame of the user's own code.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import sys
import sysconfig

from . import compat

_LAYER_NAME = re.compile(r"^\w[\w.\-\[\]]*$")
#: A transformation's wrapper around a scope name (``jvp(Model)``,
#: ``transpose(jvp(Model))``, ``vmap(attn)``): the scope inside it is the layer.
_TRANSFORM = re.compile(r"^(?:jvp|transpose|vmap|vjp|batched|checkpoint|remat|linearize)\((.*)\)$")
_PACKAGE = str(pathlib.Path(__file__).resolve().parent)


def layer_of(node) -> str:
    """The layer of a site (or near miss) at ``node`` (a `graph.Node`, the
    site's output equation; None: unknown, ``""``)."""
    if node is None:
        return ""
    parts: list[str] = []
    for eqn in (*node.call_eqns, node.eqn):
        for part in compat.name_stack(eqn).split("/"):
            while (inner := _TRANSFORM.match(part)) is not None:
                part = inner.group(1)  # a training step keeps the outer module's name
            # Transformations, calls (``jvp(...)``, ``jit(step)``) and an einsum's
            # own scope (``...hqk,...khd->...qhd``) are not layers.
            if _LAYER_NAME.match(part) and (not parts or parts[-1] != part):
                parts.append(part)
    if parts:
        return "/".join(parts)
    # An equation's traceback stops at the boundary of the call that holds it
    # (a library's jit-wrapped helper: equinox's `filter_jit` around haliax's
    # einsum): the stack continues in the holding calls' tracebacks, so the
    # nearest frame of the user's own code is looked for along all of them
    # before falling back to the innermost library frame.
    stack = [f for eqn in (node.eqn, *reversed(node.call_eqns)) for f in compat.user_frames(eqn)]
    own = [(f, line) for f, line in stack if not _is_library(f)]
    if own or stack:
        file, line = (own or stack)[0]
        return display_path(f"{file}:{line}")
    return ""


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {paths.get(k) for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return tuple(sorted(str(pathlib.Path(p).resolve()) for p in found if p))


def _is_library(file: str) -> bool:
    path = os.path.realpath(file)
    return path.startswith(_PACKAGE) or any(path.startswith(d) for d in _library_dirs())


def display_path(location: str | None) -> str:
    """``location`` (``"path:LINE"``) as the report shows it: a library's file
    relative to its ``sys.path`` entry (``flax/linen/attention.py:250``), another
    file under the working directory relative to it (``examples/gpt.py:12``),
    else relative to the innermost ``sys.path`` entry holding it, else as given;
    ``"?"`` when unknown."""
    if not location:
        return "?"
    path, sep, line = location.rpartition(":")
    if not sep or not os.path.isabs(path):
        return location
    real = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    roots = [os.path.realpath(p) for p in sys.path if p and os.path.isabs(p)]
    if not _is_library(real) and _under(real, cwd):
        roots = [cwd]
    under = [r for r in roots if _under(real, r)]
    if not under:
        return location
    root = max(under, key=len)
    return os.path.relpath(real, root).replace(os.sep, "/") + ":" + line


def _under(path: str, root: str) -> bool:
    return path.startswith(root.rstrip(os.sep) + os.sep)


def shown_shape(operand, layout) -> tuple:
    """``operand``'s shape as the report shows it: without the unit group axis
    of a 5-D grouped-query spelling that has no groups (``jax.nn.dot_product_attention``
    writes every call that way)."""
    shape = tuple(operand.shape)
    axis = operand.axes.get("G")
    if axis is not None and layout.sizes.get("G") == 1:
        return shape[:axis] + shape[axis + 1 :]
    return shape
