"""Rewriting: evaluate a jaxpr with its sites swapped for kernel calls, re-trace.

The rewritten program is produced the way Equinox's jaxpr finalisation does
it: an ``eval_jaxpr``-style interpreter binds every equation as written,
except that

* a site's equations are skipped and, at its root, the kernel is called on the
  site's inputs (through a ``jit`` named ``flashpass_<kernel>``, so the call is
  visible in the jaxpr, the HLO and profiler traces);
* a transparent call (``jit``) holding part of a site is inlined;
* a higher-order equation (``scan``, ``cond``, ``while``, ``remat``,
  ``custom_jvp``...) whose body holds sites is re-bound with its body rewritten
  the same way, which keeps the body's signature, so any such primitive is
  handled generically.

Re-tracing the interpreter with ``make_jaxpr`` and removing dead equations
yields the rewritten ``ClosedJaxpr``.  How a site's root is emitted is the
placement's rule (`flashpass.placement.emit`).  A nested body that cannot be
rewritten is kept as written, and its error returned with the program (its
sites fall back).
"""

from __future__ import annotations

import jax

from . import compat, errors
from .graph import Const, Scope
from .placement import Placed, emit, rebind_shard_map

_MISSING = object()


class RewriteError(Exception):
    """A body could not be rewritten; its sites fall back."""


class Plan:
    """Which equations to skip, replace and inline, per global path."""

    def __init__(self, placed: list[Placed], scopes: list[Scope]):
        """``placed``: the sites to rewrite, with their placements (stage 5)."""
        self.scopes = {s.prefix: s for s in scopes}
        self.placed = {p.site.root.path: p for p in placed}
        planned = [p.planned for p in placed]
        self.by_root = {p.site.root.path: p for p in planned}
        # A differentiated site's backward is emitted at its first equation.
        self.by_anchor = {
            p.site.backward.anchor.path: p for p in planned if p.site.backward is not None
        }
        self.skip = set()
        self.inline = set()
        for p in planned:
            self.skip |= p.site.paths - {p.site.root.path} - self.by_anchor.keys()
            self.inline |= p.site.inline_calls
        self.site_prefixes = {p.site.scope_prefix for p in planned}
        # A site whose backward is in another scope (patterns/scans.py): the scan equations of
        # the forward and backward loops, or the remat that is the backward, are
        # re-emitted passing the kernel's residuals.
        self.pairs: dict = {}  # scan or remat path -> planned sites
        for p in planned:
            pair = p.site.backward.pair if p.site.backward is not None else None
            if pair is not None:
                if pair.forward is not None:
                    self.pairs.setdefault(pair.forward.path, []).append(p)
                self.pairs.setdefault(pair.backward.path, []).append(p)
                self.site_prefixes.add(p.site.backward.scope_prefix)
        # Values of enclosing scopes a site reads (a mask read where it is built,
        # outside its scan or remat body: `Scope.outside`), per body they are
        # threaded into as new leading operands, outermost body first.
        self.threads: dict = {}  # body prefix -> keys of enclosing scopes
        for p in planned:
            for extra in p.site.extras:
                chain, scope = [], self.scopes[p.site.scope_prefix]
                key = scope.resolve(extra.atom)
                while scope is not None and not scope.owns(key):
                    chain.append(scope)
                    scope = scope.parent
                if scope is None:
                    continue  # (no enclosing scope holds it: read as before)
                for body in chain:
                    keys = self.threads.setdefault(body.prefix, [])
                    if key not in keys:
                        keys.append(key)
        # Equations whose bodies hold sites (a prefix's steps into a body are strings).
        self.holders = {
            sp[:j]
            for sp in self.site_prefixes
            for j, step in enumerate(sp)
            if isinstance(step, str)
        }

    def touches(self, prefix: tuple) -> bool:
        n = len(prefix)
        return any(sp[:n] == prefix for sp in self.site_prefixes)


def rewrite(closed, plan: Plan) -> tuple[object, dict]:
    """``(rewritten closed, failures)``: ``failures`` maps the prefix of each
    body kept as written to its error (its sites fall back)."""
    state = _State(plan)
    return _rewrite(closed, state, ()), state.failures


class _State:
    """What one rewrite shares across its evaluators: the failed bodies, and
    the pullback treedefs a forward loop body hands to its backward loop."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.failures: dict[tuple, str] = {}  # scope prefix -> error
        self.trees: dict = {}  # planned site -> treedef of its pullback


def _rewrite(closed, state: _State, prefix: tuple):
    """The rewritten version of ``closed`` (the jaxpr at ``prefix``); a body
    that sites read enclosing scopes' values in (`Plan.threads`) gets them as
    new leading inputs, in that order."""
    jaxpr, consts = compat.closed_parts(closed)
    threads = state.plan.threads.get(prefix, [])
    scope = state.plan.scopes.get(prefix)
    # Re-traced on the inputs' own types: shardings and, inside a user's
    # shard_map, varying manual axes included.
    avals = [scope.aval(k) for k in threads] + [v.aval for v in jaxpr.invars]

    def run(*args):
        ev = _Evaluator(state, prefix)
        ev.env.update(zip(threads, args[: len(threads)], strict=True))
        return ev.run(jaxpr, consts, args[len(threads) :], prefix)

    new = jax.make_jaxpr(run)(*avals)
    return compat.dce_closed_jaxpr(new)


class _Evaluator:
    def __init__(self, state: _State, prefix: tuple):
        self.state = state
        self.plan = state.plan
        self.scope = state.plan.scopes[prefix]
        self.env: dict = {}
        self.pullbacks: dict = {}  # differentiated site -> its kernel's vjp, until its backward
        self.saved: dict = {}  # site -> its pullback's leaves (a forward loop body returns them)
        self.given: dict = {}  # site -> the leaves a backward loop body receives
        self.stacked: dict = {}  # site -> leaves stacked by the forward loop, for the backward

    def write(self, key, value) -> None:
        self.env[key] = value
        canon = self.scope.resolve(key)
        if not isinstance(canon, Const):
            self.env[canon] = value

    def read(self, inst, atom, default=None):
        if compat.is_literal(atom):
            return compat.literal_value(atom)
        if default is _MISSING:
            return self.env.get((inst, atom), _MISSING)
        return self.env[(inst, atom)]

    def read_key(self, atom):
        """Value of a view atom (a canonical key or a constant)."""
        if isinstance(atom, Const):
            return atom.value
        return self.env[self.scope.resolve(atom)]

    def run(self, jaxpr, consts, args, inst) -> list:
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            self.write((inst, var), value)
        for var, value in zip(jaxpr.invars, args, strict=True):
            if value is not _MISSING:
                self.write((inst, var), value)
        self._eqns(jaxpr, inst)
        return [self.read(inst, v, _MISSING) for v in jaxpr.outvars]

    def _eqns(self, jaxpr, inst) -> None:
        plan = self.plan
        for i, eqn in enumerate(jaxpr.eqns):
            path = (*inst, i)
            if path in plan.skip:
                continue
            planned = plan.by_root.get(path)
            if planned is not None:
                self._replace(eqn, inst, planned)
                continue
            planned = plan.by_anchor.get(path)
            if planned is not None:
                self._backward(planned)
                continue
            if path in plan.pairs:  # a loop or remat re-emitted with kernel residuals
                planned = plan.pairs[path]
                remat = planned[0].site.backward.pair.forward is None
                outs = (self._remat if remat else self._scan)(eqn, path, planned)
            elif compat.is_view_identity(eqn):  # the view looks through it (graph.py)
                value = self.read(inst, eqn.invars[0], _MISSING)
                outs = [value] if value is _MISSING else compat.bind_view_identity(eqn, value)
            elif path in plan.inline or self._transparent_holder(eqn, path):
                # Values inside the site were never computed: pass them on as _MISSING.
                # (A transparent call holding a loop whose body holds a site is
                # part of this scope in the view: inlined, its loop re-bound.)
                invals = [self.read(inst, a, _MISSING) for a in eqn.invars]
                body, consts = compat.closed_parts(eqn.params["jaxpr"])
                outs = self.run(body, consts, invals, (*path, "jaxpr"))
            else:
                invals = [self.read(inst, a) for a in eqn.invars]
                if path not in plan.holders:
                    outs = compat.bind_equation(eqn, invals)
                elif (*path, "jaxpr") in plan.threads:
                    outs = self._threaded(eqn, path, invals)
                elif compat.is_shard_map(eqn) and self.plan.touches((*path, "jaxpr")):
                    outs = self._shard_map(eqn, invals, (*path, "jaxpr"))
                else:
                    outs = compat.bind_equation(eqn, invals, self._params(eqn, path))
            for var, value in zip(eqn.outvars, outs, strict=True):
                if not compat.is_drop_var(var) and value is not _MISSING:
                    self.write((inst, var), value)

    def _replace(self, eqn, inst, planned) -> None:
        placed = self.plan.placed[planned.site.root.path]
        backward = planned.site.backward
        if backward is None:
            out = emit(placed, self.read_key)
        else:
            # The forward now, its pullback at the site's backward: JAX's vjp of the
            # kernel call saves the kernel's own residuals (e.g. the logsumexp).
            keys = [self.scope.resolve(a) for a in backward.inputs]

            def forward(*values):
                given = dict(zip(keys, values, strict=True))

                def read(atom):
                    if isinstance(atom, Const):
                        return atom.value
                    key = self.scope.resolve(atom)
                    return given[key] if key in given else self.read_key(atom)

                return emit(placed, read)

            out, pullback = jax.vjp(forward, *(self.read_key(k) for k in keys))
            if backward.pair is None:
                self.pullbacks[planned] = pullback
            else:  # the backward is in another loop: pass the residuals as arrays
                self.saved[planned], self.state.trees[planned] = jax.tree_util.tree_flatten(
                    pullback
                )
        self.write((inst, eqn.outvars[0]), out)

    def _backward(self, planned) -> None:
        backward = planned.site.backward
        pullback = self.pullbacks.pop(planned, None)
        if pullback is None:
            tree = self.state.trees[planned]
            pullback = jax.tree_util.tree_unflatten(tree, self.given.pop(planned))
        grads = pullback(self.read_key(backward.cotangent))
        for key, grad in zip(backward.grads, grads, strict=True):
            if not isinstance(key, Const):
                self.write(key, grad)

    def _scan(self, eqn, path, planned: list) -> list:
        """Re-emit a scan of a forward/backward loop pair (see patterns/scans.py) with
        ``lax.scan``: the forward loop returns the kernel's residuals instead
        of the dropped ones; the backward loop receives them."""
        forward = planned[0].site.backward.pair.forward.path == path
        n_consts, n_carry = compat.scan_counts(eqn.params)
        body, body_consts = compat.closed_parts(eqn.params["jaxpr"])
        prefix = (*path, "jaxpr")
        inst = path[:-1]
        invals = [self.read(inst, a, _MISSING) for a in eqn.invars]
        consts, init = invals[:n_consts], invals[n_consts : n_consts + n_carry]
        options = {k: eqn.params[k] for k in ("length", "reverse", "unroll") if k in eqn.params}
        if forward:
            dropped = {i for p in planned for i in p.site.backward.pair.dropped_outputs}
            xs = invals[n_consts + n_carry :]

            threads = self._threads(prefix)

            def step(carry, x):
                ev = _Evaluator(self.state, prefix)
                ev.env.update(threads)  # closed over: lax.scan makes them constants
                outs = ev.run(body, body_consts, [*consts, *carry, *x], prefix)
                ys = [y for i, y in enumerate(outs) if i >= n_carry and i not in dropped]
                return outs[:n_carry], (ys, [ev.saved.pop(p) for p in planned])

            carry, (ys, leaves) = jax.lax.scan(step, init, xs, **options)
            for p, stacked in zip(planned, leaves, strict=True):
                self.stacked[p] = stacked
            ys = iter(ys)
            n_out = len(eqn.outvars)
            return [
                *carry,
                *(_MISSING if i in dropped else next(ys) for i in range(n_carry, n_out)),
            ]
        dropped = {i for p in planned for i in p.site.backward.pair.dropped_operands}
        kept = [i for i in range(n_consts + n_carry, len(invals)) if i not in dropped]
        leaves = [self.stacked.pop(p) for p in planned]
        threads = self._threads(prefix)

        def step(carry, x):
            xs, given = x
            args = [*consts, *carry, *([_MISSING] * (len(invals) - n_consts - n_carry))]
            for i, value in zip(kept, xs, strict=True):
                args[i] = value
            ev = _Evaluator(self.state, prefix)
            ev.env.update(threads)
            ev.given = dict(zip(planned, given, strict=True))
            outs = ev.run(body, body_consts, args, prefix)
            return outs[:n_carry], outs[n_carry:]

        carry, ys = jax.lax.scan(step, init, ([invals[i] for i in kept], leaves), **options)
        return [*carry, *ys]

    def _remat(self, eqn, path, planned: list) -> list:
        """Re-emit a remat whose body is the backward of sites of this scope
        (scans.match_remat): the kernels' pullback leaves go in as operands
        instead of the saved intermediates."""
        body, body_consts = compat.closed_parts(eqn.params["jaxpr"])
        prefix = (*path, "jaxpr")
        invals = [self.read(path[:-1], a, _MISSING) for a in eqn.invars]
        dropped = {i for p in planned for i in p.site.backward.pair.dropped_operands}
        kept = [i for i in range(len(invals)) if i not in dropped]
        leaves = [self.saved.pop(p) for p in planned]
        threads = self._threads(prefix)

        def run(values, given):
            args = [_MISSING] * len(invals)
            for i, value in zip(kept, values, strict=True):
                args[i] = value
            ev = _Evaluator(self.state, prefix)
            ev.env.update(threads)  # closed over: jax.checkpoint makes them operands
            ev.given = dict(zip(planned, given, strict=True))
            return ev.run(body, body_consts, args, prefix)

        options = {"prevent_cse": eqn.params.get("prevent_cse", True)}
        if eqn.params.get("policy") is not None:
            options["policy"] = eqn.params["policy"]
        return jax.checkpoint(run, **options)([invals[i] for i in kept], leaves)

    def _threads(self, prefix: tuple) -> dict:
        """The enclosing scopes' values the body at ``prefix`` reads
        (`Plan.threads`), for a body re-emitted with ``lax.scan`` or
        ``jax.checkpoint``, which close over them."""
        return {k: self.read_key(k) for k in self.plan.threads.get(prefix, [])}

    def _threaded(self, eqn, path, invals) -> list:
        """A ``scan`` or ``remat`` whose body's sites read values of enclosing
        scopes (a mask read where it was built, `Plan.threads`): re-bound
        with its body rewritten and those values as new leading operands (a
        scan's loop-invariant constants).  If the body cannot be rewritten
        its sites fall back and the equation is bound as written."""
        prefix = (*path, "jaxpr")
        keys = self.plan.threads[prefix]  # (in `_rewrite`'s order: its new inputs)
        body = eqn.params["jaxpr"]
        try:
            new = compat.rebuild_body(
                eqn, "jaxpr", body, _rewrite(compat.as_closed(body), self.state, prefix)
            )
            params = compat.with_leading_operands(eqn, new, len(keys))
            values = list(self._threads(prefix).values())
        except Exception as err:
            if errors.strict():
                raise
            self.state.failures[prefix] = errors.describe(err)
            return compat.bind_equation(eqn, invals)
        return compat.bind_equation(eqn, [*values, *invals], params)

    def _shard_map(self, eqn, invals, prefix: tuple) -> list:
        """A ``shard_map`` whose body holds sites, re-bound with the body
        rewritten (`placement.rebind_shard_map`); if that fails, the body's
        sites fall back and the equation is bound as written."""
        try:
            return rebind_shard_map(eqn, invals, _shard_map_body(self.state, prefix))
        except Exception as err:
            if errors.strict():
                raise
            self.state.failures[prefix] = errors.describe(err)
            return compat.bind_equation(eqn, invals)

    def _transparent_holder(self, eqn, path) -> bool:
        """Whether ``eqn`` is a transparent call (inlined in the view, so its
        body is no scope of its own) whose body holds a site's scope."""
        body = (*path, "jaxpr")
        return (
            path in self.plan.holders
            and "jaxpr" in eqn.params
            and body not in self.plan.scopes
            and not compat.is_shard_map(eqn)
            and self.plan.touches(body)
        )

    def _params(self, eqn, path):
        """``eqn.params`` with every body that holds sites rewritten (None when
        none is)."""
        new_bodies = {}
        for name, index, body in compat.bodies_in_params(eqn.params):
            prefix = (*path, name if index is None else f"{name}[{index}]")
            if not self.plan.touches(prefix):
                continue
            new = _rewrite_body(eqn, name, body, self.state, prefix)
            if new is not body:
                new_bodies[(name, index)] = new
        return compat.replace_bodies(eqn.params, new_bodies) if new_bodies else None


def _shard_map_body(state: _State, prefix: tuple):
    def run_body(jaxpr, args) -> list:
        """Evaluate the open body ``jaxpr`` at ``prefix`` with its sites replaced."""
        return _Evaluator(state, prefix).run(jaxpr, (), args, prefix)

    return run_body


def _rewrite_body(eqn, name: str, item, state: _State, prefix: tuple):
    """Rewrite one nested body (``eqn``'s param ``name``, or an item of it);
    on failure keep it and record why."""
    try:
        new = _rewrite(compat.as_closed(item), state, prefix)
        try:
            return compat.rebuild_body(eqn, name, item, new)
        except ValueError as err:
            raise RewriteError(str(err)) from None
    except Exception as err:  # keep the original body: its sites fall back
        if errors.strict():
            raise
        state.failures[prefix] = errors.describe(err)
        return item
