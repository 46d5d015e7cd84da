"""The canonical attention spec: the contract between the matcher and the kernels.

The matcher turns every attention site into one canonical, fully static
`AttentionSpec`.  Kernels only ever see that spec plus canonical arrays:

* ``q``: ``[B, H, T, D]``, ``k``: ``[B, Hkv, S, D]``, ``v``: ``[B, Hkv, S, Dv]``,
  with ``H = Hkv * G``; query head ``h`` reads key/value head ``h // G``.
* ``extras``: the bias and mask arrays named by the spec's score ops, each 4-D
  and broadcastable to ``[B, H, T, S]`` (size-1 axes are broadcast, never
  materialised by the matcher).

The kernel returns ``[B, H, T, Dv]`` in ``spec.out_dtype``.  The score function
it must implement is, in order::

    s = q @ k^T                      (accumulated in spec.compute_dtype)
    for op in spec.score_ops: s = op(s)      (but `Dropout` and `Sink`)
    p = softmax(s, axis=-1)          (in spec.compute_dtype; with a `Sink`,
                                      over [s, sink] and the sink column dropped)
    p = dropout(p)                   (a `Dropout` op, if any)
    p = p.astype(spec.p_dtype)
    out = p @ v

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
An additive mask with a finite fill whose rows may be empty is marked by an
`EmptyRows` op, which no kernel sees (`flashpass.kernels.empty_rows` runs it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from flashpass.ops import (
    DESCRIPTORS,
    STRUCTURED,
    Alibi,
    BandSelect,
    Bias,
    Causal,
    Chunk,
    Dropout,
    EmptyRows,
    KvLengths,
    Mask,
    PositionMask,
    Prefix,
    PrefixLengths,
    Scale,
    ScoreOp,
    Segments,
    Sink,
    Softcap,
    Window,
)

# The score ops live in `flashpass.ops`, one module per kind with its
# semantics; the contract re-exports them.
__all__ = [
    "DESCRIPTORS",
    "EXCLUDING_FILL",
    "FLOAT_DTYPES",
    "STRUCTURED",
    "Alibi",
    "BandSelect",
    "AttentionSpec",
    "Bias",
    "Causal",
    "Chunk",
    "Dropout",
    "EmptyRows",
    "ExtraSpec",
    "KvLengths",
    "Mask",
    "PositionMask",
    "Prefix",
    "PrefixLengths",
    "Scale",
    "ScoreOp",
    "Segments",
    "Sink",
    "Softcap",
    "Window",
    "excludes",
    "fill_after",
]

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

    def __post_init__(self):
        for name in ("q_dtype", "k_dtype", "v_dtype", "out_dtype", "compute_dtype", "p_dtype"):
            object.__setattr__(self, name, np.dtype(getattr(self, name)))
        if self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")

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
        found = [op for op in self.score_ops if isinstance(op, Causal)]
        return found[0] if len(found) == 1 else None

    @property
    def scale(self) -> float:
        """Product of all Scale ops (1.0 when there are none)."""
        value = 1.0
        for op in self.score_ops:
            if isinstance(op, Scale):
                value *= op.value
        return value

    @property
    def sink(self) -> Sink | None:
        """The `Sink` op (attention sinks), if any."""
        found = [op for op in self.score_ops if isinstance(op, Sink)]
        return found[0] if found else None

    @property
    def dropout(self) -> Dropout | None:
        """The `Dropout` op on the probabilities, if any."""
        found = [op for op in self.score_ops if isinstance(op, Dropout)]
        return found[0] if found else None

    def ops_of(self, kind: type) -> list:
        return [op for op in self.score_ops if isinstance(op, kind)]

    @property
    def descriptors(self) -> frozenset[str]:
        """The `DESCRIPTORS` this spec uses."""
        found = {op.descriptor(self) for op in self.score_ops} - {None}
        if self.groups > 1:
            found.add("gqa")
        return frozenset(found)

    def final_fill(self, position: int, fill: float) -> float:
        """The score an excluded key ends with when the op at ``position``
        fills it with ``fill``: `fill_after` of the ops that follow it."""
        return fill_after(fill, self.score_ops[position + 1 :])

    def describe(self) -> dict:
        """A JSON-friendly summary for reports."""
        # Shallow: asdict would deep-copy every op (slow, and replaced below).
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, value in out.items():
            if isinstance(value, np.dtype):
                out[key] = value.name
        out["score_ops"] = [_op_to_dict(op) for op in self.score_ops]
        out["extras"] = [
            {"shape": list(e.shape), "dtype": np.dtype(e.dtype).name} for e in self.extras
        ]
        return out


def _op_to_dict(op) -> dict:
    d = {"op": type(op).__name__.lower()}
    for f in dataclasses.fields(op):
        value = getattr(op, f.name)
        if f.metadata.get("reported") == "unless default" and value == f.default:
            continue
        if f.name == "dtype":
            value = np.dtype(value).name
        elif isinstance(value, tuple):
            value = list(value)
        d[f.name] = value
    return d
