"""Site finding: from a `Scope` to `AttentionSite`s and `Miss`es.

The anchor is the softmax (found from its ``exp``).  From there:

1. the score chain is walked back to the score ``dot_general``
   (`patterns.chain`), every equation read by a registered rule;
2. the score product's dimension numbers give every axis a role
   (`patterns.products`), and the softmax axis must be the key axis;
3. the probabilities must feed exactly one ``P·V`` product that contracts the
   key axis and keeps the query axis;
4. every equation between the score product and the output must have been
   recognised (nothing skipped), and no intermediate may be used outside the
   site (the escape check);
5. side operands become canonical score ops; constant masks are classified by
   value (causal or not).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flashpass import errors
from flashpass.graph import Const, Scope
from flashpass.roles import UNIT, Merged, flat
from flashpass.site import (
    AttentionSite,
    Layout,
    Operand,
    present_roles,
)
from flashpass.spec import AttentionSpec, ExtraSpec

from . import chain as chain_mod
from .backward import match_backward, match_ungathered
from .builder import SiteBuilder
from .common import ESCAPE_HINT, Miss, profile, where
from .products import output_product, score_products
from .regroup import PRIMS as REGROUP_PRIMS
from .regroup import batch_splits, product_axes, regroup
from .row_wipe import absorb_row_wipe
from .scans import match_pair, match_remat
from .softmax import match_softmax
from .softmax_like import normalised_projection, softmax_like


@dataclasses.dataclass(frozen=True, eq=False)
class Escaped:
    """A site whose intermediates are read outside it, where no backward in
    its own scope reads them: a loop body's or a remat's pairing with its
    backward (patterns/scans.py) may still prove one; else ``miss`` is why
    the site is kept.  Falsy, like a `Miss`."""

    site: AttentionSite
    miss: Miss
    relevant = True

    def __bool__(self) -> bool:
        return False


def match_scopes(scopes) -> tuple[list, list]:
    """Stage 3: ``(sites, misses)`` of every scope, each a ``(scope, site or
    Miss)`` pair; an escaped site is paired with its backward in a remat body
    or, from a loop body, in the backward loop (patterns/scans.py)."""
    found, kept = [], []
    by_prefix = {s.prefix: s for s in scopes}
    children = {c.prefix: (s, c) for s in scopes for c in s.children}
    for scope in scopes:
        sites, unmatched = find_sites(scope)
        for miss in unmatched:
            if isinstance(miss, Escaped):
                miss = _paired(scope, miss, by_prefix, children)
            (kept if isinstance(miss, Miss) else found).append((scope, miss))
        found += [(scope, site) for site in sites]
    return found, kept


def _paired(scope, escaped: Escaped, by_prefix: dict, children: dict):
    """The escaped site with its backward in another scope, or the `Miss`."""
    # Its saved intermediates may go into a remat body that is its backward.
    paired = match_remat(scope, escaped.site, by_prefix)
    if not isinstance(paired, Miss) or scope.prefix not in children:
        return paired if not isinstance(paired, Miss) else escaped.miss
    # Its intermediates leave a loop body: autodiff's backward loop may read them.
    parent, child = children[scope.prefix]
    paired = match_pair(parent, child, scope, escaped.site, by_prefix)
    if not isinstance(paired, Miss):
        return paired
    return Miss(  # why the pair was not proven, not the body's escape
        f"{paired.reason} (its intermediates leave the `{child.node.prim}` body: "
        "autodiff saves them for its backward)",
        escaped.miss.node,
    )


def find_sites(scope: Scope) -> tuple[list[AttentionSite], list]:
    """All attention sites of one scope, and the rest in program order: sites
    whose intermediates escape it (`Escaped`) and the relevant near misses."""
    chain_mod.ensure_loaded()
    sites: list[AttentionSite] = []
    misses: list = []  # Escaped | Miss
    claimed: set = set()
    for node in scope.nodes:
        if node.prim != "exp":
            continue
        try:
            soft = match_softmax(scope, node)
            site = match_site(scope, soft) if soft else soft
        except Exception as err:  # a matcher bug must never break the user's program
            if errors.strict():
                raise
            text = errors.describe(err)
            site = Miss(f"internal matcher error ({text}){where(node)}", node, internal=text)
        if isinstance(site, Miss) and site.relevant and normalised_projection(scope, node):
            # A softmax over a projection that gives its values too (CoaT's
            # factorised attention): no score matrix, so no attention site.
            site = Miss(f"the softmax normalises a projection{where(node)}", node, relevant=False)
        if not site and not site.relevant:
            # Silent, unless the exp looks like attention's (patterns/softmax_like.py).
            like = softmax_like(scope, node, site)
            if like is not None:
                misses.append(like)
            continue
        if not site:
            misses.append(_located(site, node))
            continue
        if site.nodes & claimed:
            misses.append(Miss(f"overlaps another attention site{where(node)}", node))
            continue
        claimed |= site.nodes
        sites.append(site)
    return sites, misses


def _located(result, node):
    """``result`` (a `Miss` or an `Escaped`) placed at ``node`` when its miss
    has no location of its own."""
    miss = result.miss if isinstance(result, Escaped) else result
    if miss.location is not None:
        return result
    at = Miss(miss.reason, node, miss.relevant, miss.internal, miss.readers)
    return dataclasses.replace(result, miss=at) if isinstance(result, Escaped) else at


def match_site(scope: Scope, soft) -> AttentionSite | Escaped | Miss:
    chain = chain_mod.walk_chain(scope, soft.s_in)
    if not chain:
        return chain
    dot = chain.dot

    # Which dot output axis is the softmax axis?  Follow transposes forward.
    positions = list(range(len(scope.shape(dot.out))))
    lost = None  # the last step that made an axis out of several score axes
    for step in chain.steps:
        perm = step.permutation()
        if perm is not None:
            positions = [None if p is None else positions[p] for p in perm]
            if None in positions:  # (an intermediate rank may differ from the softmax's)
                lost = step.node
    if positions[soft.axis] is None:
        return Miss(
            f"the softmax is over an axis `{lost.prim}` made out of several score axes (or a "
            f"new one), not the key axis{where(lost)}",
            lost,
        )
    n_batch = len(dot.params["dimension_numbers"][1][0])
    readings = score_products(scope, dot, positions[soft.axis], batch_splits(chain.steps, n_batch))
    if not readings:
        mixed = _mixed_scores(scope, dot, positions[soft.axis])
        return readings if mixed is None else mixed
    fallback = None
    for sp in readings:
        site = _build_site(scope, soft, chain, sp)
        if site and not any(e.axes.get("G") is not None for e in site.extras):
            return site
        if fallback is None or (not fallback and site):
            fallback = site
    if isinstance(fallback, Miss) and fallback.reason.startswith(PV_CONTRACTS_QUERY):
        better = _users_roles_miss(scope, soft, chain, positions[soft.axis])
        return fallback if better is None else better  # (a Miss is falsy)
    return fallback


PV_CONTRACTS_QUERY = "P·V contracts the query axis"


def _mixed_scores(scope: Scope, dot, key_out_axis: int) -> Miss | None:
    """Why ``dot`` is no score product when it is a product *of scores*: its
    operand holding the softmax axis is itself read back (`patterns.chain`) to
    an earlier product whose free axis that is, and ``dot`` contracts an axis of
    it that is (a factor of) one of that product's batch axes: heads, as
    talking-heads attention mixes them before the softmax.  Every softmax row
    then reads several heads' scores; else None."""
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    lhs, rhs = dot.ins
    nb = len(lb)
    lfree = [a for a in range(len(scope.shape(lhs))) if a not in (*lc, *lb)]
    rfree = [a for a in range(len(scope.shape(rhs))) if a not in (*rc, *rb)]
    if key_out_axis < nb:
        return None
    if key_out_axis < nb + len(lfree):
        x, contract, key = lhs, lc, lfree[key_out_axis - nb]
    else:
        x, contract, key = rhs, rc, rfree[key_out_axis - nb - len(lfree)]
    found = product_axes(scope, x)  # each axis: the product's axis it is, or a factor of
    if found is None:
        return None
    inner, inner_nb, positions = found
    if positions[key] is None or positions[key] < inner_nb:
        return None
    if not any(positions[a] is not None and positions[a] < inner_nb for a in contract):
        return None
    return Miss(
        f"the scores of the product{where(inner)} are mixed across heads before the "
        f"softmax: the product{where(dot)} contracts one of their batch axes (talking-heads "
        "attention), so each softmax row reads several heads' scores: a kernel computes that "
        "only on every head's queries and keys side by side (head dimension heads x D), "
        "which the pass does not build; kept as written",
        dot,
    )


def _users_roles_miss(scope: Scope, soft, chain, key_axis: int) -> Miss | None:
    """The miss of the reading that keeps the user's roles, when it explains more.

    The softmax axis names the key operand.  A softmax over the query axis of
    ``q·kᵀ`` (``axis=-2``) therefore reads ``q`` as the key, and that reading
    fails later, at P·V, with a message about the wrong thing.  Read with the
    first operand as the query (as written), the site fails where the user's
    mistake is: the softmax axis."""
    dot = chain.dot
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    nb = len(lb)
    lfree = len(scope.shape(dot.ins[0])) - len(lc) - nb
    rfree = len(scope.shape(dot.ins[1])) - len(rc) - len(rb)
    if not nb <= key_axis < nb + lfree or rfree != 1:
        return None  # the key already is the second operand
    readings = score_products(scope, dot, nb + lfree, batch_splits(chain.steps, nb))
    for sp in readings or ():
        site = _build_site(scope, soft, chain, sp)
        if isinstance(site, Miss) and site.reason.startswith("softmax is over the query axis"):
            return site
    return None


def _build_site(scope: Scope, soft, chain, sp, wipe: bool = True) -> AttentionSite | Miss:
    """The site of one reading; ``wipe``: try joining a row wipe after it
    (`patterns.row_wipe`), and match without it where the site then fails."""
    dot = chain.dot
    nodes = {dot, *soft.nodes, *(n for step in chain.steps for n in (step.node, *step.interior))}
    q_shape, k_shape = scope.shape(sp.q), scope.shape(sp.k)
    sizes = {r: q_shape[a] for r, a in sp.q_axes.items() if r != "D"}
    for r in [r for r in sizes if isinstance(r, Merged)]:  # a merged batch axis
        sizes.update(r.parts)
        del sizes[r]
    sizes["S"] = k_shape[sp.k_axes["S"]]
    layout = Layout(sizes)
    build = SiteBuilder(scope, sp.roles, layout)
    problem = build.build_ops(chain.steps)
    if problem is not None:
        return problem
    ops, extras, roles = build.ops, build.extras, build.roles

    if roles[soft.axis] != "S":
        fix = ""
        if "S" in roles:  # say which axis to normalise over instead
            axis = roles.index("S") - len(roles)
            fix = f"; normalise over the key axis, the one P·V contracts (axis={axis})"
        return Miss(
            f"softmax is over the {_role_name(roles[soft.axis])} axis, not the key axis"
            f"{where(soft.exp)}{fix}",
            soft.exp,
        )
    # A deferred sum (and the cast widening it) already belongs to the site.
    ignore = frozenset() if soft.deferred is None else frozenset(soft.nodes)
    out = output_product(scope, soft.out, roles, ignore, build.score_masks(), sp.roles)
    if not out:
        return out
    root = out.node
    out_roles = tuple(out.roles)
    absent = [r for r in flat(sp.roles) if isinstance(r, tuple) and r not in flat(out_roles)]
    if any(sizes[r] != 1 for r in absent):  # only a squeezed unit axis may be absent
        return Miss(f"P·V drops a batch axis of the scores{where(root)}", root)
    nodes |= out.casts | {root}
    if soft.deferred is not None:
        found = _deferred_division(scope, root, soft.deferred, roles, out.roles)
        if not found:
            return found
        root, division_nodes, out_roles = found
        nodes |= division_nodes
    post, ops, extras = _after_softmax(scope, out.post, layout, ops, extras)
    masks = build.score_masks()
    located = root.location  # the product's (or division's) line, not the wipe's
    wiped = absorb_row_wipe(scope, root, out_roles, masks, post, _layout_roles) if wipe else None
    if wiped is not None:
        root, wipe_nodes, out_roles = wiped
        nodes |= wipe_nodes

    def settled(result):
        # A wipe the site cannot take (read elsewhere, its backward unproven): without it.
        if wiped is not None and not isinstance(result, AttentionSite):
            return _build_site(scope, soft, chain, sp, wipe=False)
        return result

    cone = scope.forward_cone([dot.out], until=root.order)  # what the scores reach
    if soft.shifts:
        nodes |= scope.backward_cone(list(soft.shifts), since=dot.order) & cone

    problem = _check_unknown(scope, dot, root, nodes, cone)
    if problem is not None:
        return settled(problem)
    # A side operand computed from the scores (hidden inside a shift's cone
    # above, which may read anything) cannot be a kernel input.
    for atom in [e.atom for e in extras] + [scale.atom for scale in build.q_scales]:
        node = scope.producer(atom)
        if node is not None and node in cone:
            return settled(
                Miss(f"a side operand of the scores is computed from the scores{where(node)}", node)
            )
    escape = _escape(scope, root, nodes)
    operands = _operands(scope, sp, out, sizes["S"], dot, root)
    if isinstance(operands, Miss):
        return settled(operands)
    q, k, v = operands
    spec = AttentionSpec(
        batch=layout.batch,
        heads=layout.heads,
        kv_heads=layout.kv_heads,
        q_len=sizes["T"],
        kv_len=sizes["S"],
        head_dim=q.shape[sp.q_axes["D"]],
        v_head_dim=v.shape[out.v_axes["Dv"]],
        q_dtype=q.dtype,
        k_dtype=k.dtype,
        v_dtype=v.dtype,
        out_dtype=scope.dtype(root.out),
        compute_dtype=soft.dtype,
        p_dtype=out.p_dtype,
        score_ops=tuple(ops),
        extras=tuple(ExtraSpec(shape, e.dtype) for shape, e in _ops_extras(ops, extras, layout)),
    )
    pieces = [type(op).__name__.lower() for op in ops]
    if layout.grouped and layout.sizes["G"] > 1:  # a unit group is plain attention
        pieces.insert(0, "grouped")
    site = AttentionSite(
        scope_prefix=scope.prefix,
        nodes=frozenset(nodes),
        root=root,
        q=q,
        k=k,
        v=v,
        extras=tuple(extras),
        layout=layout,
        out_roles=out_roles,
        q_scales=tuple(build.q_scales),
        post_ops=tuple(post),
        spec=spec,
        pattern="softmax(QKᵀ)V" + (f" [{', '.join(pieces)}]" if pieces else ""),
        location=located or soft.exp.location,
        dense=tuple(build.dense_notes),
    )
    return settled(site if escape is None else _with_backward(scope, site, root, escape))


def _with_backward(scope: Scope, site: AttentionSite, root, escape):
    """A site whose intermediates are read outside it: by autodiff's backward
    of it (a training step), or not (`Escaped`, or a plain miss)."""
    nodes = site.nodes
    # A returned intermediate rules out a backward in this scope (a loop body's
    # may still be read by the backward loop: patterns/scans.py takes ``site``).
    returned = any(
        scope.is_output(o) for n in nodes if n is not root for o in n.outs if o is not None
    )
    backward = Miss("") if returned else match_backward(scope, site)
    if not backward:
        reason = escape.reason if returned else f"{escape.reason} ({backward.reason})"
        return Escaped(site, Miss(reason, escape.node))
    site = dataclasses.replace(site, nodes=site.nodes | backward.nodes, backward=backward)
    # A ring reads k and v from before the program's gathers: prove that form too.
    return dataclasses.replace(site, ungathered=match_ungathered(scope, site))


def _after_softmax(scope: Scope, steps, layout, ops, extras):
    """``(post ops, score ops, extras)``: the typed steps between the softmax
    and ``P·V`` (an output multiplier, the rows a mask empties), dropout a
    score op of its own with its key an extra."""
    post = []
    for step in steps:
        found, ops, extras = step.apply(scope, layout, ops, extras)
        if found is not None:
            post.append(found)
    return post, ops, extras


def _operands(scope: Scope, sp, out, kv_len: int, dot, root):
    """The site's q, k and v `Operand`s, or why they cannot be a kernel's."""
    for name, atom in (("query", sp.q), ("key", sp.k), ("value", out.v)):
        if not jnp.issubdtype(scope.dtype(atom), jnp.floating):
            return Miss(f"{name} is {scope.dtype(atom)}, not floating point{where(dot)}", dot)
    v_shape = scope.shape(out.v)
    if v_shape[out.v_axes["S"]] != kv_len:
        return Miss(f"value length differs from key length{where(root)}", root)
    return (
        Operand(sp.q, sp.q_axes, scope.shape(sp.q), scope.dtype(sp.q)),
        Operand(sp.k, sp.k_axes, scope.shape(sp.k), scope.dtype(sp.k)),
        Operand(out.v, out.v_axes, v_shape, scope.dtype(out.v)),
    )


def _ops_extras(ops, extras, layout):
    # Every op reading an extra has an ``index`` (Bias, Mask, descriptors such as KvLengths);
    # Segments reads two, and an extra an op no longer reads (a descriptor put back as
    # its literal mask) still gets its shape from the layout.
    by_index = {op.index: op.shape for op in ops if isinstance(getattr(op, "index", None), int)}
    return [
        (by_index.get(i) or layout.extra_shape(present_roles(e.axes)), e)
        for i, e in enumerate(extras)
    ]


def _deferred_division(scope: Scope, pv, total, score_roles: list, out_roles: list):
    """``(P·V) / sum``: the division node and helpers, when normalisation is deferred.

    Layout ops may sit on either side: the P·V result transposed (an einsum to
    a ``BTHD`` output), cast (mixed precision) or regrouped (MaxText merges the
    (kv head, group) axes into heads) before the division, and the sum moved
    the same way.  Either way the division must divide each output element by
    the sum of its own row: the roles of the divisor's axes, followed from the
    sum, must be the output's (`patterns.regroup` for reshapes)."""
    out_roles = list(out_roles)
    layout: set = set()
    atom = pv.out
    while True:
        users = scope.consumers(atom)
        if len(users) != 1 or scope.is_output(atom):
            break
        node, _ = users[0]
        roles = _layout_roles(scope, node, atom, out_roles)
        if roles is None:
            break
        out_roles = roles
        layout.add(node)
        atom = node.out
    # Other readers (autodiff's backward) are checked as escapes.
    divs = [n for n, pos in scope.consumers(atom) if n.prim == "div" and pos == 0]
    if len(divs) != 1:
        return Miss(f"exp(scores) @ v is not divided by the sum of exp{where(pv)}", pv)
    div = divs[0]
    prof = profile(scope, div.ins[1], scope.shape(div.out))
    sum_roles = _roles_of_sum(scope, prof.base, total, [r for r in score_roles if r != "S"])
    ok = sum_roles is not None and {r for r in sum_roles if r != UNIT} == {
        r for r in out_roles if r not in ("Dv", UNIT)
    }
    for t, r in enumerate(out_roles):
        a = prof.axes[t]
        if r == "Dv":
            ok = ok and a is None
        elif r != UNIT:
            ok = ok and a is not None and sum_roles[a] == r
    if not ok:
        return Miss(f"P·V is divided by something other than the softmax sum{where(div)}", div)
    helpers = scope.backward_cone([div.ins[1]], stop={scope.producer(total)})
    helpers.discard(scope.producer(total))
    return div, {div, *layout, *helpers}, tuple(out_roles)


def _layout_roles(scope: Scope, node, atom, roles: list) -> list | None:
    """The roles of ``node``'s output axes when it only moves the axes of
    ``atom`` (whose axes have ``roles``): a transpose, a float cast or a
    role-preserving regrouping; else None."""
    if node.prim == "transpose":
        return [roles[i] for i in node.params["permutation"]]
    if node.prim == "convert_element_type" and _is_float(scope.dtype(node.out)):
        return roles
    if node.prim in REGROUP_PRIMS and len(node.ins) == 1:
        new = regroup(node, roles, scope.shape(atom), scope.shape(node.out))
        return None if isinstance(new, str) else new
    return None


def _roles_of_sum(scope: Scope, base, total, roles: list) -> list | None:
    """The roles of ``base``'s axes when it is the sum ``total`` (whose axes
    have ``roles``) moved by layout ops only (`_layout_roles`); else None."""
    path, atom, stop = [], scope.resolve(base), scope.resolve(total)
    while atom != stop:
        node = scope.producer(atom)
        if node is None or len(path) > 16:
            return None
        path.append(node)
        atom = scope.resolve(node.ins[0])
    for node in reversed(path):
        roles = _layout_roles(scope, node, node.ins[0], roles)
        if roles is None:
            return None
    return roles


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _role_name(role) -> str:
    return {"T": "query", "S": "key"}.get(role, "batch")


def _check_unknown(scope: Scope, dot, root, nodes: set, cone: set) -> Miss | None:
    """Nothing unrecognised in between (``cone``: the nodes the scores reach)."""
    between = cone & scope.backward_cone([root.out], since=dot.order)
    unknown = sorted(between - nodes, key=lambda n: n.order)
    if unknown:
        n = unknown[0]
        return Miss(f"unrecognised `{n.prim}` inside the attention pattern{where(n)}", n)
    return None


def _escape(scope: Scope, root, nodes: set) -> Miss | None:
    """The first intermediate read outside the site, if any."""
    for node in sorted(nodes, key=lambda n: n.order):
        if node is root:
            continue
        for o in node.outs:
            if o is None:
                continue
            if scope.is_output(o):
                return Miss(
                    f"the intermediate `{node.prim}`{where(node)} is returned by the "
                    f"function{ESCAPE_HINT}",
                    node,
                )
            for user, _ in scope.consumers(o):
                if user not in nodes:
                    return Miss(
                        f"the intermediate `{node.prim}`{where(node)} is also used by "
                        f"`{user.prim}`{where(user)}{ESCAPE_HINT}",
                        node,
                    )
    return None


__all__ = ["find_sites", "match_site", "Const"]
