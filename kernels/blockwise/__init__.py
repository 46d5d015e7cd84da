"""Flash attention in plain JAX (``lax`` loops, no Pallas): runs on every platform.

Forward: for each query block, an online softmax over key blocks (running max
``m``, row sum ``den``, unnormalised output ``acc``).  Backward: the
flash-attention-2 recurrence, recomputing each score tile from ``q``, ``k`` and
the row statistics saved by the forward.  No ``T x S`` array is ever formed,
only ``block_q x block_k`` tiles.  Under a causal mask, tiles entirely above
the diagonal are never visited (per-tile trip counts from a static table).

Score ops are applied per tile with `reference.apply_score_ops`, so this kernel
and the reference implement the spec with literally the same code; the backward
differentiates that same function per tile (``jax.vjp``), which gives the chain
rule through Scale/Bias/Mask/Causal/Softcap for free and cannot drift from it.

Layout: ``q`` is viewed as ``[B, Hkv, G, T, D]`` so grouped-query attention reads
each key/value head once (never repeated); extras become 5-D
``[b, hkv, g, t, s]`` with every axis either 1 (broadcast, never expanded) or
full, and are sliced per tile only along their full axes.

CPU notes (what XLA's CPU backend makes of this; see docs/benchmarks.md):
tiles default to about 4 MiB of scores (`default_blocks`), so the passes over a
tile (max, exp, sum) stay in L2; the backward works on key-major tiles so all
five products per tile take XLA's fast matmul path (it has none for a
transposed left operand); the scale is applied per query tile, not as a pass
over ``q``; and what the skipped causal blocks contribute is summed per key
block, without a cumulative sum over the keys.  Long sequences run one
(batch, kv head) unit at a time (`head_loop_pays`): XLA's CPU dot runs one
``[1024, 64] x [64, 1024]`` matmul faster than a batch of eight smaller ones.

Modules: `plan` (tuning constants, `BlockSizes`, the static tiling), `tiles`
(loops, layout and per-tile score helpers), `flash` (forward, backward and
their ``custom_vjp``), `heads` (the head loop), `adapter` (`BlockwiseKernel`).
"""

from __future__ import annotations

from .adapter import BlockwiseKernel
from .heads import head_loop_pays, unit_spec
from .plan import (
    CPU_MIN_KV_LEN,
    HEAD_LOOP_BLOCK,
    HEAD_LOOP_MIN_CAUSAL_LEN,
    MAX_INNER_BLOCK,
    MIN_BLOCK,
    OUTER_BLOCK,
    TILE_ELEMENTS,
    BlockSizes,
    Plan,
    default_blocks,
    make_plan,
)

__all__ = [
    "CPU_MIN_KV_LEN",
    "HEAD_LOOP_BLOCK",
    "HEAD_LOOP_MIN_CAUSAL_LEN",
    "MAX_INNER_BLOCK",
    "MIN_BLOCK",
    "OUTER_BLOCK",
    "TILE_ELEMENTS",
    "BlockSizes",
    "BlockwiseKernel",
    "Plan",
    "default_blocks",
    "head_loop_pays",
    "make_plan",
    "unit_spec",
]
