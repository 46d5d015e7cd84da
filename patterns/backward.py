"""Training steps: an attention site's backward, proven to be the vjp of its forward.

A function that differentiates its own loss (``jax.value_and_grad`` inside a
train step) is traced *after* differentiation: the forward site is there, and
further on the equations JAX's autodiff wrote for it, reading the site's
intermediates (the T×S probabilities) as residuals.  `match_backward` finds
those equations without a pattern per spelling:

1. the matched forward equations become a function of the site's inputs, and
   JAX's own ``vjp`` of that function is traced: the *template*, the exact
   equations autodiff writes for this forward (forward residuals and backward);
2. the template is unified with the program, equation by equation (same
   primitive, same parameters, operands in the same positions), starting from
   the site's inputs; the output cotangent and the input cotangents are the
   program values the template's ones land on;
3. nothing the template computes may be read outside it, except the forward
   output and the input cotangents.

The program's equations then *are* ``vjp(forward)`` on those values, so
replacing them by the kernel's forward and backward computes the same
function.  Which inputs are differentiated is not known (an input can be a
constant of the loss); each subset is tried, largest first.  Anything that
does not unify keeps the site as written, with the reason.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from flashpass import compat, errors
from flashpass.graph import Const, Node, Scope

from .common import Miss, const_key, profile, where

#: Most subsets of differentiated inputs tried per site.
MAX_TEMPLATES = 16
#: Most unification steps (candidate trials) per template.
MAX_STEPS = 20_000


@dataclasses.dataclass(frozen=True)
class Backward:
    """A site's backward in the program: what the kernel's backward replaces."""

    nodes: frozenset  # forward residual and backward equations (not the forward site's)
    cotangent: object  # key of the output's cotangent
    inputs: tuple  # keys of the differentiated inputs
    grads: tuple  # key (or Const) of each input's cotangent, in ``inputs`` order
    anchor: Node  # where the backward is emitted: its first equation
    #: A backward in another scope (a scan's backward loop, or a remat body a
    #: checkpoint policy saved values for): that scope's prefix and how the
    #: residuals reach it (`scans.ScanPair`).
    scope_prefix: tuple | None = None
    pair: object = None


def match_backward(scope: Scope, site, view=None) -> Backward | Miss:
    """The backward of ``site`` (whose intermediates are read outside it), or why not.

    ``view``: where to look for it, when not in ``scope`` (a `scans.Linked` view of
    a forward loop body and its backward loop's body, or of a scope and a remat
    body that is the site's backward)."""
    view = scope if view is None else view
    # Differentiated inputs are values the kernel reads (its cotangents are the
    # kernel's); between them and the site, equations such as a broadcast of a
    # per-head mask join the forward, with their own backward.
    reads = [r for r in (scope.resolve(a) for a in site.atoms) if not isinstance(r, Const)]
    diffable = [a for a in dict.fromkeys(reads) if _is_float(scope.aval(a).dtype)]
    last = None
    for subset in _subsets(diffable):
        forward = _forward(scope, site, subset)
        inputs = _inputs(forward)
        produced = {o for n in forward for o in n.outs if o is not None}
        if not set(subset) <= set(inputs) or any(r in produced for r in reads):
            # A read the forward computes: the kernel's vjp would miss that path;
            # a smaller subset may still prove the site.
            continue
        diff = tuple(inputs.index(a) for a in subset)
        template = _template(scope, forward, inputs, diff, site.root.out)
        found = _unify(template, view, inputs, diff, site)
        if isinstance(found, Backward):
            return found
        last = found
    reason = last if isinstance(last, str) else "no backward equations match it"
    return Miss(f"its intermediates are read by a backward pass that {reason}{where(site.root)}")


def match_ungathered(scope: Scope, site):
    """A differentiated ``site`` whose k or v is gathered along its sequence
    (Explicit axes' ``reshard``; a ``shard_map`` body's tiled ``all_gather``
    over one manual axis): the same site reading them from before the
    gathers, its backward proven with those reads (the gathers join the
    forward, their transposes the backward).  That is the site a ring runs
    (`flashpass.placement`); None where neither is gathered or that backward
    does not prove."""
    replaced = {}
    for name in ("k", "v"):
        operand = getattr(site, name)
        node = scope.producer(operand.atom)
        if node is not None and _gathers(node, operand.axes["S"]):
            replaced[name] = dataclasses.replace(operand, atom=scope.resolve(node.ins[0]))
    if not replaced:
        return None
    forward = site.nodes - site.backward.nodes
    ungathered = dataclasses.replace(site, nodes=forward, backward=None, **replaced)
    try:
        backward = match_backward(scope, ungathered)
    except Exception:  # (only the ring form is lost: the site itself is proven)
        if errors.strict():
            raise
        return None
    if isinstance(backward, Miss):
        return None
    return dataclasses.replace(ungathered, nodes=forward | backward.nodes, backward=backward)


def _gathers(node: Node, axis: int) -> bool:
    """Whether ``node`` gathers an operand along its sequence (``axis``) as a
    ring reads it from before: a ``reshard``, or a tiled ``all_gather`` over
    one manual axis (the backward template binds one)."""
    if node.prim == "reshard":
        return True
    params = node.params
    names = params.get("axis_name")
    return (
        node.prim == "all_gather"
        and bool(params.get("tiled"))
        and params.get("axis_index_groups") is None
        and params.get("all_gather_dimension") == axis
        and (not isinstance(names, tuple | list) or len(names) == 1)
    )


def _forward(scope: Scope, site, diff: tuple) -> list[Node]:
    """The site's equations and those from the differentiated reads to them."""
    reads = _inputs(sorted(site.nodes, key=lambda n: n.order))
    producers = [scope.producer(a) for a in diff]
    since = min((n.order for n in producers if n is not None), default=0)
    if any(n is None for n in producers):
        since = 0
    glue = scope.forward_cone(diff, until=site.root.order) & _feeding(scope, site, reads, since)
    return sorted(site.nodes | glue, key=lambda n: n.order)


def _feeding(scope: Scope, site, reads: list, since: int) -> set[Node]:
    """The equations that compute ``reads`` from the values the kernel reads,
    not looking past those: what produces a kernel operand is the program's
    own, with its own backward.  (A bias shared by two layers is read by the
    second after the whole first layer, whose output also makes its q: that
    layer is no part of the second site's forward, whose vjp treats q and the
    bias as the independent operands they are to the kernel.)"""
    keys = [scope.resolve(a) for a in site.atoms]
    operands = {a for a in keys if not isinstance(a, Const)}
    seen: set[Node] = set()
    stack = list(reads)
    while stack:
        key = scope.resolve(stack.pop())
        if isinstance(key, Const) or key in operands:
            continue
        node = scope.producer(key)
        if node is None or node in seen or node.order < since:
            continue
        seen.add(node)
        stack.extend(a for a in node.ins if not isinstance(a, Const))
    return seen


def _inputs(forward: list[Node]) -> list:
    produced = {o for n in forward for o in n.outs if o is not None}
    out: list = []
    for n in forward:
        for a in n.ins:
            if not isinstance(a, Const) and a not in produced and a not in out:
                out.append(a)
    return out


def _subsets(indices: list):
    yield from itertools.islice(
        (
            combo
            for size in range(len(indices), 0, -1)
            for combo in itertools.combinations(indices, size)
        ),
        MAX_TEMPLATES,
    )


#: Templates by the forward's structure: every layer of a model shares one.
_TEMPLATES: collections.OrderedDict = collections.OrderedDict()
_TEMPLATE_LIMIT = 64


def _template(scope: Scope, forward: list[Node], inputs: list, diff: tuple, out_key) -> Scope:
    """The view of ``(inputs..., ct) -> (out, vjp(ct)...)`` for the forward equations
    (cached by `_signature`; its inputs are positional, so a cached one serves any
    site of the same structure)."""
    key = _signature(scope, forward, inputs, diff, out_key)
    found = _TEMPLATES.get(key)
    if found is None:
        found = _TEMPLATES[key] = _trace_template(scope, forward, inputs, diff, out_key)
        while len(_TEMPLATES) > _TEMPLATE_LIMIT:
            _TEMPLATES.popitem(last=False)
    else:
        _TEMPLATES.move_to_end(key)
    return found


def _signature(scope: Scope, forward: list[Node], inputs: list, diff: tuple, out_key):
    where_is = {a: ("in", i) for i, a in enumerate(inputs)}
    nodes = []
    for i, n in enumerate(forward):
        refs = tuple(
            const_key(a) if isinstance(a, Const) else where_is.get(a, ("?", id(a))) for a in n.ins
        )
        nodes.append((n.prim, str(n.params), refs))
        for j, o in enumerate(n.outs):
            if o is not None:
                where_is[o] = ("node", i, j)
    # Types in full (inside a shard_map: varying axes) and the ambient mesh: autodiff
    # writes other equations there, so a template must not cross contexts.
    avals = tuple(compat.aval_key(scope.aval(a)) for a in inputs)
    out = compat.aval_key(scope.aval(out_key))
    return (tuple(nodes), avals, diff, where_is.get(out_key), out, str(compat.context_mesh()))


def _trace_template(scope: Scope, forward: list[Node], inputs: list, diff: tuple, out_key):

    def f(*vals):
        env = dict(zip(inputs, vals, strict=True))
        for n in forward:
            args = [a.value if isinstance(a, Const) else env[a] for a in n.ins]
            for o, val in zip(n.outs, compat.bind_equation(n.eqn, args), strict=True):
                if o is not None:
                    env[o] = val
        return env[out_key]

    def joint(*args):
        *vals, ct = args

        def part(*d):
            full = list(vals)
            for i, x in zip(diff, d, strict=True):
                full[i] = x
            return f(*full)

        out, vjp = jax.vjp(part, *(vals[i] for i in diff))
        return (out, *vjp(ct))

    # Traced with no varying manual axes, as outside the body's shard_map the
    # primitives give none (`_signature` keeps them in the cache key); the
    # manual axes the forward's collectives name (a ring's gathers) are bound.
    avals = [compat.without_varying(scope.aval(a)) for a in [*inputs, out_key]]
    with compat.axis_env(_collective_axes(forward)):
        closed = jax.make_jaxpr(joint)(*avals)
    return Scope(compat.dce_closed_jaxpr(closed), prefix=("template",))


def _collective_axes(forward: list[Node]) -> dict:
    """``{axis name: size}`` of the single-axis collectives in ``forward``."""
    sizes = {}
    for n in forward:
        name, size = n.params.get("axis_name"), n.params.get("axis_size")
        if isinstance(name, tuple | list) and len(name) == 1:
            name = name[0]
        if isinstance(name, str) and isinstance(size, int):
            sizes[name] = size
    return sizes


def _unify(t: Scope, j: Scope, inputs: list, diff: tuple, site) -> Backward | str:
    """Map every template equation onto a program equation (see the module doc)."""
    n_in = len(inputs)
    env = {t.invars[i]: inputs[i] for i in range(n_in)}
    state = _State(env, {v: k for k, v in env.items()}, {}, set(), _template_fills(t))
    solved = _search(t, j, state, site, [MAX_STEPS])
    if solved is None:
        return "does not compute vjp(attention) (its equations differ from JAX's own vjp)"
    env, pairs = solved.env, solved.pairs
    matched = set(pairs.values())
    if not site.nodes <= matched:
        return "recomputes the attention elsewhere"
    ct_key = env.get(t.invars[n_in])
    if ct_key is None or isinstance(ct_key, Const):
        return "has no output cotangent"
    outs = [env.get(o) if not isinstance(o, Const) else o for o in t.outputs]
    if any(o is None for o in outs) or outs[0] != site.root.out:
        return "does not produce every cotangent"
    exits = {o for o in outs if not isinstance(o, Const)}
    # A backward body's recompute of matched forward values (`scans.Linked.twin`)
    # is part of what the kernel's backward replaces.
    twin = getattr(j, "twin", None)
    if twin is not None:
        grown = True
        while grown:
            grown = False
            for node in list(matched):
                for o in node.outs:
                    for user, _ in j.consumers(o) if o is not None else ():
                        if user not in matched and twin(user) in matched:
                            matched.add(user)
                            grown = True
    for node in matched:
        if node.eqn.effects and not compat.only_axis_effects(node.eqn.effects):
            return f"has an effect (`{node.prim}`)"
        for o in node.outs:
            if o is None or o in exits:
                continue
            if j.is_output(o):
                return f"returns an intermediate (`{node.prim}`){where(node)}"
            for user, _ in j.consumers(o):
                if user not in matched:
                    return f"shares `{node.prim}`{where(node)} with `{user.prim}`{where(user)}"
    backward, stack = set(), [ct_key]  # the matched equations reading the cotangent
    while stack:
        for user, _ in j.consumers(stack.pop()):
            if user in matched and user not in backward:
                backward.add(user)
                stack.extend(o for o in user.outs if o is not None)
    if not backward:
        return "never reads the output cotangent"
    anchor = min(backward, key=lambda n: n.order)
    after = getattr(j, "after", None)
    if not (after(anchor, site.root) if after else anchor.order > site.root.order):
        return "runs before the forward"
    return Backward(
        nodes=frozenset(matched - site.nodes),
        cotangent=ct_key,
        inputs=tuple(inputs[i] for i in diff),
        grads=tuple(outs[1:]),
        anchor=anchor,
    )


@dataclasses.dataclass
class _State:
    env: dict  # template key -> program atom
    rev: dict  # program key -> template key
    pairs: dict  # template node -> program node
    used: set  # program nodes already paired
    #: Template values that are a scalar filled out (zeros, ones): matched by value,
    #: however the program builds them (`vmap` of a backward broadcasts in steps).
    fills: dict = dataclasses.field(default_factory=dict)

    def copy(self) -> _State:
        return _State(dict(self.env), dict(self.rev), dict(self.pairs), set(self.used), self.fills)


def _search(t: Scope, j: Scope, state: _State, site, budget: list) -> _State | None:
    """Pair every template node; unambiguous pairs first, then try each choice."""
    required = [tn for tn in t.nodes if not all(o in state.fills for o in tn.outs if o)]
    while True:
        progress = False
        ambiguous = None
        for tn in required:
            if tn in state.pairs:
                continue
            cands = _candidates(tn, t, j, state)
            budget[0] -= 1
            if budget[0] < 0:
                return None
            if cands is None:  # nothing to anchor it yet
                continue
            if not cands:
                return None
            if len(cands) > 1:
                preferred = [c for c in cands if c in site.nodes]
                cands = preferred if len(preferred) == 1 else cands
            if len(cands) == 1:
                _bind(tn, cands[0], state, getattr(j, "canon", None), j)
                progress = True
            elif ambiguous is None:
                ambiguous = (tn, cands)
        if len(state.pairs) == len(required):
            return state
        if progress:
            continue
        if ambiguous is None:
            return None
        tn, cands = ambiguous
        for cand in cands:
            trial = state.copy()
            _bind(tn, cand, trial, getattr(j, "canon", None), j)
            found = _search(t, j, trial, site, budget)
            if found is not None:
                return found
        return None


def _candidates(tn: Node, t: Scope, j: Scope, state: _State) -> list | None:
    """Program nodes ``tn`` can pair with (None: none of its values is mapped yet)."""
    # Consumers of any mapped operand: the program may read a value the template
    # reads as an equal broadcast of it (`_view`), so one operand's pool can miss.
    pool = None
    for pos, a in enumerate(tn.ins):
        if isinstance(a, Const) or a not in state.env:
            continue
        mapped = state.env[a]
        if isinstance(mapped, Const):
            continue
        swaps = tn.prim in _COMMUTATIVE and len(tn.ins) == 2
        pool = (pool or []) + [n for n, p in j.consumers(mapped) if p == pos or swaps]
    if pool is None:
        for o in tn.outs:
            if o is not None and o in state.env and not isinstance(state.env[o], Const):
                producer = j.producer(state.env[o])
                pool = [] if producer is None else [producer]
                break
    if pool is None:
        return None
    canon = getattr(j, "canon", None)
    return [n for n in dict.fromkeys(pool) if n not in state.used and _fits(tn, n, state, canon, j)]


#: Binary equations whose operands may come in either order: autodiff sums a
#: value's cotangents in the order it meets its uses, which a call boundary
#: (a ``jit`` around a ``where``) changes; floating-point ``a + b`` and
#: ``a * b`` are ``b + a`` and ``b * a`` exactly.
_COMMUTATIVE = frozenset({"add_any", "add", "mul"})


def _fits(tn: Node, jn: Node, state: _State, canon=None, j=None) -> bool:
    return _fitting_ins(tn, jn, state, canon, j) is not None


def _fitting_ins(tn: Node, jn: Node, state: _State, canon=None, j=None):
    """``jn``'s operands in the order they pair with ``tn``'s, or None."""
    if tn.prim != jn.prim or len(tn.ins) != len(jn.ins) or len(tn.outs) != len(jn.outs):
        return None
    if not _same_params(tn.params, jn.params):
        return None
    ins = tuple(_canon(jn.ins, canon))
    orders = [ins]
    if tn.prim in _COMMUTATIVE and len(ins) == 2 and ins[0] is not ins[1]:
        orders.append(ins[::-1])
    for order in orders:
        if _fits_in_order(tn, jn, order, state, j):
            return order
    return None


def _fits_in_order(tn: Node, jn: Node, ins, state: _State, j=None) -> bool:
    for a, b in zip(tn.ins, ins, strict=True):
        if not isinstance(a, Const) and a in state.fills:
            if _fill(j, b) != state.fills[a]:
                return False
            continue
        if isinstance(a, Const):
            if not (isinstance(b, Const) and _same_const(a, b)):
                return False
        elif a in state.env:
            mapped = state.env[a]
            if isinstance(mapped, Const):
                if not (isinstance(b, Const) and _same_const(mapped, b)):
                    return False
            elif mapped != b and (isinstance(b, Const) or _view(j, mapped) != _view(j, b)):
                return False
        elif isinstance(b, Const) or state.rev.get(b, a) != a:
            return False
    for a, b in zip(tn.outs, jn.outs, strict=True):
        if a is None or b is None:
            if (a is None) != (b is None):
                return False
            continue
        if a in state.env and state.env[a] != b:
            return False
        if state.rev.get(b, a) != a:
            return False
    return True


def _bind(tn: Node, jn: Node, state: _State, canon=None, j=None) -> None:
    ins = _fitting_ins(tn, jn, state, canon, j)
    ins = tuple(_canon(jn.ins, canon)) if ins is None else ins
    state.pairs[tn] = jn
    state.used.add(jn)
    pairs = zip((*tn.ins, *tn.outs), (*ins, *jn.outs), strict=True)
    for a, b in pairs:
        if a is None or isinstance(a, Const) or a in state.env or a in state.fills:
            continue
        state.env[a] = b
        state.rev[b] = a


def _view(scope, atom):
    """A value's identity modulo broadcasting: ``(base, base axis of each axis or
    None, shape, dtype)`` by `patterns.common.profile`, so two broadcasts of one
    value (``vmap`` re-broadcasts a mask) compare equal.  Size-1 axes carry
    nothing; a constant base has no identity here (`_fill` compares those)."""
    aval = scope.aval(atom)
    shape = tuple(aval.shape)
    prof = profile(scope, atom, shape)
    if isinstance(prof.base, Const):
        return None
    axes = tuple(None if shape[i] == 1 else a for i, a in enumerate(prof.axes))
    return (prof.base, axes, shape, str(aval.dtype))


def _template_fills(t: Scope) -> dict:
    fills = t.__dict__.get("_fills")
    if fills is None:
        fills = {o: f for n in t.nodes for o in n.outs if o and (f := _fill(t, o)) is not None}
        t.__dict__["_fills"] = fills
    return fills


_FILL_PRIMS = ("broadcast_in_dim", "reshape", "convert_element_type")


def _fill(scope, atom):
    """``(value, shape, dtype)`` when ``atom`` is a scalar constant broadcast (or
    reshaped, or cast) to its shape, else None."""
    if isinstance(atom, Const):
        value = np.asarray(atom.value)
        aval = atom.aval
    else:
        try:
            aval = scope.aval(atom)
        except KeyError:
            return None
        node = scope.producer(atom)
        while node is not None and node.prim in _FILL_PRIMS and len(node.ins) == 1:
            atom = node.ins[0]
            node = None if isinstance(atom, Const) else scope.producer(atom)
        if not isinstance(atom, Const):
            return None
        value = np.asarray(atom.value)
    if value.size != 1 or not np.issubdtype(value.dtype, np.number):
        return None
    return (float(value.reshape(())), tuple(aval.shape), str(aval.dtype))


def _canon(atoms, canon) -> list:
    return list(atoms) if canon is None else [canon(a) for a in atoms]


def _same_params(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for name in a:
        x, y = a[name], b[name]
        if x is y:
            continue
        try:
            if compat.is_body(x) or compat.is_body(y):
                same = str(x) == str(y)
            else:
                same = bool(x == y)
        except Exception:
            same = False
        if not same:
            return False
    return True


def _same_const(a: Const, b: Const) -> bool:
    if a.value is b.value:
        return True
    x, y = np.asarray(a.value), np.asarray(b.value)
    if x.shape != y.shape or x.dtype != y.dtype or x.size > 1 << 16:
        return False
    return bool(np.array_equal(x, y, equal_nan=True))


def _is_float(dtype) -> bool:
    try:  # a typed PRNG key's dtype is no numpy dtype
        return bool(jnp.issubdtype(dtype, jnp.floating))
    except TypeError:
        return False
