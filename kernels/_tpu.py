"""What the adapters of JAX's Pallas TPU kernels share: block sizes, `TpuKernel`."""

from __future__ import annotations

from collections.abc import Callable

from flashpass.spec import AttentionSpec

from ._util import round_up
from .base import CheckContext, Kernel

#: The Pallas TPU kernels (flash attention, splash): key blocks are multiples of
#: the lane width, 128 (their MIN_BLOCK_SIZE), as are head dims above it.
TPU_LANES = 128
#: Query lengths are padded to a multiple of this.  Besides sublane tiling, an
#: even block_q sidesteps an off-by-one in the TPU flash kernel's causal block
#: skipping, ``(r + 1) * block_q - 1 > c * block_k``: a block whose last row
#: equals the first key is skipped (e.g. block_q == 1 with several key blocks
#: loses row 0).
TPU_Q_MULTIPLE = 16
#: Default largest block (VMEM-friendly on every TPU generation).  Query
#: lengths up to the largest block are one block, padded to `TPU_Q_MULTIPLE` only.
TPU_MAX_BLOCK = 512


def largest_block(length: int, max_block: int) -> int:
    """Largest power-of-two multiple of 128, at most ``max_block``, dividing
    ``length`` (a multiple of 128)."""
    block = TPU_LANES
    while block * 2 <= max_block and length % (block * 2) == 0:
        block *= 2
    return block


def tpu_query_tiling(q_len: int, max_block: int, multiple: int = TPU_Q_MULTIPLE):
    """``(padded q_len, block_q)`` for the Pallas TPU kernels: one block padded
    to ``multiple`` up to ``max_block``, else blocks of `largest_block`."""
    if q_len <= max_block:
        padded = round_up(q_len, multiple)
        return padded, padded
    padded = round_up(q_len, TPU_LANES)
    return padded, largest_block(padded, max_block)


def tpu_head_dim(d: int) -> int:
    """A head dim as the Pallas TPU kernels take it: above 128, a multiple of 128."""
    return round_up(d, TPU_LANES) if d > TPU_LANES else d


class TpuKernel(Kernel):
    """Base of the adapters of JAX's Pallas TPU kernels (``pallas_tpu``,
    ``splash``): they run on TPU, or on CPU with ``interpret=True`` (slow; for
    tests), with reverse-mode gradients.  A Pallas call is a custom call: XLA's
    SPMD partitioner runs it replicated, and it does not type-check inside
    ``shard_map`` with ``check_vma``.  Subclasses set ``spec_reasons``, the
    static reasons (platform aside) they cannot run a spec."""

    platforms = ("tpu",)
    interpret_platforms = ("cpu",)
    grad = True
    partitionable = False
    plain_jax = False
    spec_reasons: Callable[[AttentionSpec], list[str]]

    def __init__(self, *, max_block: int = TPU_MAX_BLOCK):
        """``max_block``: the largest query/key block (a power-of-two multiple of 128)."""
        if max_block < TPU_LANES or max_block & (max_block - 1):
            raise ValueError(f"max_block must be a power-of-two multiple of 128, got {max_block}")
        self.max_block = max_block

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        """Reasons this kernel cannot run ``spec`` on ``ctx.platform`` (static)."""
        return self.platform_reasons(ctx) + self.spec_reasons(spec)
