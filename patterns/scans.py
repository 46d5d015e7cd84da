"""Training through ``lax.scan``: a site in the forward loop, its backward in the backward loop.

Autodiff of a ``scan`` (layers under ``lax.scan`` in a train step) writes two
loops: the forward loop returns, stacked over iterations, the residuals the
backward needs (the T×S probabilities among them), and the backward loop reads
them, one iteration at a time.  The site is in the first loop's body, its
backward in the second's.

`match_pair` joins the two bodies into one view (`Linked`): a residual the
forward body returns and the backward body reads is one value.  The backward
is then proven exactly as in one scope (`backward.match_backward`).  The
rewrite (rewrite.py) re-emits both loops with ``lax.scan``: the forward body
runs the kernel's forward and returns the kernel's residuals (the leaves of
its ``vjp`` pullback: q, k, v, the output and its logsumexp) instead of the
probabilities, and the backward body rebuilds the pullback from them.

`match_remat` does the same for a ``jax.checkpoint`` whose policy saves values
of the site (``dots_saveable``, ``everything_saveable``...): the forward runs in
the enclosing scope and the remat body is the backward, recomputing from the
saved values what was not saved; a recomputed equation is the forward's *twin*
(value numbering in `Linked`).  The remat is re-emitted with ``jax.checkpoint``,
taking the pullback's leaves as operands.
"""

from __future__ import annotations

import dataclasses

from flashpass import compat
from flashpass.graph import Const, Scope

from .backward import match_backward
from .common import Miss, const_key


@dataclasses.dataclass(frozen=True)
class ScanPair:
    """The two loops of a differentiated ``scan`` around one site."""

    forward: object  # the forward scan's node (in the enclosing scope); None: see below
    backward: object  # the backward scan's node, or a remat whose body is the backward
    #: Outputs of the forward scan no longer returned (positions among its
    #: outputs) and the backward scan's operands no longer passed (positions
    #: among its operands): residuals only the replaced backward read.
    dropped_outputs: tuple
    dropped_operands: tuple


class Linked:
    """One view of a forward loop body and its backward loop's body.

    ``links`` maps a backward-body input to the forward-body value whose
    stacked iterations it receives.  Keys are global, so each query asks both
    scopes; a linked input answers as its forward value.
    """

    def __init__(
        self, fwd: Scope, bwd: Scope, links: dict, free_outputs: set, near=None, consts=None
    ):
        """``near``: the forward nodes a recompute may repeat (default: all); the
        latest of equal ones is its twin (each layer computes its own mask)."""
        self.fwd, self.bwd, self.links = fwd, bwd, links
        self.near = near
        self.consts = consts or {}  # backward-body input -> the constant it receives
        self.back: dict = {}
        for b, f in links.items():
            self.back.setdefault(f, []).append(b)
        self.free_outputs = free_outputs  # forward-body outputs that are not residual links
        self.bwd_nodes = set(bwd.nodes)
        self.twins: dict = {}  # backward-body node -> the forward node it recomputes
        self._link_recomputes()

    def _link_recomputes(self) -> None:
        """A backward body that recomputes a forward value (a remat policy saved the
        scores, the body recomputes the softmax from them) computes the same
        equation on the same values: value numbering links its output too."""
        sigs = _signatures(self.fwd.nodes if self.near is None else self.near)
        for node in self.bwd.nodes:  # in order: operands are linked before their readers
            if node.eqn.effects or compat.subjaxprs_of_params(node.params):
                continue
            twin = sigs.get(_signature(node, lambda a: self.consts.get(a) or self.canon(a)))
            if twin is None:
                continue
            self.twins[node] = twin
            for mine, theirs in zip(node.outs, twin.outs, strict=True):
                if mine is not None and theirs is not None:
                    self.links[mine] = theirs
                    self.back.setdefault(theirs, []).append(mine)

    def twin(self, node):
        return self.twins.get(node)

    def canon(self, atom):
        if isinstance(atom, Const):
            return atom
        return self.links.get(atom, atom)

    resolve = canon  # the `Scope` query `patterns.common.profile` makes

    def shape(self, atom) -> tuple:
        return tuple(self.aval(atom).shape)

    def consumers(self, atom) -> list:
        atom = self.canon(atom)
        out = self.fwd.consumers(atom) + self.bwd.consumers(atom)
        for b in self.back.get(atom, ()):
            out += self.bwd.consumers(b)
        return out

    def producer(self, atom):
        atom = self.canon(atom)
        return self.fwd.producer(atom) or self.bwd.producer(atom)

    def aval(self, atom):
        atom = self.canon(atom)
        try:
            return self.fwd.aval(atom)
        except KeyError:
            return self.bwd.aval(atom)

    def is_output(self, atom) -> bool:
        atom = self.canon(atom)
        return atom in self.free_outputs or self.bwd.is_output(atom)

    def after(self, node, root) -> bool:
        return node in self.bwd_nodes


def _signature(node, canon=None):
    ins = []
    for a in node.ins:
        a = canon(a) if canon is not None and not isinstance(a, Const) else a
        ins.append(const_key(a) if isinstance(a, Const) else a)
    return (node.prim, str(node.params), tuple(ins))


def _signatures(nodes) -> dict:
    """Signature -> the latest of ``nodes`` computing it."""
    sigs = {}
    for node in sorted(nodes, key=lambda n: n.order):
        if not node.eqn.effects and not compat.subjaxprs_of_params(node.params):
            sigs[_signature(node)] = node
    return sigs


def match_pair(parent: Scope, child, fwd: Scope, site, scopes: dict):
    """``site`` (in the body ``fwd`` of the scan ``child.node``) with its backward
    in the backward loop's body, or a `Miss` saying why not."""
    fnode = child.node
    if fnode.prim != "scan" or child.param != "jaxpr":
        return Miss(f"its backward outside a `{fnode.prim}` body is not followed (only a scan's)")
    n_consts, n_carry = compat.scan_counts(fnode.params)
    # The backward loop: the scan reading the forward loop's stacked outputs.
    readers = {
        user
        for o in fnode.outs[n_carry:]
        if o is not None
        for user, _ in parent.consumers(o)
        if user.prim == "scan" and user is not fnode
    }
    last = Miss("no backward loop reads them")
    for bnode in sorted(readers, key=lambda n: n.order):
        bwd = scopes.get((*bnode.path, "jaxpr"))
        if bwd is None:
            continue
        found = _with_backward(parent, fnode, bnode, fwd, bwd, site)
        if not isinstance(found, Miss):
            return found
        last = found
    return last


def _with_backward(parent: Scope, fnode, bnode, fwd: Scope, bwd: Scope, site):
    f_consts, f_carry = compat.scan_counts(fnode.params)
    b_consts, b_carry = compat.scan_counts(bnode.params)
    links, link_at = {}, {}  # bwd input key -> fwd value; fwd output position -> bwd operand
    for pos, o in enumerate(fnode.outs):
        if o is None or pos < f_carry:
            continue
        users = parent.consumers(o)
        if not users or any(u is not bnode or p < b_consts + b_carry for u, p in users):
            continue
        value = fwd.outputs[pos]
        if isinstance(value, Const):
            continue
        for _, p in users:
            links[bwd.invars[p]] = value
            link_at.setdefault(pos, []).append(p)
    if not links:
        return Miss("no backward loop reads its residuals")
    # Loop invariants both loops receive (a mask): one value too.
    invariants = ((parent.resolve(fnode.ins[i]), fwd.invars[i]) for i in range(f_consts))
    outer = {atom: var for atom, var in invariants if not isinstance(atom, Const)}
    for j in range(b_consts):
        atom = parent.resolve(bnode.ins[j])
        same = None if isinstance(atom, Const) else outer.get(atom)
        if same is not None:
            links[bwd.invars[j]] = same
    free = {o for i, o in enumerate(fwd.outputs) if i not in link_at and not isinstance(o, Const)}
    view = Linked(fwd, bwd, links, free)
    backward = match_backward(fwd, site, view)
    if isinstance(backward, Miss):
        return backward
    matched = backward.nodes | site.nodes
    dropped_out, dropped_in = [], []
    for pos, operands in link_at.items():
        if all(u in matched for p in operands for u, _ in bwd.consumers(bwd.invars[p])):
            dropped_out.append(pos)
            dropped_in.extend(operands)
    pair = ScanPair(fnode, bnode, tuple(sorted(dropped_out)), tuple(sorted(dropped_in)))
    return _paired(site, backward, bwd, pair)


def _paired(site, backward, bwd: Scope, pair: ScanPair):
    """``site`` with its ``backward`` in the scope ``bwd``, reached through ``pair``."""
    backward = dataclasses.replace(backward, scope_prefix=bwd.prefix, pair=pair)
    return dataclasses.replace(site, nodes=site.nodes | backward.nodes, backward=backward)


#: Remat primitives: a backward computed in a remat body (values a checkpoint
#: policy saved are passed to it as operands).
REMATS = frozenset({"checkpoint", "remat", "remat2"})


def match_remat(scope: Scope, site, scopes: dict):
    """``site`` (in ``scope``) with its backward in the body of a remat equation
    of the same scope that receives the site's saved intermediates (a
    ``jax.checkpoint`` policy that saves them: ``everything_saveable``,
    ``save_anything_except_these_names``), or a `Miss`."""
    internal = {o for n in site.nodes for o in n.outs if o is not None}
    remats = {
        user
        for o in internal
        for user, _ in scope.consumers(o)
        if user.prim in REMATS and user not in site.nodes
    }
    last = Miss("no remat body reads its intermediates")
    for rnode in sorted(remats, key=lambda n: n.order):
        bwd = scopes.get((*rnode.path, "jaxpr"))
        if bwd is None:
            continue
        if len(rnode.ins) != len(bwd.invars):
            continue
        operands = [(bwd.invars[i], scope.resolve(a)) for i, a in enumerate(rnode.ins)]
        links = {b: a for b, a in operands if not isinstance(a, Const)}
        consts = {b: a for b, a in operands if isinstance(a, Const)}
        free = {o for o in scope.outputs if not isinstance(o, Const)}
        reads = [a for n in site.nodes for a in n.ins if not isinstance(a, Const)]
        near = scope.backward_cone(reads) | site.nodes
        view = _RematView(Linked(scope, bwd, links, free, near, consts), rnode)
        backward = match_backward(scope, site, view)
        if isinstance(backward, Miss):
            last = backward
            continue
        matched = backward.nodes | site.nodes
        dropped = tuple(
            i
            for i, v in enumerate(bwd.invars)
            if v in links and all(u in matched for u, _ in bwd.consumers(v))
        )
        return _paired(site, backward, bwd, ScanPair(None, rnode, (), dropped))
    return last


class _RematView(Linked):
    """`Linked` for a remat backward: the remat equation itself reads the forward
    values it passes into its body; those reads are the body's."""

    def __init__(self, linked: Linked, rnode):
        self.__dict__.update(linked.__dict__)
        self.rnode = rnode

    def consumers(self, atom) -> list:
        return [(u, p) for u, p in super().consumers(atom) if u is not self.rnode]
