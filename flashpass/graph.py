"""A use-def view of a jaxpr that looks through nested calls.

Attention code is rarely in one flat jaxpr: ``jnp.where``, ``jnp.tril`` and user
helpers are nested ``jit`` calls, layers live in ``scan``/``remat`` bodies.  A
`Scope` is one jaxpr (the top level, or the body of an *opaque* higher-order
primitive such as ``scan``) with every *transparent* call (``jit``,
``closed_call``) inlined, so a pattern can follow values across call
boundaries.  Opaque bodies become child scopes, matched on their own.

Every equation is addressed by a global `Path`: the equation indices and
parameter names leading to it from the top-level jaxpr, e.g.
``(4, "jaxpr", 2)`` is equation 2 of the body of top-level equation 4.  Values
are addressed by `Key`: the path of the jaxpr instance they live in, plus the
`Var`.  A body called twice is two instances, so its values get two keys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from . import compat

#: Calls whose bodies are inlined into the enclosing scope's view.
TRANSPARENT_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})

#: Name prefix of the kernel calls the pass emits (a ``jit`` named
#: ``flashpass_<kernel>``, made by calls.py).  They are opaque: never inlined,
#: never matched again, so the pass is idempotent.
KERNEL_PREFIX = "flashpass_"

#: Largest intermediate (in elements) constant folding will materialise.
FOLD_LIMIT = 1 << 27

Path = tuple
Key = tuple  # (instance path, Var)


@dataclasses.dataclass(frozen=True)
class Const:
    """A literal or a closed-over constant used as an operand."""

    value: Any
    aval: Any


@dataclasses.dataclass(eq=False)
class Node:
    """One equation in a scope's view."""

    path: Path
    eqn: Any
    ins: list  # Key | Const
    outs: list  # Key | None (dropped outputs)
    order: int
    calls: tuple  # paths of the transparent call equations this node sits inside
    call_eqns: tuple = ()  # those call equations (innermost last), for locations

    @property
    def prim(self) -> str:
        return self.eqn.primitive.name

    @property
    def params(self) -> dict:
        return self.eqn.params

    @property
    def out(self):
        return self.outs[0]

    @property
    def location(self) -> str | None:
        """User source line of this equation, else of the innermost call holding it."""
        for eqn in (self.eqn, *reversed(self.call_eqns)):
            loc = compat.user_location(eqn)
            if loc is not None:
                return loc
        return None

    def __repr__(self) -> str:
        return f"<{self.prim} @ {self.path}>"


@dataclasses.dataclass(frozen=True)
class ChildScope:
    """An opaque higher-order equation's body, matched as its own scope."""

    node: Node
    param: str  # params key ("jaxpr", "branches", ...)
    index: int | None  # position inside a tuple param (cond branches)
    closed: Any  # ClosedJaxpr (open Jaxprs are wrapped with no consts)

    @property
    def prefix(self) -> Path:
        step = self.param if self.index is None else f"{self.param}[{self.index}]"
        return (*self.node.path, step)


class Scope:
    """The view of one jaxpr with transparent calls inlined."""

    def __init__(
        self,
        closed,
        prefix: Path = (),
        outer: dict | None = None,
        sliced: dict | None = None,
        parent: Scope | None = None,
        threaded: bool = False,
    ):
        """``outer``: body input key -> ``(parent Scope, operand atom)`` for the
        inputs that hold an operand of the enclosing equation unchanged
        (`compat.passthrough_operands`): constant folding follows them out.
        ``parent``: the enclosing scope (None at the top level); ``threaded``:
        whether the rewriter can give this body more operands
        (`compat.threads_operands`), so a site here may read values of the
        enclosing scopes (`Scope.outside`)."""
        self.closed = closed = compat.as_closed(closed)
        self.prefix = prefix
        self.outer = outer or {}
        self.parent = parent
        self.threaded = threaded
        #: body input key -> (parent Scope, operand atom) of which each iteration
        #: gets a slice (a scan's scanned inputs): a uniform operand, a uniform slice.
        self.sliced = sliced or {}
        self.nodes: list[Node] = []
        self.children: list[ChildScope] = []
        self._producer: dict[Key, Node] = {}
        self._consumers: dict[Key, list[tuple[Node, int]]] = {}
        self._alias: dict[Key, Key | Const] = {}
        self._avals: dict[Key, Any] = {}
        self._fold_cache: dict[Key, Any] = {}
        jaxpr, consts = compat.closed_parts(closed)
        self.invars = [self._key(prefix, v) for v in jaxpr.invars]
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            self._alias[(prefix, var)] = Const(value, var.aval)
        self._walk(jaxpr, prefix, calls=(), call_eqns=())
        self.outputs = [self.resolve(self._atom(prefix, v)) for v in jaxpr.outvars]
        self._output_keys = {o for o in self.outputs if not isinstance(o, Const)}

    # ------------------------------------------------------------------ building

    def _key(self, inst: Path, var) -> Key:
        key = (inst, var)
        self._avals.setdefault(key, var.aval)
        return key

    def _atom(self, inst: Path, atom):
        if compat.is_literal(atom):
            return Const(compat.literal_value(atom), atom.aval)
        return self._key(inst, atom)

    def _walk(self, jaxpr, inst: Path, calls: tuple, call_eqns: tuple) -> None:
        for i, eqn in enumerate(jaxpr.eqns):
            path = (*inst, i)
            ins = [self.resolve(self._atom(inst, a)) for a in eqn.invars]
            kernel_call = is_kernel_call(eqn)
            if compat.is_view_identity(eqn):  # an identity: its output is its operand
                out = eqn.outvars[0]
                if not compat.is_drop_var(out):
                    self._avals.setdefault((inst, out), out.aval)
                    self._alias[(inst, out)] = ins[0]
                continue
            if (
                not kernel_call
                and eqn.primitive.name in TRANSPARENT_CALLS
                and "jaxpr" in eqn.params
            ):
                self._inline(eqn, path, ins, calls, call_eqns)
                continue
            outs = [None if compat.is_drop_var(v) else self._key(inst, v) for v in eqn.outvars]
            node = Node(path, eqn, ins, outs, len(self.nodes), calls, call_eqns)
            self.nodes.append(node)
            for pos, a in enumerate(ins):
                if not isinstance(a, Const):
                    self._consumers.setdefault(a, []).append((node, pos))
            for o in outs:
                if o is not None:
                    self._producer[o] = node
            if not kernel_call:
                self._collect_children(node)

    def _inline(self, eqn, path: Path, ins: list, calls: tuple, call_eqns: tuple) -> None:
        body, consts = compat.closed_parts(eqn.params["jaxpr"])
        inst = (*path, "jaxpr")
        for var, value in zip(body.constvars, consts, strict=True):
            self._alias[(inst, var)] = Const(value, var.aval)
        for var, outer in zip(body.invars, ins, strict=True):
            self._avals.setdefault((inst, var), var.aval)
            self._alias[(inst, var)] = outer
        self._walk(body, inst, (*calls, path), (*call_eqns, eqn))
        for outer, inner in zip(eqn.outvars, body.outvars, strict=True):
            if compat.is_drop_var(outer):
                continue
            self._avals.setdefault((path[:-1], outer), outer.aval)
            self._alias[(path[:-1], outer)] = self.resolve(self._atom(inst, inner))

    def _collect_children(self, node: Node) -> None:
        for name, index, body in compat.bodies_in_params(node.params):
            self.children.append(ChildScope(node, name, index, compat.as_closed(body)))

    def outer_of(self, child: ChildScope, sliced: bool = False) -> dict:
        """The ``outer`` (or ``sliced``) map of ``child``'s scope (see `Scope.__init__`)."""
        jaxpr, _ = compat.closed_parts(child.closed)
        eqn = child.node.eqn
        pairs = (
            compat.sliced_operands(eqn, child.param)
            if sliced
            else compat.passthrough_operands(eqn, child.param, child.index)
        )
        out = {}
        for i, j in pairs.items():
            if i < len(jaxpr.invars) and j < len(child.node.ins):
                out[(child.prefix, jaxpr.invars[i])] = (self, child.node.ins[j])
        return out

    # ------------------------------------------------------------------ queries

    def resolve(self, atom):
        """Follow aliases (call boundaries) to the canonical key or constant."""
        seen = 0
        while not isinstance(atom, Const) and atom in self._alias:
            atom = self._alias[atom]
            seen += 1
            if seen > 10_000:  # pragma: no cover - defensive
                raise RuntimeError("alias cycle in jaxpr view")
        return atom

    def aval(self, atom):
        atom = self.resolve(atom)
        if isinstance(atom, Const):
            return atom.aval
        if atom not in self._avals and self.parent is not None:
            return self.parent.aval(atom)  # a value of an enclosing scope (`outside`)
        return self._avals[atom]

    def owns(self, atom) -> bool:
        """Whether ``atom`` is a constant or a value of this scope's own jaxpr
        (not one of an enclosing scope's, which a site reads through `outside`)."""
        atom = self.resolve(atom)
        return isinstance(atom, Const) or atom in self._avals

    def outside(self, atom):
        """``(enclosing Scope, operand atom)`` when ``atom`` is an input of this
        body that holds the enclosing equation's operand unchanged on every
        iteration (a ``scan``'s loop-invariant constant, any operand of a
        ``remat`` body: never a carry or a scanned slice) and the rewriter can
        thread that scope's values into this body (``threaded``); else None.
        Mask reading follows it to read the mask where it is built."""
        atom = self.resolve(atom)
        if not self.threaded or isinstance(atom, Const) or atom not in self.outer:
            return None
        if self.producer(atom) is not None:
            return None
        parent, outer = self.outer[atom]
        return parent, parent.resolve(outer)

    def shape(self, atom) -> tuple[int, ...]:
        return tuple(self.aval(atom).shape)

    def dtype(self, atom):
        return np.dtype(self.aval(atom).dtype)

    def producer(self, atom) -> Node | None:
        atom = self.resolve(atom)
        if isinstance(atom, Const):
            return None
        return self._producer.get(atom)

    def consumers(self, atom) -> list[tuple[Node, int]]:
        atom = self.resolve(atom)
        if isinstance(atom, Const):
            return []
        return self._consumers.get(atom, [])

    def is_output(self, atom) -> bool:
        atom = self.resolve(atom)
        return not isinstance(atom, Const) and atom in self._output_keys

    def forward_cone(self, start: Iterable, until: int | None = None) -> set[Node]:
        """All nodes that (transitively) consume any of the ``start`` keys
        (only nodes up to order ``until``, when given)."""
        seen: set[Node] = set()
        stack = [self.resolve(s) for s in start]
        while stack:
            key = stack.pop()
            for node, _ in self.consumers(key):
                if until is not None and node.order > until:
                    continue
                if node not in seen:
                    seen.add(node)
                    stack.extend(o for o in node.outs if o is not None)
        return seen

    def backward_cone(
        self, start: Iterable, stop: set[Node] | None = None, since: int | None = None
    ) -> set[Node]:
        """All nodes that (transitively) produce any of the ``start`` atoms (only
        nodes from order ``since`` on, when given)."""
        seen: set[Node] = set()
        stack = [self.resolve(s) for s in start]
        while stack:
            node = self.producer(stack.pop())
            if node is None or node in seen or (since is not None and node.order < since):
                continue
            seen.add(node)
            if stop is not None and node in stop:
                continue
            stack.extend(a for a in node.ins if not isinstance(a, Const))
        return seen

    # ------------------------------------------------------------------ constant folding

    def fold(self, atom):
        """The concrete value of ``atom`` if it depends on no input, else None.

        Evaluates the producing equations eagerly (on the host) once and
        caches the result; refuses intermediates above `FOLD_LIMIT` elements.
        """
        atom = self.resolve(atom)
        if isinstance(atom, Const):
            return np.asarray(atom.value)
        if atom in self._fold_cache:
            return self._fold_cache[atom]
        value = self._fold(atom)
        self._fold_cache[atom] = value
        return value

    def _fold(self, key):
        node = self.producer(key)
        if node is None and key in self.outer:  # e.g. a constant hoisted out of a scan
            parent, atom = self.outer[key]
            return parent.fold(atom)
        if node is None or node.eqn.effects or compat.subjaxprs_of_params(node.params):
            return None
        if node.prim in compat.VALUE_IDENTITY_PRIMITIVES:  # e.g. pvary in shard_map bodies
            return self.fold(node.ins[node.outs.index(key)])
        for o in node.outs:
            if o is not None and math.prod(self.shape(o)) > FOLD_LIMIT:
                return None
        args = []
        for a in node.ins:
            value = self.fold(a)
            if value is None:
                return None
            args.append(value)
        outs = compat.evaluate_equation(node.eqn, args)
        for o, value in zip(node.outs, outs, strict=True):
            if o is not None:
                self._fold_cache[o] = np.asarray(value)
        return self._fold_cache[key]


def is_kernel_call(eqn) -> bool:
    """Whether ``eqn`` is a kernel call the pass emitted (`KERNEL_PREFIX`)."""
    name = eqn.params.get("name")
    return isinstance(name, str) and name.startswith(KERNEL_PREFIX)


def build_scopes(closed) -> list[Scope]:
    """The top-level scope and, recursively, every opaque body's scope."""
    scopes: list[Scope] = []
    pending = [(closed, (), None, None, None, False)]
    while pending:
        jaxpr, prefix, outer, sliced, parent, threaded = pending.pop(0)
        scope = Scope(jaxpr, prefix, outer, sliced, parent, threaded)
        scopes.append(scope)
        pending.extend(
            (
                c.closed,
                c.prefix,
                scope.outer_of(c),
                scope.outer_of(c, sliced=True),
                scope,
                compat.threads_operands(c.node.eqn, c.param, c.index),
            )
            for c in scope.children
        )
    return scopes
