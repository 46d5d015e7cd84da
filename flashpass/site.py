"""`AttentionSite`: one matched site, and the layout transforms around its kernel.

A site knows which values of the original program are its q, k, v and side
arrays, how each axis maps to a canonical role, and how to turn the kernel's
``[B, H, T, Dv]`` output back into the exact shape, layout and dtype of the
value it replaces.  All transforms are transposes, reshapes and casts: exact.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from .graph import Node

Q_ROLE, K_ROLE = "T", "S"


@dataclasses.dataclass(frozen=True)
class Operand:
    """A q/k/v operand and the permutation putting it in ``[b..., L, D]`` order."""

    atom: object
    perm: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: object


@dataclasses.dataclass(frozen=True)
class ExtraSource:
    """A bias or mask array as the original program has it.

    ``role_axes[r]`` is the axis of the (un-broadcast) ``atom`` that holds role
    ``r`` of the canonical score layout ``[b..., T, S]``, or None where it is
    broadcast.  ``transform`` is applied first: "not" (a mask that keeps where
    False) or "neg" (a subtracted bias).
    """

    atom: object
    role_axes: tuple  # per canonical role, base axis or None
    transform: str | None
    dtype: object


def collapse_batch(batch_shape: tuple[int, ...]) -> tuple[int, int]:
    """Canonical (B, H) for the score product's batch axes."""
    n = len(batch_shape)
    if n == 0:
        return 1, 1
    if n == 1:
        return batch_shape[0], 1
    return math.prod(batch_shape[:-1]), batch_shape[-1]


@dataclasses.dataclass(eq=False)
class AttentionSite:
    """A matched attention site (see the module docstring)."""

    scope_prefix: tuple
    nodes: frozenset  # every equation the kernel replaces
    root: Node  # the equation whose output the kernel output replaces
    q: Operand
    k: Operand
    v: Operand
    extras: tuple  # ExtraSource, in the order of the spec's extras
    batch_shape: tuple[int, ...]
    out_roles: tuple  # role of each axis of the root output
    spec: object  # kernels.AttentionSpec
    pattern: str
    location: str | None

    @property
    def paths(self) -> set:
        return {n.path for n in self.nodes}

    @property
    def inline_calls(self) -> set:
        """Transparent calls that must be inlined to replace this site."""
        out = set()
        for n in self.nodes:
            out.update(n.calls)
        return out

    # ------------------------------------------------------------------ transforms

    def canonical_roles(self) -> list:
        return [("b", i) for i in range(len(self.batch_shape))] + [Q_ROLE, K_ROLE]

    def to_kernel(self, read):
        """Canonical (q, k, v, extras) from the original values (``read(atom)``)."""
        q = self._qkv(read(self.q.atom), self.q)
        k = self._qkv(read(self.k.atom), self.k)
        v = self._qkv(read(self.v.atom), self.v)
        extras = tuple(self._extra(read(e.atom), e) for e in self.extras)
        return q, k, v, extras

    def _qkv(self, x, op: Operand):
        x = jnp.transpose(jnp.asarray(x), op.perm)
        b, h = collapse_batch(self.batch_shape)
        return x.reshape(b, h, x.shape[-2], x.shape[-1])

    def _extra(self, x, src: ExtraSource):
        x = jnp.asarray(x)
        if src.transform == "not":
            x = jnp.logical_not(x)
        elif src.transform == "neg":
            x = -x
        used = [a for a in src.role_axes if a is not None]
        drop = tuple(a for a in range(x.ndim) if a not in used)
        x = jnp.squeeze(x, axis=drop) if drop else x
        order = sorted(used)
        x = jnp.transpose(x, [order.index(a) for a in used])
        roles = self.canonical_roles()
        full = (*self.batch_shape, self.spec.q_len, self.spec.kv_len)
        shape = [x.shape[used.index(a)] if a is not None else 1 for a in src.role_axes]
        x = x.reshape(shape)
        return _collapse_extra(x, full, len(roles) - 2)

    def from_kernel(self, out):
        """The kernel's ``[B, H, T, Dv]`` output in the root's layout and dtype."""
        roles = [*[("b", i) for i in range(len(self.batch_shape))], "T", "Dv"]
        out = out.reshape(*self.batch_shape, out.shape[-2], out.shape[-1])
        perm = [roles.index(r) for r in self.out_roles]
        out = jnp.transpose(out, perm)
        return out.astype(self.root.eqn.outvars[0].aval.dtype)


def _collapse_extra(x, full: tuple, n_batch: int):
    """``[b..., T|1, S|1]`` (size-1 broadcast axes) to 4-D ``[B|1, H|1, T|1, S|1]``."""
    tail = x.shape[n_batch:]
    if n_batch == 0:
        return x.reshape(1, 1, *tail)
    if n_batch == 1:
        return x.reshape(x.shape[0], 1, *tail)
    lead = x.shape[: n_batch - 1]
    if all(d == 1 for d in lead):
        b = 1
    else:
        if any(d == 1 for d in lead):  # mixed broadcast: materialise the batch axes only
            x = jnp.broadcast_to(x, (*full[: n_batch - 1], *x.shape[n_batch - 1 :]))
        b = math.prod(full[: n_batch - 1])
    return x.reshape(b, x.shape[n_batch - 1], *tail)


def extra_shape4(role_sizes: list, batch_shape: tuple) -> tuple[int, ...]:
    """Static version of `_collapse_extra`'s output shape."""
    n_batch = len(batch_shape)
    tail = tuple(role_sizes[n_batch:])
    if n_batch == 0:
        return (1, 1, *tail)
    if n_batch == 1:
        return (role_sizes[0], 1, *tail)
    lead = role_sizes[: n_batch - 1]
    b = 1 if all(d == 1 for d in lead) else math.prod(batch_shape[: n_batch - 1])
    return (b, role_sizes[n_batch - 1], *tail)
