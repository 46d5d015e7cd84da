"""The blockwise kernel's static tiling: tuning constants, block sizes, plans.

Everything here is decided from the `AttentionSpec` alone, before tracing:
tile sizes (`default_blocks`, or a user's `BlockSizes`), and per tile which
score ops it applies and which causal tiles are skipped (`make_plan`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from flashpass.ops import KINDS, Positional, Scale
from flashpass.spec import AttentionSpec

from .. import _util
from . import bounds

# Tuning constants.  The measurements behind them (crossover, tile sizes, head
# loop; machine, dates and commands) are in docs/benchmarks.md, "Tuning" and
# "Crossover".

#: Below this ``kv_len`` the original (naive) computation is faster on CPU, so
#: the kernel declines unless named explicitly (`python benchmarks/crossover.py`).
CPU_MIN_KV_LEN = 1024
#: Score elements per tile, over all batch rows and heads (a tile is
#: ``[B, H, block_q, block_k]``): 1M f32 scores, 4 MiB, about the two cores' L2,
#: so the ~8 XLA kernels a tile runs as stay in cache.
TILE_ELEMENTS = 1 << 20
#: The loop over whole blocks (query blocks in the forward, key blocks in the
#: backward) takes blocks of `OUTER_BLOCK`; the inner loop's tiles are as long
#: as the budget allows (forward 512 x 256, backward 256 x 512 at 8 heads).
#: Short sequences get one tile per axis (`split`).
OUTER_BLOCK, MIN_BLOCK, MAX_INNER_BLOCK = 512, 128, 1024
#: The head loop (`heads.head_loop_pays`) runs one (batch, kv head) unit at a
#: time with tiles of `HEAD_LOOP_BLOCK` in both axes: every product is one
#: ``[G*block_q, D] x [D, block_k]`` matmul, which XLA's CPU dot runs faster
#: than a batch of smaller ones.  With causal skipping the larger tiles waste
#: more of the diagonal, so there it starts at `HEAD_LOOP_MIN_CAUSAL_LEN`.
HEAD_LOOP_BLOCK = 1024
HEAD_LOOP_MIN_CAUSAL_LEN = 8192
#: Under a window or chunk that keeps at most ``w`` keys per row, tiles are at
#: most ``w / BAND_TILES`` (a power of two, at least `MIN_BAND_BLOCK`): the tiles
#: a query block visits then cover ~1.25 ``w`` keys per row, not the ~4 ``w`` of
#: 1024-wide tiles (W=512 at S=8192: 128 x 128 tiles run 3x faster than the
#: default, smaller ones lose to loop overhead; docs/benchmarks.md, "Masks").
BAND_TILES, MIN_BAND_BLOCK = 4, 64


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Maximum tile sizes of the blockwise kernel (like Pallas' ``BlockSizes``).

    ``block_q`` x ``block_k`` are the forward's tiles, ``block_q_bwd`` x
    ``block_k_bwd`` the backward's.  None means "chosen per shape"
    (`default_blocks`); a backward size left None takes the forward's given
    size, if any.  Lengths that are not a multiple are padded internally, so
    any positive size is valid; sizes never change results beyond rounding.
    """

    block_q: int | None = None
    block_k: int | None = None
    block_q_bwd: int | None = None
    block_k_bwd: int | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{f.name} must be a positive int or None, got {value!r}")
            object.__setattr__(self, f.name, int(value))

    def pick(self, defaults: tuple[int, int], backward: bool = False) -> tuple[int, int]:
        """The ``(block_q, block_k)`` of one pass: the given sizes, else ``defaults``."""
        bq, bk = self.block_q, self.block_k
        if backward:
            bq = bq if self.block_q_bwd is None else self.block_q_bwd
            bk = bk if self.block_k_bwd is None else self.block_k_bwd
        return (defaults[0] if bq is None else bq), (defaults[1] if bk is None else bk)


def split(n: int, block: int) -> tuple[int, int]:
    """(tile, count) covering ``n`` with tiles of at most ``block`` rows.

    Tiles are balanced (``n=600, block=512`` gives 2 x 304, not 512 + 88 of
    which most is padding) and kept a multiple of 8 when ``block`` is.
    """
    if n <= block:
        return n, 1
    count = -(-n // block)
    tile = -(-n // count)
    if block % 8 == 0:
        tile = _util.round_up(tile, 8)
    return tile, -(-n // tile)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one kernel invocation (hashable: a custom_vjp static arg)."""

    spec: AttentionSpec
    # Leading Scale ops folded into q ((c*q) @ k^T instead of c * (q @ k^T)): one
    # pass less over every score tile.  1.0 when nothing is folded.
    q_scale: float
    ops_edge: tuple  # score ops on tiles that straddle the diagonal or the padding
    ops_plain: tuple  # score ops on the other tiles: no causal `where`
    bq: int
    bk: int
    nq: int
    nk: int
    cdt: np.dtype  # compute dtype, at least float32
    # Block skipping (`bounds`: causal, window, chunk, prefix).  Per query
    # block: key tiles [kstart, kfs) and [kfull, kend) are edge tiles (they
    # straddle a mask's boundary or the padding), [kfs, kfull) are entirely
    # kept and unpadded, the rest skipped.  Per key block: query tiles
    # [qstart, qfull) and [qfe, qend) are edge tiles, [qfull, qfe) plain ones.
    kfull: tuple[int, ...]
    kend: tuple[int, ...]
    qstart: tuple[int, ...]
    qfull: tuple[int, ...]
    # Final score of a skipped key when it is finite (e.g. a fill of -1e9, or
    # any fill followed by Softcap): skipped keys then still count, exactly,
    # through a closed form (all of them share that one score).  None when
    # skipped keys have score -inf (weight exactly 0) or nothing is skipped.
    skipped_score: float | None
    kstart: tuple[int, ...] = ()
    kfs: tuple[int, ...] = ()
    qfe: tuple[int, ...] = ()
    qend: tuple[int, ...] = ()
    # Position of the last op of the skipped run (`bounds.skip_run`), and the
    # final score of the keys it excludes (-inf included) when segment ids
    # skip tiles at run time (`segments`: the Segments op), else None.
    skip_at: int | None = None
    segments: object = None
    segment_score: float | None = None
    # Per query block, key tiles [0, khead) visited (as edge tiles) before
    # [kstart, kend) when the tiles between are skipped (sink tokens before a
    # window, `bounds.ranges`); empty when no block has such a head.
    khead: tuple[int, ...] = ()

    @property
    def padded_k(self) -> bool:
        return self.nk * self.bk > self.spec.kv_len

    @property
    def kend_key(self) -> tuple[int, ...]:
        """First skipped key position per query block (``S`` when none is skipped)."""
        return tuple(min(e * self.bk, self.spec.kv_len) for e in self.kend)

    @property
    def kstart_key(self) -> tuple[int, ...]:
        """First visited key position per query block."""
        return tuple(min(e * self.bk, self.spec.kv_len) for e in self.kstart)

    @property
    def khead_key(self) -> tuple[int, ...]:
        """Keys visited before each query block's range (0 without a head)."""
        return tuple(min(h * self.bk, self.spec.kv_len) for h in self.khead or (0,) * self.nq)

    def tiles_computed(self) -> int:
        """Number of (query tile, key tile) pairs the forward computes (at most:
        segment ids skip more at run time)."""
        return sum(self.kend) - sum(self.kstart) + sum(self.khead)


@dataclasses.dataclass(frozen=True)
class Plans:
    """The forward's and the backward's tilings (they may differ, see
    `default_blocks`).  With ``head_loop`` both tile ``unit_spec(spec)`` and
    run once per (batch, kv head) unit."""

    fwd: Plan
    bwd: Plan
    spec: AttentionSpec

    @property
    def head_loop(self) -> bool:
        return self.fwd.spec != self.spec


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def default_blocks(
    spec: AttentionSpec, backward: bool = False, outer: int = OUTER_BLOCK
) -> tuple[int, int]:
    """The (maximum) tile sizes ``(block_q, block_k)`` used when none are given.

    A tile holds ``B * H * block_q * block_k`` scores; aim at `TILE_ELEMENTS`.
    The outer loop's block (``block_q`` in the forward, ``block_k`` in the
    backward, whose loops are key-major) is ``outer``: it is sliced once
    per outer iteration and its accumulators stay put; the inner block fills
    the budget (at most `MAX_INNER_BLOCK`).  Many heads shrink the inner block,
    then the outer one, to `MIN_BLOCK`.
    """
    require_known(spec)
    heads = spec.batch * spec.heads
    inner = min(_pow2_floor(TILE_ELEMENTS // (heads * outer)), MAX_INNER_BLOCK)
    if inner < MIN_BLOCK:
        inner = MIN_BLOCK
        outer = max(_pow2_floor(TILE_ELEMENTS // (heads * inner)), MIN_BLOCK)
    width = band_width(spec)
    if width is not None:
        cap = max(_pow2_floor(width // BAND_TILES), MIN_BAND_BLOCK)
        inner, outer = min(inner, cap), min(outer, cap)
    return (inner, outer) if backward else (outer, inner)


def require_known(spec: AttentionSpec) -> None:
    """Raise TypeError for a score op that is none of `flashpass.ops.KINDS`."""
    for op in spec.ops:
        if not isinstance(op, KINDS):
            raise TypeError(f"unknown score op {op!r}: the blockwise kernel does not implement it")


def band_width(spec: AttentionSpec) -> int | None:
    """Most keys a query row keeps under the skippable window and chunk ops
    (`bounds.skip_run`), or None when they do not bound it (no such op, or a
    window open to the right without a causal op)."""
    run = bounds.skip_run(spec)
    if run is None:
        return None
    # Each op's band of row 0 (`Positional.band`); an edge it leaves open is
    # the nearest one an op bounding only that side gives (a causal edge).
    ops = spec.ops[run[0] : run[1] + 1]
    bands = [op.band(0) for op in ops if isinstance(op, Positional)]
    bands = [b for b in bands if b is not None]
    right = min((hi for lo, hi in bands if lo is None and hi is not None), default=None)
    widths = []
    for lo, hi in bands:
        hi = right if hi is None else hi
        if lo is not None and hi is not None:
            widths.append(hi - lo)
    return min(widths, default=None)


def make_plan(spec: AttentionSpec, block_q: int, block_k: int) -> Plan:
    """Tile sizes and the per-tile work lists for ``spec``."""
    require_known(spec)
    T, S = spec.q_len, spec.kv_len
    bq, nq = split(T, block_q)
    bk, nk = split(S, block_k)
    padded = nk * bk > S
    cdt = np.dtype(jnp.promote_types(spec.compute_dtype, jnp.float32))

    # Skipping is exact only when every skipped key has the same final score,
    # i.e. nothing after the structured ops depends on the key position.
    ops = spec.ops
    run = bounds.skip_run(spec)
    skipped = ops[run[0] : run[1] + 1] if run is not None else ()
    static = tuple(op for op in skipped if isinstance(op, Positional))
    c = spec.final_fill(run[1], ops[run[1]].fill) if run is not None else None
    empty, full = bounds.tile_table(static, T, S, bq, bk, nq, nk)
    if padded:
        full[:, -1] = False  # the padded tile always needs the `where`
    rows = [bounds.ranges(~empty[iq], full[iq], head=True) for iq in range(nq)]
    cols = [bounds.ranges(~empty[:, ik], full[:, ik]) for ik in range(nk)]
    khead, kstart, kfs, kfull, kend = (tuple(r[n] for r in rows) for n in range(5))
    qstart, qfull, qfe, qend = (tuple(r[n] for r in cols) for n in range(4))
    skips = any(h + e - s < nk for h, s, e in zip(khead, kstart, kend, strict=True))
    skipped_score = c if skips and c is not None and math.isfinite(c) else None
    segments = bounds.segment_ops(spec, run)

    # Fold the leading Scales into q when that is exact (a power of two, and q
    # has float32's exponent range so nothing turns subnormal) or merely moves
    # one rounding (q already in the compute dtype).
    lead = next((i for i, op in enumerate(ops) if not isinstance(op, Scale)), len(ops))
    q_scale = float(np.prod([np.float32(op.value) for op in ops[:lead]], dtype=np.float32))
    exact = (
        math.frexp(abs(q_scale))[0] == 0.5
        and jnp.finfo(spec.q_dtype).minexp <= jnp.finfo(np.float32).minexp
    )
    usable = lead and math.isfinite(q_scale) and q_scale != 0
    if usable and (exact or np.dtype(spec.q_dtype) == cdt):
        ops = ops[lead:]
    else:
        q_scale = 1.0
    ops_plain = tuple(op for op in ops if not any(op is x for x in static))
    return Plan(
        spec=spec,
        q_scale=q_scale,
        ops_edge=ops,
        ops_plain=ops_plain,
        bq=bq,
        bk=bk,
        nq=nq,
        nk=nk,
        cdt=cdt,
        kfull=kfull,
        kend=kend,
        qstart=qstart,
        qfull=qfull,
        skipped_score=skipped_score,
        kstart=kstart,
        kfs=kfs,
        qfe=qfe,
        qend=qend,
        khead=khead if any(khead) else (),
        skip_at=run[1] if run is not None else None,
        segments=segments,
        segment_score=c if segments is not None else None,
    )
