"""`AttentionSite`: one matched site, and the layout transforms around its kernel.

A site knows which values of the original program are its q, k, v and side
arrays, which *role* each of their axes plays, and how to turn the kernel's
``[B, H, T, Dv]`` output back into the exact shape, layout and dtype of the
value it replaces.  All transforms are transposes, reshapes and casts: exact.

Roles: ``("b", i)`` for the score product's batch axes, ``"G"`` for a
query-only group axis (grouped-query attention written as a 5-D einsum, as
``jax.nn.dot_product_attention`` does), ``"T"``/``"S"`` for query/key
positions and ``"D"``/``"Dv"`` for head dims.  The canonical kernel layout
groups them as

* ``B``  = the batch axes except the last,
* ``Hkv`` = the last batch axis (key/value heads),
* ``H``  = ``Hkv`` followed by ``G`` (so query head ``h`` reads kv head ``h // G``).
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax.numpy as jnp
from jax import lax

from . import compat
from .graph import Const, Node
from .ops import apply_score_ops

# UNIT: the role of a size-1 batch axis P·V keeps but the scores never had.
from .roles import UNIT, Merged
from .roles import parts as _parts
from .spec import AttentionSpec


def role_groups(n_batch: int, grouped: bool) -> tuple[list, list, list]:
    """(B roles, H roles, Hkv roles) of the canonical layout."""
    batch = [("b", i) for i in range(n_batch)]
    g = ["G"] if grouped else []
    if n_batch <= 1:
        return batch, g, []
    return batch[:-1], [batch[-1], *g], [batch[-1]]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Role sizes of a site and the canonical grouping derived from them."""

    sizes: dict  # role -> size, for every batch role, "G" (if any), "T", "S"

    @property
    def n_batch(self) -> int:
        return sum(1 for r in self.sizes if isinstance(r, tuple))

    @property
    def grouped(self) -> bool:
        return "G" in self.sizes

    @property
    def groups(self):
        return role_groups(self.n_batch, self.grouped)

    def size_of(self, roles) -> int:
        return math.prod(self.sizes[r] for r in roles)

    @property
    def batch(self) -> int:
        return self.size_of(self.groups[0])

    @property
    def heads(self) -> int:
        return self.size_of(self.groups[1])

    @property
    def kv_heads(self) -> int:
        return self.size_of(self.groups[2])

    def score_roles(self) -> list:
        b, h, _ = self.groups
        return [*b, *h, "T", "S"]

    def extra_shape(self, present: dict) -> tuple[int, ...]:
        """4-D canonical shape of an extra that has the roles in ``present``
        (role -> bool: carried, i.e. not broadcast)."""
        b, h, _ = self.groups
        return (
            _group_size(self, b, present),
            _group_size(self, h, present),
            self.sizes["T"] if present.get("T") else 1,
            self.sizes["S"] if present.get("S") else 1,
        )


def present_roles(axes: dict) -> dict:
    """``role -> carried`` of an extra's ``axes`` (role -> axis or None), with an
    axis merged from several roles (`Merged`) carrying each of them."""
    return {part: a is not None for r, a in axes.items() for part in _parts(r)}


def _split_merged(x, axes: dict):
    """``x`` with each `Merged` axis reshaped into its roles' axes, and the
    axes map that says where each role now is."""
    for r, a in sorted(axes.items(), key=lambda item: -1 if item[1] is None else -item[1]):
        if not isinstance(r, Merged) or a is None:
            continue
        sizes = tuple(size for _, size in r.parts)
        x = x.reshape(x.shape[:a] + sizes + x.shape[a + 1 :])
        shift = len(sizes) - 1
        axes = {q: (b if b is None or b < a else b + shift) for q, b in axes.items() if q != r}
        axes.update({part: a + i for i, (part, _) in enumerate(r.parts)})
    return x, axes


def _group_size(layout: Layout, roles, present: dict) -> int:
    if not any(present.get(r) for r in roles):
        return 1
    return layout.size_of(roles)


@dataclasses.dataclass(frozen=True)
class Operand:
    """A q/k/v operand: ``axes[role]`` is the operand axis holding that role."""

    atom: object
    axes: dict
    shape: tuple[int, ...]
    dtype: object


class Transform(enum.Enum):
    """What an extra's array goes through before the kernel reads it."""

    NOT = "not"  # a mask that keeps where False
    NEG = "neg"  # a subtracted bias
    KEY = "key"  # a dropout key, passed as its uint32 data (`Dropout.shape`)

    def apply(self, x):
        if self is Transform.KEY:
            return compat.raw_key_data(x).reshape(1, 1, 1, 2)
        x = jnp.asarray(x)
        return jnp.logical_not(x) if self is Transform.NOT else -x


@dataclasses.dataclass(frozen=True)
class Compared:
    """An extra that is the comparison ``x <cmp> value`` of the array the
    program broadcasts before comparing it (``ne(broadcast(mask), 0)``):
    comparing first reads an O(B·S) mask, not the ``T x S`` result.
    ``negate``: the mask keeps where the comparison is False."""

    cmp: str  # a key of `COMPARE`
    value: float
    negate: bool = False

    def apply(self, x):
        x = jnp.asarray(x)
        out = COMPARE[self.cmp](x, jnp.asarray(self.value, x.dtype))
        return jnp.logical_not(out) if self.negate else out


@dataclasses.dataclass(frozen=True)
class Filled:
    """An extra that is the additive mask ``where(x == keep_when, 0, fill)``
    of a boolean ``x``, in ``dtype``: the bias a program writes as
    ``where(x, s, s + fill)`` (masked scores shifted by a constant) adds."""

    keep_when: bool
    fill: float
    dtype: str

    def apply(self, x):
        x = jnp.asarray(x)
        zero, fill = jnp.zeros((), self.dtype), jnp.asarray(self.fill, self.dtype)
        return jnp.where(x == self.keep_when, zero, fill)


COMPARE = {
    "ge": jnp.greater_equal,
    "gt": jnp.greater,
    "le": jnp.less_equal,
    "lt": jnp.less,
    "eq": jnp.equal,
    "ne": jnp.not_equal,
}


@dataclasses.dataclass(frozen=True)
class ExtraSource:
    """A bias or mask array as the original program has it.

    ``axes[r]`` is the axis of the (un-broadcast) ``atom`` holding role ``r``
    of the score layout, or None where it is broadcast.  ``transform`` (a
    `Transform`, a `Compared`, a `Filled`, an `Unsplit`, a `flashpass.replay.Replayed`,
    or None) is applied first; ``axes`` are those of its result (an `Unsplit` and a
    `Replayed` change the axes).
    """

    atom: object
    axes: dict
    transform: object  # Transform | Compared | Filled | Unsplit | Replayed | None
    dtype: object


@dataclasses.dataclass(frozen=True)
class OutputScale:
    """An output multiplier (``invert``: divisor) constant along the keys,
    such as a head mask: it sat between the softmax and ``P·V``."""

    source: ExtraSource
    invert: bool

    #: The operand's name in reasons.
    name = "head mask"

    def atoms(self) -> list:
        return [self.source.atom]

    def operand_roles(self) -> dict:
        """Role -> axis of the array this step reads."""
        return {r: a for r, a in self.source.axes.items() if a is not None}

    def apply(self, site: AttentionSite, out, read, extras):
        m = site._extra(read(self.source.atom), self.source)
        m = m.astype(jnp.promote_types(m.dtype, out.dtype))
        return out / m if self.invert else out * m


@dataclasses.dataclass(frozen=True)
class QScale:
    """A multiplier of the scores (``invert``: divisor) constant along the
    keys: a traced scalar (a learned temperature, ``scale=`` passed as an
    array), or one value per batch row, head or query (XCiT's and Swin V2's
    per-head temperatures).  Folded into q, as ``(q * t) @ kᵀ == t * (q @
    kᵀ)`` for a ``t`` constant along the keys and the contracted axis."""

    source: ExtraSource  # axes {} for a scalar
    invert: bool

    #: The operand's name in reasons.
    name = "score scale"

    @property
    def atom(self):
        return self.source.atom

    def operand_roles(self) -> dict:
        """Role -> axis of the array this step reads ({} for a scalar)."""
        return {r: a for r, a in self.source.axes.items() if a is not None}

    def apply(self, site: AttentionSite, q, read):
        """``q`` (``[B, H, T, D]``) times (or over) the scale."""
        x = read(self.source.atom)
        if self.operand_roles():
            t = site._extra(x, self.source)  # [B|1, H|1, T|1, 1]
        else:
            t = jnp.reshape(jnp.asarray(x), ())
        t = t.astype(q.dtype)
        return q / t if self.invert else q * t


@dataclasses.dataclass(frozen=True)
class RowKeep:
    """Zero the rows the score masks exclude entirely (the program zeroed
    the weights of rows whose every score a mask excluded)."""

    def atoms(self) -> list:
        return []

    def operand_roles(self) -> None:
        return None

    def apply(self, site: AttentionSite, out, read, extras):
        kept = _rows_kept(site.spec, extras, out.shape[-2])
        return jnp.where(kept, out, jnp.zeros((), out.dtype))


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
    layout: Layout
    out_roles: tuple  # role of each axis of the root output
    q_scales: tuple  # QScale: multipliers of the scores folded into q
    post_ops: tuple  # OutputScale | RowKeep, in program order
    spec: AttentionSpec
    pattern: str
    location: str | None
    #: In a differentiated program: the site's backward (`flashpass.patterns.backward`),
    #: replaced by the kernel's backward; None for a forward-only site.
    backward: object = None
    #: Why a mask written into the scores stays a dense array (`Rewrite.dense`).
    dense: tuple = ()
    #: A differentiated site whose k or v is gathered: the site reading them
    #: from before the gathers, its backward proven with those reads (what a
    #: ring runs, `flashpass.patterns.backward.match_ungathered`); else None.
    ungathered: object = None

    @property
    def paths(self) -> set:
        return {n.path for n in self.nodes}

    @property
    def atoms(self) -> list:
        """Every value of the original program the kernel call reads."""
        out = [self.q.atom, self.k.atom, self.v.atom, *(e.atom for e in self.extras)]
        out += [qs.atom for qs in self.q_scales]
        out += [atom for op in self.post_ops for atom in op.atoms()]
        if self.backward is not None:
            out.append(self.backward.cotangent)
        return out

    @property
    def inline_calls(self) -> set:
        """Transparent calls that must be inlined to replace this site.

        Those holding one of its equations, and those computing a value it
        reads: a call bound as a whole only yields its outputs, but a site may
        read a value internal to it (a causal mask's predicate inside
        ``jnp.triu``, say).  An atom's key names the call bodies it lives in:
        ``(*call_path, "jaxpr", ...)`` below the scope's prefix.
        """
        out = set()
        for n in self.nodes:
            out.update(n.calls)
        depth = len(self.scope_prefix)
        for atom in self.atoms:
            if isinstance(atom, Const):
                continue
            inst = atom[0]
            out.update(inst[:j] for j in range(depth, len(inst)) if inst[j] == "jaxpr")
        return out

    # ------------------------------------------------------------------ transforms

    def kv_layout(self) -> str:
        """How the program holds k and v: ``"bshd"`` where both are, up to
        reshapes, ``[B, S, Hkv, D]`` (a cache as Hugging Face, keras-hub and
        MaxText keep it), else ``"bhsd"`` (the canonical layout, which other
        programs' k and v take by a transpose).  Nothing is computed."""
        b, _, hkv = self.layout.groups
        sizes = self.layout.sizes
        if not any(sizes.get(r, 2) > 1 for r in hkv):
            return "bhsd"  # no heads axis to place: both layouts are one
        for src, d in ((self.k, "D"), (self.v, "Dv")):
            order = [r for r in _role_order(src.axes) if sizes.get(r, 2) > 1]
            want = [r for r in [*b, "S", *hkv, d] if sizes.get(r, 2) > 1]
            if order != want:
                return "bhsd"
        return "bshd"

    def to_kernel(self, read, kv_layout: str = "bhsd"):
        """(q, k, v, extras) from the original values (``read(atom)``): all
        canonical, or k and v in ``kv_layout`` (`kv_layout`; a reshape of the
        program's arrays, never a transpose, where it is the site's own)."""
        b, h, hkv = self.layout.groups
        q = _gather(read(self.q.atom), self.q.axes, [b, h, ["T"], ["D"]])
        for scale in self.q_scales:
            q = scale.apply(self, q, read)
        if kv_layout == "bshd":
            k = _gather(read(self.k.atom), self.k.axes, [b, ["S"], hkv, ["D"]])
            v = _gather(read(self.v.atom), self.v.axes, [b, ["S"], hkv, ["Dv"]])
        elif kv_layout == "bhsd":
            k = _gather(read(self.k.atom), self.k.axes, [b, hkv, ["S"], ["D"]])
            v = _gather(read(self.v.atom), self.v.axes, [b, hkv, ["S"], ["Dv"]])
        else:
            raise ValueError(f"unknown kv_layout {kv_layout!r}")
        extras = tuple(self._extra(read(e.atom), e) for e in self.extras)
        return q, k, v, extras

    def _extra(self, x, src: ExtraSource):
        if src.transform is Transform.KEY:
            return src.transform.apply(x)
        x = jnp.asarray(x) if src.transform is None else src.transform.apply(x)
        used = [a for a in src.axes.values() if a is not None]
        drop = tuple(a for a in range(x.ndim) if a not in used)
        x = jnp.squeeze(x, axis=drop) if drop else x
        kept = sorted(used)
        axes = {r: (None if a is None else kept.index(a)) for r, a in src.axes.items()}
        x, axes = _split_merged(x, axes)
        b, h, _ = self.layout.groups
        out = []
        for group in (b, h, ["T"], ["S"]):
            present = [r for r in group if axes.get(r) is not None]
            if not present:
                out.append(None)
            elif len(present) < len(group):  # mixed broadcast: materialise this group only
                out.append("broadcast")
            else:
                out.append(present)
        # Broadcast partially-present groups, then transpose + reshape group by group.
        # Present axes keep their own length (a ring reads a [.., T, S] extra
        # whole along S while the site's layout is the device's block).
        own = {r: x.shape[a] for r, a in axes.items() if a is not None}
        order, shape, target = [], [], []
        for group, state in zip((b, h, ["T"], ["S"]), out, strict=True):
            if state is None:
                target.append(1)
                continue
            for r in group:
                if axes.get(r) is None:
                    x = jnp.expand_dims(x, x.ndim)
                    axes[r] = x.ndim - 1
                order.append(axes[r])
                shape.append(own.get(r, self.layout.sizes[r]))
            target.append(math.prod(shape[len(shape) - len(group) :]))
        x = jnp.transpose(x, order)
        x = jnp.broadcast_to(x, shape)
        return x.reshape(target)

    def from_kernel(self, out, read=None, extras=()):
        """The kernel's ``[B, H, T, Dv]`` output in the root's layout and dtype.

        ``post_ops`` apply what sat between the softmax and ``P·V`` and commutes
        with it: multipliers constant along keys, and zeroing fully masked rows.
        """
        for op in self.post_ops:
            out = op.apply(self, out, read, extras)
        b, h, _ = self.layout.groups
        roles = [*b, *h, "T", "Dv"]
        sizes = [*(self.layout.sizes[r] for r in [*b, *h, "T"]), out.shape[-1]]
        out = out.reshape(sizes)
        # The root's axes, each one role, a merge of roles (`Merged`, major
        # first) or a unit axis: drop the roles it lacks (size 1), put the
        # others in its order, then one reshape merges and adds unit axes.
        wanted = [p for r in self.out_roles for p in _parts(r) if p != UNIT]
        dropped = tuple(i for i, r in enumerate(roles) if r not in wanted)
        if dropped:
            out = jnp.squeeze(out, dropped)
            roles = [r for r in roles if r in wanted]
        out = jnp.transpose(out, [roles.index(r) for r in wanted])
        # (Sizes from the layout: inside a shard_map it is the local one.)
        size = {**self.layout.sizes, "Dv": sizes[-1], UNIT: 1}
        shape = [math.prod(size[p] for p in _parts(r)) for r in self.out_roles]
        return out.reshape(shape).astype(self.root.eqn.outvars[0].aval.dtype)


#: Keys per block when finding the rows a mask empties: the check never holds
#: a ``T x S`` array (a block is ``[.., T, ROWS_BLOCK]``).
ROWS_BLOCK = 64


def _rows_kept(spec, extras, q_len: int):
    """``[B|1, H|1, T, 1]``: whether the spec's key-excluding ops keep any key
    of a query row (each op's fill made -inf, applied to zero scores), read
    over blocks of `ROWS_BLOCK` keys, so no ``T x S`` array is built."""
    ops = tuple(
        dataclasses.replace(op, fill=float("-inf")) for op in spec.ops if hasattr(op, "fill")
    )
    spec = spec.with_ops(ops)
    kv_len = spec.kv_len
    if kv_len <= ROWS_BLOCK:
        s = apply_score_ops(spec, jnp.zeros((1, 1, q_len, kv_len), jnp.float32), extras)
        return jnp.any(s > float("-inf"), axis=-1, keepdims=True)
    block = ROWS_BLOCK
    q_pos = jnp.arange(q_len)

    def kept_in(start):
        # The block's keys [start, start + block); extras along the keys sliced to it.
        k_pos = start + jnp.arange(block)
        sliced = [
            lax.dynamic_slice_in_dim(x, start, block, axis=3)
            if x is not None and jnp.ndim(x) == 4 and x.shape[3] == kv_len
            else x
            for x in extras
        ]
        s = jnp.zeros((1, 1, q_len, block), jnp.float32)
        s = apply_score_ops(spec, s, sliced, q_pos=q_pos, k_pos=k_pos)
        return jnp.any(s > float("-inf"), axis=-1, keepdims=True)

    # The last block starts at kv_len - block: blocks may overlap, which an OR allows.
    def body(i, kept):
        return kept | kept_in(jnp.minimum(i * block, kv_len - block))

    return lax.fori_loop(1, -(-kv_len // block), body, kept_in(0))


def _role_order(axes: dict) -> list:
    """The roles of an operand in the order its axes hold them (a `Merged`
    axis as its parts, major first; roles on no axis left out)."""
    placed = sorted((a, r) for r, a in axes.items() if a is not None and not _is_unit(r))
    return [p for _, r in placed for p in _parts(r)]


def _is_unit(role) -> bool:
    return role == UNIT


def _gather(x, axes: dict, groups: list):
    """Transpose ``x`` so its role axes come in group order, then merge groups
    (axes with no role are size-1 axes the scores never had: dropped; see
    `patterns.regroup.resolve_units`).  A `Merged` axis (PyTorch's ``[B·H, T, D]``
    operand of ``bmm``) is split into its roles first."""
    x, axes = _split_merged(jnp.asarray(x), axes)
    unit = tuple(a for a in range(x.ndim) if a not in axes.values())
    if unit:
        x = jnp.squeeze(x, unit)
        axes = {r: a - sum(u < a for u in unit) for r, a in axes.items()}
    # Roles x lacks (size 1: squeezed before P·V only) become new unit axes.
    lacking = [r for g in groups for r in g if r not in axes]
    if lacking:
        axes = {**axes, **{r: x.ndim + i for i, r in enumerate(lacking)}}
        x = jnp.expand_dims(x, tuple(range(x.ndim, x.ndim + len(lacking))))
    order = [axes[r] for g in groups for r in g]
    x = jnp.transpose(x, order)
    sizes, i = [], 0
    for g in groups:
        sizes.append(math.prod(x.shape[i : i + len(g)]))
        i += len(g)
    return x.reshape(sizes)
