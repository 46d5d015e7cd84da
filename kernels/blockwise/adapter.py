"""`BlockwiseKernel`: the blockwise kernel's adapter (choices, check, apply)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flashpass.spec import AttentionSpec

from .. import _util
from ..base import CheckContext, PlainJaxKernel
from . import decode, flash
from .cost import DECODE_BLOCK_K, faster_as_written
from .decode import decode_reasons, make_decode_plan
from .flash import attention
from .heads import head_loop_pays, unit_spec
from .plan import (
    HEAD_LOOP_BLOCK,
    MIN_BLOCK,
    TILE_ELEMENTS,
    BlockSizes,
    Plan,
    Plans,
    default_blocks,
    make_plan,
)


class BlockwiseKernel(PlainJaxKernel):
    """Flash attention written with ``lax`` loops: every platform, any spec.

    ``block_q``/``block_k`` are maximum tile sizes, by default (None) chosen
    per shape by `default_blocks`; lengths that are not a multiple are padded
    internally (padded keys get weight exactly 0, padded query rows are
    dropped).  ``block_sizes`` (a `BlockSizes`, instead of ``block_q`` and
    ``block_k``) also sets the backward's tiles.  ``head_loop`` runs one
    (batch, kv head) unit at a time (see `HEAD_LOOP_BLOCK`); None (the
    default) does so on a single CPU device where `head_loop_pays`.  None of
    these changes results beyond rounding.  Capabilities: every spec, as a
    `PlainJaxKernel`, and exact dropout: each tile's keep-mask is regenerated
    from the program's key (`flashpass.kernels.dropout`), forward and backward;
    ring steps (its forward's row statistics, its backward from given ones).
    """

    name = "blockwise"
    dropout = True
    ring_step = True
    kv_layouts = decode.KV_LAYOUTS

    def __init__(
        self,
        block_q: int | None = None,
        block_k: int | None = None,
        head_loop: bool | None = None,
        *,
        block_sizes: BlockSizes | None = None,
    ):
        if block_sizes is None:
            block_sizes = BlockSizes(block_q, block_k)
        elif not isinstance(block_sizes, BlockSizes):
            raise TypeError(f"block_sizes must be a BlockSizes, got {block_sizes!r}")
        elif (block_q, block_k) != (None, None):
            raise ValueError("give either block_q/block_k or block_sizes, not both")
        if head_loop not in (None, True, False):
            raise ValueError(f"head_loop must be True, False or None, got {head_loop!r}")
        self.block_sizes = block_sizes
        self.head_loop = head_loop

    @property
    def block_q(self) -> int | None:
        return self.block_sizes.block_q

    @property
    def block_k(self) -> int | None:
        return self.block_sizes.block_k

    def uses_head_loop(self, spec: AttentionSpec) -> bool:
        """Whether ``spec`` runs unit by unit: as given, else on a single CPU
        device where it pays.  (With several devices the heads may be sharded,
        and XLA would all-gather them to slice one head per loop step.)  Never
        with dropout: its keep-mask is indexed by the global batch and head."""
        if spec.dropout is not None:
            return False
        if self.head_loop is not None:
            return self.head_loop
        single_cpu = jax.default_backend() == "cpu" and jax.device_count() == 1
        return single_cpu and head_loop_pays(spec)

    def blocks(self, spec: AttentionSpec, backward: bool = False) -> tuple[int, int]:
        """The maximum tile sizes for ``spec``: the given ones, else `default_blocks`
        (of one unit, with `HEAD_LOOP_BLOCK` outer blocks, under the head loop)."""
        if self.uses_head_loop(spec):
            defaults = default_blocks(unit_spec(spec), backward, outer=HEAD_LOOP_BLOCK)
        else:
            defaults = default_blocks(spec, backward)
        if spec.dropout is not None:
            defaults = _dropout_blocks(spec, defaults)
        return self.block_sizes.pick(defaults, backward)

    def plan(self, spec: AttentionSpec) -> Plan:
        """The static tiling of ``spec``'s forward (of one unit under the head
        loop; exposed for tests and diagnostics)."""
        tiled = unit_spec(spec) if self.uses_head_loop(spec) else spec
        return make_plan(tiled, *self.blocks(spec))

    def check(self, spec: AttentionSpec, ctx: CheckContext) -> list[str]:
        """Reasons not to run ``spec``: platform, and where the original is
        faster (`cost.faster_as_written`: short sequences, decode steps on CPU)."""
        reasons = self.platform_reasons(ctx)
        layout = ctx.kv_layout if ctx.kv_layout in self.kv_layouts else "bhsd"
        slower = None if ctx.explicit else faster_as_written(spec, ctx.platform, layout)
        if slower is not None:
            reasons.append(
                f"kept: faster as written: {slower}; name kernel='blockwise' to force the rewrite"
            )
        return reasons

    def uses_decode(self, spec: AttentionSpec) -> bool:
        """Whether ``spec`` runs on the decode path (`decode`): a few queries
        with per-row kv lengths, chunks past each row's length skipped."""
        return not decode_reasons(spec)

    def apply(
        self,
        spec: AttentionSpec,
        q,
        k,
        v,
        extras=(),
        *,
        interpret: bool = False,
        kv_layout: str = "bhsd",
    ):
        """Attention ``[B, H, T, Dv]`` in ``spec.out_dtype`` (``interpret`` is ignored).

        ``kv_layout="bshd"``: k and v are ``[B, S, Hkv, D]``, as the program
        holds its cache.  The decode path slices its chunks from them as they
        are; the tiled path (prefill, where the T x S work dwarfs one pass
        over K/V) transposes them to the canonical layout first.
        """
        extras = tuple(extras)
        if kv_layout not in decode.KV_LAYOUTS:
            raise ValueError(f"blockwise: kv_layout must be one of {decode.KV_LAYOUTS}")
        _util.check_arrays(
            self.name,
            spec,
            q,
            decode.to_canonical_shape(k, kv_layout),
            decode.to_canonical_shape(v, kv_layout),
            extras,
        )
        if self.uses_decode(spec):
            bwd_blocks = self.block_sizes.pick(default_blocks(spec, True), backward=True)
            block_k = self.block_sizes.block_k or DECODE_BLOCK_K
            plan = make_decode_plan(spec, block_k, bwd_blocks, kv_layout)
            return decode.attention(plan, q, k, v, extras)
        k, v = decode.to_canonical(k, kv_layout), decode.to_canonical(v, kv_layout)
        return attention(self._plans(spec), q, k, v, extras)

    def _plans(self, spec: AttentionSpec) -> Plans:
        fwd = self.plan(spec)
        bwd = make_plan(fwd.spec, *self.blocks(spec, backward=True))
        return Plans(fwd, bwd if bwd != fwd else fwd, spec)

    def step_forward(self, spec: AttentionSpec, q, k, v, extras=(), *, interpret: bool = False):
        """One ring step over the kernel's tiles (`Kernel.step_forward`)."""
        extras = tuple(extras)
        _util.check_arrays(self.name, spec, q, k, v, extras)
        return flash.step_forward(self._plans(spec), q, k, v, extras)

    def step_backward(
        self, spec, q, k, v, extras, out, m, den, dout, wanted, *, interpret: bool = False
    ):
        """A ring step's gradients (`Kernel.step_backward`), in float32: the
        inputs widened first (exactly), so the shares the ring sums are not
        rounded to a narrow input dtype."""
        wide = [_wide(x) for x in (q, k, v)]
        args = (*wide, tuple(_wide(x) for x in extras), out, m, den, dout, wanted)
        return flash.step_backward(self._plans(spec), *args)

    def __repr__(self) -> str:
        bq, bk = (b if b is not None else "auto" for b in (self.block_q, self.block_k))
        loop = "auto" if self.head_loop is None else self.head_loop
        bwd = ""
        sizes = self.block_sizes
        if (sizes.block_q_bwd, sizes.block_k_bwd) != (None, None):
            bwd = " bwd={}x{}".format(*sizes.pick(("auto", "auto"), backward=True))
        return f"<flashpass kernel 'blockwise' block_q={bq} block_k={bk}{bwd} head_loop={loop}>"


def _wide(x):
    """A floating array narrower than float32 widened to it (exact)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        return x.astype(jnp.float32)
    return x


#: With dropout, a tile also holds its Threefry counters and words (several
#: uint32 arrays of the tile's size): tiles get this fraction of the budget.
DROPOUT_TILE_FRACTION = 4


def _dropout_blocks(spec: AttentionSpec, blocks: tuple[int, int]) -> tuple[int, int]:
    """``blocks`` halved, the larger first, down to `TILE_ELEMENTS` /
    `DROPOUT_TILE_FRACTION` scores per tile (not below `MIN_BLOCK`)."""
    bq, bk = blocks
    budget = TILE_ELEMENTS // DROPOUT_TILE_FRACTION
    while spec.batch * spec.heads * bq * bk > budget and max(bq, bk) > MIN_BLOCK:
        if bk >= bq:
            bk //= 2
        else:
            bq //= 2
    return bq, bk
