"""`Deferred` sites: placed at partitioning time, by XLA's choice of shardings.

Under Auto mesh axes the shardings of a site's operands are not in their
types: ``jax.device_put(x, NamedSharding(mesh, P(None, "seq")))`` and an
unannotated ``jax.jit(flashpass.optimize(f))`` leave the pass nothing to read
at trace time.  XLA's SPMD partitioner knows them, so such a site is emitted
as one `compat.partitioned` call (``custom_partitioning``) whose partition
rule finishes the pending decision (`Deferred`): it runs the same `decide`
as stage 5, on the shardings XLA chose (`Chosen`):

* batch and head axes sharded: the kernel per shard;
* q and k/v sharded alike along their sequences: the ring
  (`flashpass.ring`, zig-zag where `zigzag.plan` balances it), with the
  platform's step kernels;
* anything else: the arguments gathered to the nearest sharding the kernel
  runs on (batch and heads kept, sequences and head dims whole), the reason
  recorded; replicated where even that fails.

The forward and the backward are two such calls under one `jax.custom_vjp`;
the backward recomputes the forward on its shard (no residuals cross the
custom call) and sums the cotangents of arguments that are replicated along
mesh axes the computation splits (what ``shard_map``'s transpose does).  The
sharding rule maps every operand's axis to its role (batch, heads, query and
key sequence, head dims), so XLA propagates shardings through the call
instead of replicating it.  Each decision is logged (``flashpass`` logger,
INFO) and kept in `decisions`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .. import compat, errors, sharding
from ..site import AttentionSite
from .emit import atoms_of, kernel_output, reader, ring_output
from .plan import decide
from .types import Local

logger = logging.getLogger("flashpass")

#: What `decisions` remembers (the most recent partitionings).
MAX_DECISIONS = 256
_DECISIONS: collections.deque = collections.deque(maxlen=MAX_DECISIONS)  # (number, Decision)
_COUNT = [0]
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Decision:
    """How XLA's partitioner placed one deferred site (a forward or backward
    call): ``how`` is "per shard", "ring (<step kernels>)", "as is"
    (nothing sharded) or "gathered"; ``reason`` says why it was gathered."""

    location: str | None
    pass_: str  # "forward" or "backward"
    how: str
    mesh: str  # e.g. "data=2 x seq=4"
    in_specs: tuple
    reason: str = ""

    def __str__(self) -> str:
        where = self.location or "?"
        why = f": {self.reason}" if self.reason else ""
        return f"{where} ({self.pass_}, mesh {self.mesh}): {self.how}{why}"


def decisions(since: int = 0) -> list[Decision]:
    """The most recent partitioning decisions of deferred sites, oldest first
    (``since``: only those after `decision_count` gave it)."""
    with _LOCK:
        return [d for n, d in _DECISIONS if n >= since]


def decision_count() -> int:
    """How many decisions were taken so far (for `decisions`' ``since``)."""
    with _LOCK:
        return _COUNT[0]


def clear_decisions() -> None:
    with _LOCK:
        _DECISIONS.clear()


def emit_deferred(placed, read):
    """The site's output from a call XLA's partitioner places (see module doc)."""
    call = _Call(placed)
    values = [jnp.asarray(read(atom)) for atom in call.atoms]
    return call(values)


class _Call:
    def __init__(self, placed):
        self.planned = planned = placed.planned
        self.site, self.kernel, self.interpret = planned.site, planned.kernel, planned.interpret
        self.pending = placed.placement  # a `Deferred`: what `decide` needs besides shardings
        self.atoms = atoms_of(self.site)
        self.roles = [_roles_of(self.site, atom) for atom in self.atoms]

    def __call__(self, values):
        self._avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]
        shapes = [tuple(v.shape) for v in values]
        floats = tuple(i for i, v in enumerate(values) if jnp.issubdtype(v.dtype, jnp.inexact))
        factors = [
            self._factors(r, s, f"a{i}")
            for i, (r, s) in enumerate(zip(self.roles, shapes, strict=True))
        ]
        out_factors = self._factors(
            dict(enumerate(self.site.out_roles)),
            tuple(self.site.root.eqn.outvars[0].aval.shape),
            "o",
            by_axis=True,
        )
        forward = compat.partitioned(
            lambda *v: (self._global(v),),
            partition=self._forward_partition,
            infer=lambda mesh, shards: [self._named(mesh, self._infer(shards))],
            rule=_rule(factors, [out_factors]),
        )
        backward = compat.partitioned(
            lambda *a: self._global_grads(a[:-1], a[-1], floats),
            partition=lambda mesh, shards: self._backward_partition(mesh, shards, floats),
            infer=lambda mesh, shards: [shards[i] for i in floats],
            rule=_rule([*factors, out_factors], [factors[i] for i in floats]),
        )

        @jax.custom_vjp
        def attend(*vals):
            return forward(*vals)[0]

        def fwd(*vals):
            return forward(*vals)[0], vals

        def bwd(vals, g):
            grads = iter(backward(*vals, g))
            return tuple(next(grads) if i in floats else None for i in range(len(vals)))

        attend.defvjp(fwd, bwd)
        return attend(*values)

    # ------------------------------------------------------------ the calls

    def _global(self, values):
        return kernel_output(self.site, self.kernel, self.interpret, reader(self.atoms, values))

    def _global_grads(self, values, g, floats):
        def compute(read):
            return kernel_output(self.site, self.kernel, self.interpret, read)

        return _vjp(compute, self.atoms, values, g, floats)

    def _forward_partition(self, mesh, shards):
        placement, in_specs, out_spec = self._decide(mesh, shards, "forward")

        def lower(*values):
            return (self._compute(placement, reader(self.atoms, values)),)

        args = [self._named(mesh, s) for s in in_specs]
        return lower, args, [self._named(mesh, out_spec)]

    def _backward_partition(self, mesh, shards, floats):
        placement, in_specs, out_spec = self._decide(mesh, shards[:-1], "backward")
        shard = _shard_of(placement)
        split = shard.axis_names if shard is not None else frozenset()

        def lower(*args):
            values, g = args[:-1], args[-1]
            compute = functools.partial(self._compute, placement)
            grads = _vjp(compute, self.atoms, values, g, floats)
            out = []
            for i, grad in zip(floats, grads, strict=True):
                # Replicated along axes the computation splits: each shard's part.
                axes = sorted(split - _spec_axes(in_specs[i]))
                out.append(jax.lax.psum(grad, tuple(axes)) if axes else grad)
            return tuple(out)

        args = [self._named(mesh, s) for s in (*in_specs, out_spec)]
        return lower, args, [self._named(mesh, in_specs[i]) for i in floats]

    def _compute(self, placement, read):
        """The site's output on one shard, as ``placement`` runs it (a
        `Local`, `PerShard` or `Ring`: XLA's partitioner already split the
        arrays, so no ``shard_map`` of its own)."""
        shard = _shard_of(placement)
        if shard is None:
            return kernel_output(self.site, self.kernel, self.interpret, read)
        local = sharding.localize(shard.site or self.site, shard.counts())
        if shard.ring is None:
            return kernel_output(local, self.kernel, self.interpret, read)
        return ring_output(
            local,
            read,
            shard.ring,
            shard.ring_size(),
            steps=placement.steps,
            interpret=self.interpret,
            sharded_index=shard.sharded_index(local),
            zz=placement.zigzag,
        )

    @staticmethod
    def _named(mesh, spec):
        return NamedSharding(mesh, spec)

    # ------------------------------------------------------------ deciding

    def _decide(self, mesh, shards, pass_: str):
        """`decide` on the shardings XLA chose: the placement, the operands'
        specs (per `atoms`) and the output's."""
        try:
            chosen = Chosen(self.site, self.atoms, self.roles, self._avals, tuple(shards))
            placement = decide(self.planned, chosen, self.pending.kernels, self.pending.context)
        except Exception as err:
            if errors.strict():
                raise
            placement = Local(f"internal error while placing it: {errors.describe(err)}")
        shard = _shard_of(placement)
        if shard is None:
            in_specs, out_spec = tuple(PartitionSpec() for _ in self.atoms), PartitionSpec()
        else:
            in_specs = []
            for atom in self.atoms:
                index = sharding.find(list(shard.atoms), atom)
                in_specs.append(shard.in_specs[index] if index is not None else PartitionSpec())
            in_specs, out_spec = tuple(in_specs), shard.out_spec
        self._record(mesh, pass_, placement, in_specs)
        return placement, in_specs, out_spec

    def _infer(self, shards) -> PartitionSpec:
        """GSPMD's propagation: the output sharded as the operands' roles are
        (the first sharding of each role wins; head dims whole)."""
        by_role: dict = {}
        for s, roles in zip(shards, self.roles, strict=True):
            if not isinstance(s, NamedSharding):
                continue
            by_dim = sharding.entries(s.spec, len(s.spec))
            for role, axis in roles.items():
                if axis < len(by_dim) and by_dim[axis] and role not in ("D", "Dv"):
                    by_role.setdefault(role, by_dim[axis])
        return sharding.partition_spec([by_role.get(r, ()) for r in self.site.out_roles])

    def _record(self, mesh, pass_: str, placement, in_specs: tuple) -> None:
        shape = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
        d = Decision(self.site.location, pass_, placement.how, shape, in_specs, placement.why)
        with _LOCK:
            _DECISIONS.append((_COUNT[0], d))
            _COUNT[0] += 1
        logger.info("placed at partitioning: %s", d)

    def _factors(self, roles: dict, shape: tuple, unique: str, by_axis: bool = False) -> list:
        """Shardy factor names of an array's axes: its role's where the axis
        has the role's size, else one of its own."""
        by_dim = roles if by_axis else {axis: role for role, axis in roles.items()}
        sizes = self.site.layout.sizes
        names = {role: f"r{i}" for i, role in enumerate([*sizes, "D", "Dv"])}
        out = []
        for d, size in enumerate(shape):
            role = by_dim.get(d)
            if role in ("D", "Dv") or (role in sizes and sizes[role] == size):
                out.append(names[role])  # (a merged role is in no layout: its own)
            else:
                out.append(f"{unique}_{d}")
        return out


@dataclasses.dataclass(frozen=True)
class Chosen:
    """The shardings XLA's partitioner chose for a deferred call's operands
    (``shards``, per ``atoms``), as `decide` reads them."""

    site: AttentionSite
    atoms: list
    roles: list  # per atom: role -> axis
    avals: list
    shards: tuple

    #: The call must run on them: what no kernel runs on is gathered.
    at_partitioning = True

    def read(self, planned):
        """`sharding.analyze` on these shardings (never pending: they are known)."""

        def sharding_of(atom):
            s = self.shards[sharding.find(self.atoms, atom)]
            return s if isinstance(s, NamedSharding) and any(s.spec) else None

        def aval_of(atom):
            return self.avals[sharding.find(self.atoms, atom)]

        return sharding.analyze(planned.site, aval_of, sharding_of)

    def without_sequences(self) -> Chosen:
        """These shardings with every sequence and head-dim axis whole."""
        shards = []
        for s, roles, aval in zip(self.shards, self.roles, self.avals, strict=True):
            if isinstance(s, NamedSharding):
                by_dim = sharding.entries(s.spec, len(aval.shape))
                keep = {axis for role, axis in roles.items() if _is_batch_or_head(self.site, role)}
                spec = [e if d in keep else () for d, e in enumerate(by_dim)]
                s = NamedSharding(s.mesh, sharding.partition_spec(spec))
            shards.append(s)
        return dataclasses.replace(self, shards=tuple(shards))


def _shard_of(placement):
    """The `sharding.ShardPlan` a placement runs on (None: whole arrays)."""
    return getattr(placement, "shard", None)


def _vjp(compute, atoms, values, g, floats):
    """The cotangents of ``values[i]`` (``i`` in ``floats``) of ``compute(read)``."""

    def f(*diff):
        full = list(values)
        for i, x in zip(floats, diff, strict=True):
            full[i] = x
        return compute(reader(atoms, full))

    _, vjp = jax.vjp(f, *(values[i] for i in floats))
    return tuple(vjp(g))


def _rule(operands: list, results: list) -> str:
    """A Shardy sharding rule from each array's factor names."""

    def arrays(factors):
        return ", ".join(" ".join(f) for f in factors)

    return f"{arrays(operands)} -> {arrays(results)}"


def _spec_axes(spec: PartitionSpec) -> frozenset:
    return frozenset(a for e in sharding.entries(spec, len(spec)) for a in e)


def _roles_of(site, atom) -> dict:
    """Role -> axis of ``atom`` where the site reads it (first read wins)."""
    for _, a, roles in sharding.operands(site):
        if sharding.find([a], atom) is not None:
            return dict(roles)
    return {}


def _is_batch_or_head(site, role) -> bool:
    batch, heads, _ = site.layout.groups
    return role in batch or role in heads or role == "G"
