"""A wipe of the attention output's empty rows, after ``P·V``, read into the site.

Gemma-style layers zero the attention output of every query row whose mask
keeps no key, after the heads are merged::

    empty = all(mask == 0, axis=-1)           # [B, T]: reads the T x S mask
    out = where(empty[..., None, None], 0, out)

Left as written, the wipe's reduction keeps the ``T x S`` mask alive next to
the kernel (and, in a training step, in the forward of the rewritten program).
It changes nothing the site does not already do when

* the site's own output is zero in every row its score masks leave empty (the
  masked softmax's re-mask, `RowKeep`), and
* every row the wipe zeroes is empty under the site's masks: some factor of
  the scores' masks keeps only keys the wipe's mask keeps too, both read
  elementwise from the same array along the same axes (``x > 0`` implies
  ``x != 0``), checked on every interval of the values the comparisons
  split.

The wipe's equations (the layout moves between ``P·V`` and it, the select, and
its condition's computation from the mask array) then join the site, the
select becomes the site's root, and its roles the output's.  A wipe the site's
masks do not prove stays as written (the site's root is unchanged).
"""

from __future__ import annotations

import math

import numpy as np

from flashpass.graph import Const, Scope
from flashpass.roles import UNIT
from flashpass.site import RowKeep

from .common import Profile, profile, scalar_value
from .indicators import COMPARISONS, SWAPPED, compose


def absorb_row_wipe(scope: Scope, root, out_roles, masks, post, layout_roles):
    """``(root, nodes, out_roles)`` with a proven row wipe after ``root`` joined
    to the site (see the module doc), else None.  ``masks``: the scores'
    `ScoreMasks`; ``post``: the site's output ops; ``layout_roles(scope, node,
    atom, roles)``: the roles after a layout-only move, or None."""
    if not masks.exact or not _rows_zeroed(post):
        return None
    nodes, atom, roles = set(), root.out, list(out_roles)
    while True:
        users = scope.consumers(atom)
        if len(users) != 1 or scope.is_output(atom):
            return None
        node, pos = users[0]
        if node.prim == "select_n":
            break
        roles = layout_roles(scope, node, atom, roles)
        if roles is None:
            return None
        nodes.add(node)
        atom = node.out
    keep = _wipe_keep(scope, node, pos, roles)
    if keep is None or not _implied_by_scores(scope, keep, masks):
        return None
    helpers = _helpers(scope, node, keep[0].base)
    return node, nodes | helpers | {node}, tuple(roles)


def _rows_zeroed(post) -> bool:
    """Whether the site's output is zero in every row its masks leave empty
    (it re-masks them: `RowKeep`)."""
    return any(isinstance(op, RowKeep) for op in post)


def _wipe_keep(scope: Scope, node, pos: int, roles: list):
    """``(Profile of the mask X against X's own axes, {X axis: role}, keep)``
    when the ``select_n`` ``node`` zeroes its case ``pos`` exactly in the rows
    where no key ``s`` has ``keep(X[..., s])``; else None."""
    pred, *cases = node.ins
    if len(cases) != 2 or pos == 0:
        return None
    shape = scope.shape(node.out)
    zero = profile(scope, cases[2 - pos], shape)
    if not zero.is_scalar or scalar_value(scope, zero.base) != 0.0:
        return None
    zero_when = pos == 1  # select_n(pred, out, 0): zero where pred is true
    cond = profile(scope, pred, shape)
    for t, a in enumerate(cond.axes):
        if a is not None and (roles[t] in ("Dv", UNIT) or not _atomic(roles[t])):
            return None
    base = cond.base
    red = scope.producer(base)
    while red is not None and red.prim == "not":
        zero_when = not zero_when
        cond = compose(scope, cond, red.ins[0])
        base, red = cond.base, scope.producer(cond.base)
    if red is None or red.prim not in ("reduce_and", "reduce_or"):
        return None
    # all(e) zeroes where true, any(e) where false: both "no key keeps", keep = ~e or e.
    if (red.prim == "reduce_and") != zero_when:
        return None
    axes = tuple(red.params["axes"])
    x_shape = scope.shape(red.ins[0])
    if len(axes) != 1:
        return None
    kept_axes = [a for a in range(len(x_shape)) if a not in axes]
    x_roles = {axes[0]: "S"}
    for t, a in enumerate(cond.axes):
        if a is not None:
            x_roles[kept_axes[a]] = roles[t]
    if any(a not in x_roles and x_shape[a] != 1 for a in range(len(x_shape))):
        return None
    prof, steps = _pointwise(scope, Profile(red.ins[0], tuple(range(len(x_shape))), x_shape))
    if red.prim == "reduce_and":
        steps = (*steps, ("not",))
    return prof, x_roles, steps


def _atomic(role) -> bool:
    return role == "T" or (isinstance(role, tuple) and len(role) == 2 and role[0] == "b")


def _pointwise(scope: Scope, prof: Profile):
    """``(Profile of an array X, steps)`` where ``prof``'s value is ``steps``
    applied to X elementwise (comparisons with a scalar constant, ``not`` and
    value-preserving casts, innermost first); no steps when it is X itself."""
    steps = []
    for _ in range(16):
        node = scope.producer(prof.base)
        if node is None:
            break
        if node.prim == "not" and scope.dtype(node.out) == np.bool_:
            steps.append(("not",))
            prof = compose(scope, prof, node.ins[0])
            continue
        if node.prim == "convert_element_type" and _exact_cast(
            scope.dtype(node.ins[0]), scope.dtype(node.out)
        ):
            steps.append(("cast", np.dtype(scope.dtype(node.out))))
            prof = compose(scope, prof, node.ins[0])
            continue
        if node.prim in COMPARISONS:
            found = _compared(scope, node)
            if found is None:
                break
            operand, step = found
            steps.append(step)
            prof = compose(scope, prof, operand)
            continue
        break
    return prof, tuple(reversed(steps))


def _exact_cast(src, dst) -> bool:
    """A cast that changes no value's truth or order: from bool, to bool, or
    widening within ints or floats (or int to float)."""
    src, dst = np.dtype(src), np.dtype(dst)
    if src == np.bool_ or dst == np.bool_:
        return True
    return np.can_cast(src, dst, casting="safe")


def _compared(scope: Scope, node):
    """``(operand, ("cmp", name, c))`` for ``cmp(operand, c)`` or ``cmp(c,
    operand)`` with a scalar constant ``c``; else None."""
    shape = scope.shape(node.out)
    for i, name in ((0, node.prim), (1, SWAPPED[node.prim])):
        other = profile(scope, node.ins[1 - i], shape)
        if other.is_scalar:
            c = scalar_value(scope, other.base)
            if c is not None and not math.isnan(c):
                return node.ins[i], ("cmp", name, c)
    return None


def _implied_by_scores(scope: Scope, keep, masks) -> bool:
    """Whether some factor of the scores' masks keeps only keys ``keep`` keeps."""
    from .masks import and_factors

    wipe_prof, wipe_roles, wipe_steps = keep
    x = scope.resolve(wipe_prof.base)
    if isinstance(x, Const):  # a constant mask's wipe: not read here
        return False
    x_roles = {wipe_prof.axes[a]: r for a, r in wipe_roles.items() if wipe_prof.axes[a] is not None}
    for step, roles in masks.steps:
        for factor in and_factors(scope, step.profile):
            prof, steps = _pointwise(scope, factor)
            base = scope.resolve(prof.base)
            if isinstance(base, Const) or base != x:
                continue
            f_roles = {a: roles[t] for t, a in enumerate(prof.axes) if a is not None}
            if f_roles != x_roles:
                continue
            if _implies(steps, step.keep_when, wipe_steps, scope.dtype(x)):
                return True
    return False


def _implies(site_steps, keep_when: bool, wipe_steps, dtype) -> bool:
    """``apply(site_steps, x) == keep_when`` implies ``apply(wipe_steps, x)``
    for every ``x`` of ``dtype``: both are constant between the constants they
    compare with, so each constant, its neighbours and the extremes decide."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        points = [False, True]
    else:
        consts = {0.0, 1.0} | {s[2] for s in (*site_steps, *wipe_steps) if s[0] == "cmp"}
        points = set()
        for c in consts:
            if np.issubdtype(dtype, np.integer):
                points |= {math.floor(c) - 1, math.floor(c), math.ceil(c), math.ceil(c) + 1}
            else:  # the neighbours in the array's own dtype (a float64 step would round back)
                c = np.asarray(c, dtype)
                points |= {float(x) for x in (c, np.nextafter(c, -np.inf), np.nextafter(c, np.inf))}
        if np.issubdtype(dtype, np.floating):
            points |= {-np.inf, np.inf, np.nan}
        lo, hi = _range(dtype)
        points = [p for p in points if math.isnan(p) or lo <= p <= hi]
    for p in points:
        x = np.asarray(p).astype(dtype)
        if bool(_apply(site_steps, x)) == keep_when and not bool(_apply(wipe_steps, x)):
            return False
    return True


def _range(dtype):
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return info.min, info.max
    return -np.inf, np.inf


def _apply(steps, x):
    for step in steps:
        if step[0] == "not":
            x = np.logical_not(x)
        elif step[0] == "cast":
            x = np.asarray(x).astype(step[1])
        else:
            _, name, c = step
            x = COMPARISONS[name](x, np.asarray(c).astype(np.asarray(x).dtype))
    return x


def _helpers(scope: Scope, select, x) -> set:
    """The equations that compute ``select``'s condition from the mask ``x``
    (a reader outside the site keeps the whole site as written: the caller
    then matches it without the wipe).  The zero case stays out, as the
    backward proof matches a filled scalar by value, not by its equations."""
    stop = scope.producer(x)
    cone = scope.backward_cone([select.ins[0]], stop=None if stop is None else {stop})
    cone.discard(stop)
    return cone
