"""The canonical attention spec: the contract between the matcher and the kernels.

The matcher turns every attention site into one canonical, fully static
`AttentionSpec`.  Kernels only ever see that spec plus canonical arrays:

* ``q``: ``[B, H, T, D]``, ``k``: ``[B, Hkv, S, D]``, ``v``: ``[B, Hkv, S, Dv]``,
  with ``H = Hkv * G``; query head ``h`` reads key/value head ``h // G``.
* ``extras``: the bias and mask arrays named by the spec's score ops, each 4-D
  and broadcastable to ``[B, H, T, S]`` (size-1 axes are broadcast, never
  materialised by the matcher).

The kernel returns ``[B, H, T, Dv]`` in ``spec.out_dtype``.  The spec holds
its ops in stages, one field each, and the function a kernel must implement
is, in order::

    s = q @ k^T                      (accumulated in spec.compute_dtype)
    for op in spec.score_ops: s = op(s)      (the score ops)
    p = softmax(s, axis=-1)          (in spec.compute_dtype; with spec.sink,
                                      over [s, sink] and the sink column dropped)
    p = dropout(p)                   (spec.dropout, if any)
    p = p.astype(spec.p_dtype)
    out = p @ v

``spec.ops`` lists every stage's ops in the order the matcher found them, for
the questions each op answers alike (`flashpass.ops.base`: descriptors, extras
read, decline reasons); a spec built with later-stage ops in ``score_ops``
sorts them into their fields.

Each `ScoreOp` documents its exact semantics.  A kernel that cannot honour a
spec says so in `Kernel.check`, in words a user can act on.

Kernels accumulate in at least float32 (the reference honours a bf16 compute
dtype; a kernel computing more precisely is within the bf16 tolerance), and
may round unnormalised rather than normalised probabilities to ``p_dtype``.

Fully masked rows (every key removed by `Mask` ops) are part of the semantics:
``reference`` and ``blockwise`` reproduce them exactly (uniform weights for a
finite fill, NaN for ``-inf``, as the original code computes).  The other
kernels return the mean of ``v`` with zero q/k gradient for such rows, which
equals the original's forward for finite fills; docs/kernels.md lists this.
An additive mask with a finite fill whose rows may be empty is marked by
``spec.empty_rows``, which no kernel sees: `flashpass.kernels.empty_rows`
combines two kernel calls to run it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flashpass import ops as _ops
from flashpass.ops import Causal, Dropout, EmptyRows, Sink

# The ops live in `flashpass.ops`, one module per kind with its semantics,
# listed once there (`flashpass.ops.__all__`); the contract re-exports every
# one of them (`__getattr__`), so a new kind is not listed here again.
__all__ = [
    "EXCLUDING_FILL",
    "FLOAT_DTYPES",
    "AttentionSpec",
    "ExtraSpec",
    "excludes",
    "fill_after",
    *_ops.__all__,
]


def __getattr__(name: str):
    if name in _ops.__all__:
        return getattr(_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: A mask fill at or below this value gives excluded keys a weight that is
#: exactly zero in float32 (exp(-1000) underflows), so a kernel may skip them.
EXCLUDING_FILL = -1000.0

#: The floating dtypes attention can compute in, by name.
FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32", "float64"})


def fill_after(fill: float, later_ops) -> float:
    """The score a key excluded with ``fill`` ends with after ``later_ops``, the
    score ops that follow its Mask or Causal: a Scale multiplies it, a Softcap
    squashes it (any fill ends as about ``-cap``).  A Bias is assumed not to
    lift it back, the assumption `EXCLUDING_FILL` makes.  Computed in float64."""
    with np.errstate(all="ignore"):
        value = np.float64(fill)
        for op in later_ops:
            value = op.final_score(value)
    return float(value)


def excludes(score: float) -> bool:
    """Whether a key whose final score is ``score`` has exactly zero weight."""
    return score <= EXCLUDING_FILL


# --------------------------------------------------------------------------- spec


@dataclasses.dataclass(frozen=True)
class ExtraSpec:
    """Shape and dtype of one extra (bias or mask) array."""

    shape: tuple[int, ...]
    dtype: Any


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """A canonical attention site: everything a kernel needs, all static."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    q_dtype: Any
    k_dtype: Any
    v_dtype: Any
    out_dtype: Any
    compute_dtype: Any
    p_dtype: Any
    score_ops: tuple = ()
    extras: tuple = ()
    #: The softmax's normaliser: attention sinks (a per-row logit it adds), if any.
    sink: Sink | None = None
    #: The op on the probabilities: the program's dropout, if any.
    dropout: Dropout | None = None
    #: The rows an additive mask may empty (`EmptyRows`), run by combining two
    #: kernel calls (`flashpass.kernels.empty_rows`); no kernel sees it.
    empty_rows: EmptyRows | None = None

    def __post_init__(self):
        for name in ("q_dtype", "k_dtype", "v_dtype", "out_dtype", "compute_dtype", "p_dtype"):
            object.__setattr__(self, name, np.dtype(getattr(self, name)))
        if self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if any(getattr(op, "stage", "scores") != "scores" for op in self.score_ops):
            # Every op in one sequence (the matcher's order, `ops`): sorted
            # into its stage here, so each field holds one stage.
            if (self.sink, self.dropout, self.empty_rows) != (None, None, None):
                raise ValueError(
                    "ops of later stages are given both in score_ops and as fields "
                    "(to replace every op of a spec, use spec.with_ops(ops))"
                )
            for name, value in _staged(self.score_ops).items():
                object.__setattr__(self, name, value)
        if self.empty_rows is not None and not 0 <= self.empty_rows.stop <= len(self.score_ops):
            raise ValueError(
                f"{self.empty_rows} does not follow score ops of this spec "
                "(to replace every op of a spec, use spec.with_ops(ops))"
            )

    @property
    def ops(self) -> tuple:
        """Every op of every stage, in the order the matcher found them: the
        score ops with `empty_rows` right after the mask it marks, then the
        sink, then the dropout.  For questions every op answers alike
        (descriptors, extras read, decline reasons, reports)."""
        ops = list(self.score_ops)
        if self.empty_rows is not None:
            ops.insert(self.empty_rows.stop, self.empty_rows)
        return tuple(ops) + tuple(op for op in (self.sink, self.dropout) if op is not None)

    def with_ops(self, ops, **changes) -> AttentionSpec:
        """This spec with ``ops`` (every stage, in `ops`' order) in place of its
        ops, and ``changes`` to other fields."""
        return dataclasses.replace(
            self, score_ops=tuple(ops), sink=None, dropout=None, empty_rows=None, **changes
        )

    # -- derived views kernels commonly need ------------------------------------------

    @property
    def groups(self) -> int:
        """Query heads per key/value head (1 without GQA/MQA)."""
        return self.heads // self.kv_heads

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.q_len, self.head_dim)

    @property
    def k_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.kv_len, self.head_dim)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.kv_len, self.v_head_dim)

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.q_len, self.v_head_dim)

    @property
    def causal(self) -> Causal | None:
        """The one `Causal` op, if the spec has exactly one."""
        found = self.ops_of(Causal)
        return found[0] if len(found) == 1 else None

    @property
    def scale(self) -> float:
        """Product of every op's score `multiplier` (1.0 when none has one)."""
        value = 1.0
        for op in self.score_ops:
            if op.multiplier is not None:
                value *= op.multiplier
        return value

    def ops_of(self, kind: type) -> list:
        """The ops of ``kind``, in any stage."""
        return [op for op in self.ops if isinstance(op, kind)]

    @property
    def descriptors(self) -> frozenset[str]:
        """The `DESCRIPTORS` this spec uses."""
        found = {op.descriptor(self) for op in self.ops} - {None}
        if self.groups > 1:
            found.add("gqa")
        return frozenset(found)

    def final_fill(self, position: int, fill: float) -> float:
        """The score an excluded key ends with when the op at ``position`` of
        `ops` fills it with ``fill``: `fill_after` of the ops that follow it."""
        return fill_after(fill, self.ops[position + 1 :])

    def describe(self) -> dict:
        """A JSON-friendly summary for reports."""
        # Shallow: asdict would deep-copy every op (slow, and replaced below).
        out = {name: getattr(self, name) for name in _DESCRIBED}
        for key, value in out.items():
            if isinstance(value, np.dtype):
                out[key] = value.name
        out["score_ops"] = [_op_to_dict(op) for op in self.ops]  # (every stage, as found)
        out["extras"] = [
            {"shape": list(e.shape), "dtype": np.dtype(e.dtype).name} for e in self.extras
        ]
        return out


#: The fields `describe` names; the later stages are listed with the score ops.
_DESCRIBED = tuple(
    """batch heads kv_heads q_len kv_len head_dim v_head_dim q_dtype k_dtype v_dtype
    out_dtype compute_dtype p_dtype score_ops extras""".split()
)

#: The `AttentionSpec` field of each later stage (`ScoreOp.stage`).
_STAGE_FIELDS = {"rows": "empty_rows", "normaliser": "sink", "probabilities": "dropout"}


def _staged(ops) -> dict:
    """``ops`` (every stage, in the matcher's order) as the spec's fields:
    the score ops, and one op at most of each later stage.  An `EmptyRows`
    records where it stands among the score ops (``stop``)."""

    def stage(op):  # (an object of no kind is a score op the kernels will refuse)
        return getattr(op, "stage", "scores")

    out = {"score_ops": tuple(op for op in ops if stage(op) == "scores")}
    for i, op in enumerate(ops):
        if stage(op) == "scores":
            continue
        name = _STAGE_FIELDS[op.stage]
        if name in out:
            raise ValueError(f"a spec holds one {type(op).__name__} op at most")
        if op.stage == "rows":
            op = dataclasses.replace(op, stop=sum(stage(o) == "scores" for o in ops[:i]))
        out[name] = op
    return out


def _op_to_dict(op) -> dict:
    d = {"op": type(op).__name__.lower()}
    for f in dataclasses.fields(op):
        value = getattr(op, f.name)
        reported = f.metadata.get("reported")
        if reported == "never" or (reported == "unless default" and value == f.default):
            continue
        if f.name == "dtype":
            value = np.dtype(value).name
        elif isinstance(value, tuple):
            value = list(value)
        d[f.name] = value
    return d
