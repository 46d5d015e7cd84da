"""The zoo's measurements of one program, shared with the test suite.

The independent site detector (the softmax-like scan of
``tests/no_silent.py``) and the ``T x S`` shape checks (``tests/t_by_s.py``)
are the same functions the model tests use, imported from ``tests/`` rather
than copied, so the zoo and the tests cannot disagree on what a site or a
materialised score matrix is.
"""

from __future__ import annotations

import pathlib
import re
import sys

import jax
import numpy as np

_TESTS = pathlib.Path(__file__).resolve().parents[2] / "tests"
if str(_TESTS) not in sys.path:  # the helpers live beside the tests that use them
    sys.path.insert(0, str(_TESTS))

from no_silent import softmax_like_exps  # noqa: E402
from t_by_s import is_t_by_s, jaxpr_shapes, kernel_operand_shapes  # noqa: E402

__all__ = [
    "independent_sites",
    "dense_kernel_operands",
    "t_by_s_left",
    "rel_error",
    "tree_rel_error",
]


def independent_sites(closed) -> int:
    """Attention sites in a program as the softmax-like scan sees them (not
    the matcher): each ``exp`` as big as a score matrix that reaches a product."""
    return len(softmax_like_exps(closed))


def dense_kernel_operands(rewritten, t: int, s: int) -> list[tuple[int, ...]]:
    """Kernel-call operands of a rewritten program that could hold a ``T x S``
    matrix: a mask handed to the kernel densely (captured constants a kernel
    does not read are not operands, and q, k and v are no mask: XCiT's
    attention over channels has a head dimension, the tokens, above T)."""
    shapes = kernel_operand_shapes(rewritten, constants=False, qkv=False)
    return sorted({x for x in shapes if is_t_by_s(x, t, s)})


#: A kernel call's function in an exported module (the lift route's re-export,
#: or the splice route's ``_flashpass_splice<i>_flashpass_<kernel>``), with its
#: argument list (q, k, v, then the extras) up to its result type or body.
_KERNEL_FUNC = (
    r"func\.func private @(?:_flashpass_splice\d+_)?flashpass_(?:{names})\((.*?)\)\s*(?:->|\{{)"
)
_TENSOR = re.compile(r"tensor<((?:\d+x)*)[a-z]\w*>")


def dense_module_operands(text: str, t: int, s: int) -> list[tuple[int, ...]]:
    """`dense_kernel_operands` of an exported module's text: the extras of
    each kernel call's function that could hold a ``T x S`` matrix."""
    from flashpass.kernels import kernel_names

    pattern = re.compile(_KERNEL_FUNC.format(names="|".join(map(re.escape, kernel_names()))))
    found = set()
    for args in pattern.findall(text):
        shapes = [tuple(int(d) for d in m.split("x") if d) for m in _TENSOR.findall(args)]
        found |= {x for x in shapes[3:] if is_t_by_s(x, t, s)}
    return sorted(found)


def t_by_s_left(closed, t: int, s: int) -> list[tuple[int, ...]]:
    """Arrays outside kernel calls that could hold a ``T x S`` matrix."""
    shapes = jaxpr_shapes(closed, outside_kernels=True)
    return sorted({x for x in shapes if is_t_by_s(x, t, s)})


def rel_error(actual, expected) -> float:
    """``max|a - e| / max|e|`` over one array (0 for two empty arrays); inf
    where the shapes differ or non-finite entries do not coincide."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    if a.shape != e.shape or not np.array_equal(np.isfinite(a), np.isfinite(e)):
        return float("inf")
    finite = np.isfinite(e)
    if not finite.any():
        return 0.0
    scale = max(float(np.max(np.abs(e[finite]))), 1e-30)
    return float(np.max(np.abs(a[finite] - e[finite]))) / scale


def tree_rel_error(actual, expected) -> float:
    """The largest `rel_error` over the floating leaves of two pytrees.  Each
    leaf's scale is at least a tenth of the largest leaf's (a gradient that is
    exactly zero holds only rounding noise); integer leaves must be equal."""
    a_leaves = jax.tree_util.tree_leaves(actual)
    e_leaves = jax.tree_util.tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        return float("inf")
    floats = [np.asarray(e) for e in e_leaves if np.issubdtype(np.asarray(e).dtype, np.floating)]
    top = max((float(np.max(np.abs(e), initial=0.0)) for e in floats), default=0.0)
    worst = 0.0
    for a, e in zip(a_leaves, e_leaves, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        if not np.issubdtype(e.dtype, np.floating):
            if a.shape != e.shape or not np.array_equal(a, e):
                return float("inf")
            continue
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        if a.shape != e.shape or not np.array_equal(np.isfinite(a64), np.isfinite(e64)):
            return float("inf")
        ok = np.isfinite(e64)
        if not ok.any():
            continue
        scale = max(float(np.max(np.abs(e64[ok]))), 0.1 * top, 1e-30)
        worst = max(worst, float(np.max(np.abs(a64[ok] - e64[ok]))) / scale)
    return worst
