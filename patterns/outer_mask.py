"""A mask combining a per-query and a per-key array, as `OuterMask`.

``compare(combine(a[.., i], b[.., j]), c)`` with a scalar constant ``c`` (a
cast to bool is ``!= 0``), ``a`` varying over the queries but not the keys and
``b`` the reverse, both of one dtype: DeBERTa's padding mask ``(m[i] *
m[j]).bool()``, a sum or minimum of two padding vectors compared with a
threshold.  The op recomputes the combination in the arrays' own dtype, so
it is the program's mask bit for bit, from O(T) data.  Ranked last: where a
plainer descriptor (segment ids, positions) proves the factor, it decides.
"""

from __future__ import annotations

import numpy as np

from flashpass.ops.outer_mask import COMBINE, COMPARE, OuterMask
from flashpass.spec import excludes

from .common import scalar_value
from .indicators import SWAPPED, boolean_factors, compose
from .masks import mask_recogniser


@mask_recogniser(rank=90)
def recognise_outer_mask(build, factor, keep_when, fill) -> bool:
    """``compare(combine(q side, kv side), c)``; see the module doc."""
    if not excludes(fill):
        return False
    if keep_when and boolean_factors(build.scope, factor) is not None:
        return False  # a conjunction of two-valued factors: each its own op (`add_mask`)
    node = build.scope.producer(factor.base)
    while node is not None and node.prim == "not":  # ``~m``: keeps where m is False
        factor, keep_when = compose(build.scope, factor, node.ins[0]), not keep_when
        node = build.scope.producer(factor.base)
    compared = _compared(build.scope, factor)
    if compared is None:
        return False
    combined, compare, value = compared
    scope = build.scope
    node = scope.producer(combined.base)
    if node is None or node.prim not in COMBINE or len(node.ins) != 2:
        return False
    sides = [compose(scope, combined, x) for x in node.ins]
    roles = [{build.roles[t] for t, a in enumerate(p.axes) if a is not None} for p in sides]
    for qi in (0, 1):
        q_roles, kv_roles = roles[qi], roles[1 - qi]
        if "T" in q_roles and "S" not in q_roles and "S" in kv_roles and "T" not in kv_roles:
            break
    else:
        return False
    q_side, kv_side = sides[qi], sides[1 - qi]
    dtype = np.dtype(scope.dtype(q_side.base))
    if dtype != np.dtype(scope.dtype(kv_side.base)):
        return False
    if dtype == np.bool_ and node.prim in ("add", "sub", "mul"):
        return False  # (on booleans only `and` and `or` are read)
    q_index, _ = build.add_extra(q_side, None, dtype)
    kv_index, _ = build.add_extra(kv_side, None, dtype)
    op = OuterMask(q_index, kv_index, node.prim, compare, value, fill, qi == 0, keep_when)
    return build.add_descriptor(op, factor, keep_when, fill)


def _compared(scope, factor):
    """``(combined, compare, value)`` of a factor that is ``combined <cmp> c``
    or ``combined.astype(bool)`` (``!= 0``), the scalar ``c`` in
    ``combined``'s dtype; else None."""
    node = scope.producer(factor.base)
    if node is None:
        return None
    if node.prim == "convert_element_type" and len(node.ins) == 1:
        inner = compose(scope, factor, node.ins[0])
        if np.dtype(scope.dtype(inner.base)) == np.bool_:
            return None
        return inner, "ne", np.zeros((), scope.dtype(inner.base)).item()
    if node.prim not in COMPARE or len(node.ins) != 2:
        return None
    sides = [compose(scope, factor, x) for x in node.ins]
    for k in (0, 1):
        value = scalar_value(scope, sides[1 - k].base)
        if value is None or scalar_value(scope, sides[k].base) is not None:
            continue
        dtype = np.dtype(scope.dtype(sides[k].base))
        exact = np.asarray(value).astype(dtype)
        if np.asarray(exact, np.float64) != np.asarray(value, np.float64):
            return None  # the constant is not one of the operand's values
        compare = node.prim if k == 0 else SWAPPED[node.prim]
        return sides[k], compare, exact.item()  # (a Python number: hashable, exact)
    return None
