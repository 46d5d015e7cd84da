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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

#: A mask fill at or below this value gives excluded keys a weight that is
#: exactly zero in float32 (exp(-1000) underflows), so a kernel may skip them.
EXCLUDING_FILL = -1000.0


# --------------------------------------------------------------------------- score ops


@dataclasses.dataclass(frozen=True)
class Scale:
    """``s = s * value`` (a division by ``c`` is recorded as ``1 / c``)."""

    value: float


@dataclasses.dataclass(frozen=True)
class Bias:
    """``s = s + extras[index]``; ``shape`` is 4-D and broadcastable to the scores."""

    index: int
    shape: tuple[int, ...]
    dtype: Any


@dataclasses.dataclass(frozen=True)
class Mask:
    """``s = where(extras[index], s, fill)``: ``True`` keeps the score."""

    index: int
    shape: tuple[int, ...]
    fill: float


@dataclasses.dataclass(frozen=True)
class Causal:
    """``s = where(j <= i + offset, s, fill)`` for query ``i`` and key ``j``.

    The matcher only emits this when every query row keeps at least one key
    (``offset >= 0``) and the fill is still ``<= EXCLUDING_FILL`` (or ``-inf``)
    after every later score op, so excluded keys have exactly zero weight and a
    kernel may skip them.
    """

    offset: int
    fill: float


@dataclasses.dataclass(frozen=True)
class KvLengths:
    """``s = where(j < L + shift, s, fill)`` for key ``j``, ``L = extras[index]``.

    ``L`` is the user's integer lengths array (a KV cache's fill level), 4-D
    ``[B|1, H|1, T|1, 1]``: it varies over batch rows and heads, and over
    queries in chunked prefill (each query's own cache position), never over
    keys.  ``shift`` absorbs the comparison's spelling: ``j < L``
    is shift 0, ``j <= L`` shift 1, ``j + 2 < L`` shift -2.  Kernels read the
    valid length of a row as ``clip(L + shift, 0, kv_len)`` computed without
    overflow (`flashpass.kernels.reference.kv_valid_lengths`).  A row whose
    valid length is 0 keeps no key: the original computes it over every key's
    fill, and kernels must too.  The matcher emits the op only with a fill
    that excludes keys (``<= EXCLUDING_FILL`` or ``-inf``).
    """

    index: int
    shape: tuple[int, ...]
    fill: float
    shift: int = 0


@dataclasses.dataclass(frozen=True)
class Window:
    """``s = where(i - left <= j <= i + right, s, fill)``: a local (sliding)
    window; ``right=None`` leaves it unbounded on the right (in practice
    together with a `Causal` op).  A causal window has ``right == 0``.

    Like `Causal`, these structured ops (`STRUCTURED`) are only emitted when
    the fill still excludes keys after the later ops; the position ones also
    only when every query row keeps a key.
    """

    left: int
    right: int | None
    fill: float


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``s = where(i // size == j // size, s, fill)``: chunked attention
    (Llama 4's local layers, together with a `Causal` op)."""

    size: int
    fill: float


@dataclasses.dataclass(frozen=True)
class Prefix:
    """``s = where((j <= i) | (j < length), s, fill)``: a prefix-LM mask (the
    first ``length`` keys are seen by every query, the rest causally)."""

    length: int
    fill: float


@dataclasses.dataclass(frozen=True)
class Segments:
    """``s = where(extras[q_index] == extras[kv_index], s, fill)``: packed
    documents.  The extras are the program's own integer segment ids, 4-D
    ``[B|1, H|1, T, 1]`` (queries) and ``[B|1, H|1, 1, S]`` (keys): O(T), never
    ``T x S``.  ``same``: the matcher proved the two are one array read at the
    query and at the key position (``ids[i] == ids[j]``, ``T == S``), which a
    kernel with one shared id array needs."""

    q_index: int
    kv_index: int
    fill: float
    same: bool = False


#: Score ops that exclude keys by position or segment id, so kernels may skip
#: whole blocks (`Causal` is one of them).
STRUCTURED = (Causal, Window, Chunk, Prefix, Segments)


@dataclasses.dataclass(frozen=True)
class Softcap:
    """``s = cap * tanh(s / cap)`` (logit soft-capping)."""

    cap: float


@dataclasses.dataclass(frozen=True)
class Dropout:
    """Dropout on the *probabilities*, exactly as ``jax.random.bernoulli`` drew it.

    Not a score op: whatever its position in ``score_ops`` (the matcher puts
    it last), it applies to the softmax output ``p``::

        p = where(keep, p * scale, 0)

    ``keep`` is the program's own keep-mask, regenerated from the key
    ``extras[index]`` (its uint32 key data, shaped ``shape == (1, 1, 1, 2)``).
    The program drew ``bits = random_bits(key, bits, mask_shape)`` under
    partitionable Threefry: element ``i`` of the flat mask is
    ``threefry2x32(key, (0, i))``, the two words XORed, truncated to ``bits``
    bits.  Those become a uniform in ``uniform_dtype`` the way
    ``jax.random.uniform`` makes it, and ``keep = uniform < threshold``
    (``keep_below``; else ``uniform >= threshold``, a drop-mask spelling).

    ``axes`` maps the canonical axes ``(B, H, T, S)`` to the flat mask index:
    each is a tuple of ``(size, stride)`` digits, most significant first (a
    canonical axis groups several program axes), with stride 0 where the mask
    is broadcast.  ``scale`` multiplies the kept weights (the ``1 / keep_prob``
    the program folded into the mask, in its dtype; 1.0 when the program
    divides elsewhere, which the matcher keeps as an output scale).
    """

    index: int
    shape: tuple[int, ...]
    mask_shape: tuple[int, ...]
    axes: tuple
    bits: int
    uniform_dtype: str
    threshold: float
    keep_below: bool = True
    scale: float = 1.0

    @property
    def size(self) -> int:
        """Elements of the program's keep-mask."""
        return int(np.prod(self.mask_shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Sink:
    """Attention sinks: one extra logit per row joins the softmax's normaliser
    but has no value (gpt-oss, StreamingLLM)::

        p = softmax(concat([s, sink], axis=-1))[..., :S]

    ``sink = extras[index]``, 4-D ``[B|1, H|1, T|1, 1]`` (usually one learned
    logit per head), in the scores' dtype.  Not a score op: whatever its
    position in ``score_ops`` (the matcher puts it after the score ops), it
    only enters the softmax.  Rows whose every key is excluded put all their
    weight on the sink: their output is zero, not the mean of ``v``.
    """

    index: int
    shape: tuple[int, ...]


ScoreOp = (
    Scale
    | Bias
    | Mask
    | Causal
    | Window
    | Chunk
    | Prefix
    | Segments
    | Softcap
    | KvLengths
    | Dropout
    | Sink
)

#: What a spec may use beyond plain scaled attention (`AttentionSpec.descriptors`),
#: with the words docs/kernels.md shows.  Kernels declare the ones they accept
#: (`Kernel.descriptors`).
DESCRIPTORS = {
    "causal": "causal mask (any offset >= 0)",
    "mask": "boolean mask varying over queries",
    "key_mask": "key (padding) mask `[B|1, H|1, 1, S]`",
    "bias": "additive bias",
    "softcap": "logit soft-cap",
    "gqa": "GQA / MQA (fewer K/V heads)",
    "window": "local window `(left, right)`",
    "chunk": "chunked attention (chunk size)",
    "prefix": "prefix-LM (static prefix length)",
    "segments": "segment ids (packed documents) `q_ids == kv_ids`",
    "kv_lengths": "per-row kv lengths (`j < lengths[b]`)",
    "sinks": "attention sinks (a per-row logit in the softmax)",
}
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
            if isinstance(op, Scale):
                value = value * op.value
            elif isinstance(op, Softcap):
                value = op.cap * np.tanh(value / op.cap)
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
        found = set()
        for op in self.score_ops:
            if isinstance(op, Causal):
                found.add("causal")
            elif isinstance(op, Bias):
                found.add("bias")
            elif isinstance(op, Softcap):
                found.add("softcap")
            elif type(op) in _DESCRIPTOR_OF:
                found.add(_DESCRIPTOR_OF[type(op)])
            elif isinstance(op, KvLengths):
                found.add("kv_lengths")
            elif isinstance(op, Mask):
                known = 0 <= op.index < len(self.extras)
                shape = tuple(self.extras[op.index].shape) if known else tuple(op.shape)
                found.add("key_mask" if len(shape) == 4 and shape[2] == 1 else "mask")
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


_DESCRIPTOR_OF = {
    Window: "window",
    Chunk: "chunk",
    Prefix: "prefix",
    Segments: "segments",
    Sink: "sinks",
}


def _op_to_dict(op) -> dict:
    d = {"op": type(op).__name__.lower()}
    for f in dataclasses.fields(op):
        value = getattr(op, f.name)
        if f.name == "dtype":
            value = np.dtype(value).name
        elif isinstance(value, tuple):
            value = list(value)
        d[f.name] = value
    return d
