"""Ring attention: a sequence-sharded site as a ring of per-block steps.

When q, k and v are sharded along their sequence axes over the same mesh
axes, every device holds one block of queries and one block of keys/values.
Instead of letting XLA all-gather K and V to full length on every device
(O(T) memory per device), the site runs inside ``shard_map`` as a ring:

* step ``s`` on device ``i`` attends its query block to the K/V block that
  started on device ``(i - s) mod n``, producing the block's output and its
  row max and sum (statistics, never probabilities);
* the partial outputs are merged in float32 (an online softmax);
* K/V move one device along the ring (``ppermute``) between steps, with
  what is read at key positions only (key segment ids, key padding masks and
  key biases, sharded like the keys);
* a step whose K/V block a position mask (causal, window...) excludes entirely is
  skipped (``lax.cond``), so a causal ring does about half the work.

The backward is a ring too (`jax.custom_vjp`): each device keeps its query
block and the saved output and row statistics, recomputes each step's
probabilities from the statistics, accumulates dQ locally and sends dK/dV
around the ring with the K/V block they belong to; after ``n`` steps every
dK/dV block is back on its own device.

Supported score ops (every kind of `flashpass.ops`, each applied by its own
element form in program order on global positions, with the program's own
fills, so rows a mask empties compute what the original does): scales,
causal (any offset), window, chunk, prefix and sink-token masks, and kv
lengths (padding); segment ids (packed documents: the query ids stay,
the key ids travel with their K/V block); biases and boolean masks (a
``[.., T, S]`` one sharded along its queries and sliced at the visiting
block, a key-only one travelling with it; a bias's gradient too); logit
soft-caps (the backward differentiates the elementwise score ops, biases
included, with ``jax.vjp``); attention sinks (the row statistics start from
the sink logit, as in the blockwise kernel); grouped-query attention;
dropout (the program's keep-mask regenerated from its key at global
positions: batch and head indices too, `ShardedIndex`).
`unsupported` names any other op.

Each step runs a kernel that declares `Kernel.ring_step` where the step's
masks translate into a static spec (`cases`: causal, window, full
attention and the position-free ops on evenly sharded self-attention), with
the step's row max and sum for the merge; the backward gives it the global
statistics and output, so its dQ, dK, dV are the block's exact share.  Other
steps run the ring's own plain JAX over chunks of the device's query rows
against the visiting block, at most `ROW_CHUNK_SCORES` scores at a time, so a
step's memory does not grow with the blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ..ops import ScoreOp
from ..spec import AttentionSpec
from . import backward, cases, forward
from .step import RingStep

#: A ring step runs over chunks of its query rows with at most this many
#: scores each (over batch and heads): a step's memory is bounded however long
#: the device blocks are (a 4M-score f32 chunk is 16 MiB).
ROW_CHUNK_SCORES = 1 << 22


def unsupported(spec: AttentionSpec) -> str | None:
    """Why the ring cannot run ``spec`` (None: it can): a step applies every
    op of `flashpass.ops` (in program order, with global positions) through its
    protocol."""
    other = [type(op).__name__ for op in spec.ops if not isinstance(op, ScoreOp)]
    if other:
        return "the ring applies the score ops of flashpass.ops, not " + ", ".join(
            sorted(set(other))
        )
    return None


def plan(spec: AttentionSpec, n: int, q_global: bool, kernels, ctx):
    """Per step of the ring over ``n`` devices, how each case runs it
    (`cases.plan_steps`; ``kernels`` in the order to try)."""
    return cases.plan_steps(spec, n, q_global, can_skip(spec, q_global), kernels, ctx)


def can_skip(spec: AttentionSpec, q_global: bool) -> bool:
    """Whether a step whose K/V block the position masks exclude entirely may
    be skipped.  With kv lengths a row may keep no key at all, and the original
    then averages over every key's fill (those rings skip by length at run
    time only, `visible`); with segment ids too, unless its own position is
    kept: one id array read at both positions (`Segments.same`), a causal
    mask, and no mask that may exclude the diagonal.  A boolean mask may empty
    a row too.  Each op says which it is (`ScoreOp.row_keys`)."""
    rows = {op.row_keys() for op in spec.ops}
    if "maybe none" in rows:
        return False
    if "own id" in rows:
        return q_global and "own" in rows and "not own" not in rows
    return True


def ring_attention(
    q,
    k,
    v,
    extras,
    spec: AttentionSpec,
    axis_name,
    axis_size: int,
    q_global: bool = True,
    steps=None,
    interpret: bool = False,
    sharded_index=None,
):
    """Attention of local blocks ``q [B,H,T/n,D]``, ``k``/``v [B,Hkv,S/n,D]``
    inside ``shard_map`` over ``axis_name`` (``axis_size`` devices); ``extras``
    are the spec's extra arrays, their query axes local like q; along the
    keys, with ``q_global`` those read at key positions only (key ids and
    masks) are local like k, the others whole (in the user's ``shard_map``
    all are whole: its code built them for the gathered keys).
    ``q_global``: the score ops read query rows at their global positions
    (the sequence-sharded site); else at the local ones, as code inside the
    user's ``shard_map`` wrote them (keys are global either way).
    ``steps``: `plan`'s answer (None: every step in plain JAX); ``interpret``
    runs Pallas step kernels in interpret mode.  ``sharded_index``: how the
    local batch and head indices map to the global ones where the site is
    sharded along them too (`ShardedIndex`; dropout draws its keep-mask at
    global positions)."""
    if steps is None:
        steps = plan(spec, axis_size, q_global, [], None)
    args = (ROW_CHUNK_SCORES, steps, interpret, sharded_index)
    ring = _ring(spec, axis_name, axis_size, q_global, *args)
    return ring(q, k, v, tuple(extras))


def chunk_rows(spec: AttentionSpec, budget: int) -> int:
    """Query rows per chunk of a step: the largest divisor of the block's
    rows whose scores (all batch rows and heads) fit ``budget`` (at least 1)."""
    per_row = spec.batch * spec.heads * spec.kv_len
    fits = [d for d in range(1, spec.q_len + 1) if spec.q_len % d == 0 and d * per_row <= budget]
    return max(fits, default=1)


@dataclasses.dataclass(frozen=True)
class ShardedIndex:
    """The global canonical batch and head indices of a device's local ones.

    ``batch`` and ``heads`` list the digits of each canonical axis, most
    significant first: ``(local size, mesh axes, shards)`` of each role it
    is made of (``mesh axes`` empty where the role is whole)."""

    batch: tuple
    heads: tuple

    def of(self, digits, local):
        """Global indices of the local index array ``local``."""
        out = jnp.zeros_like(local)
        stride = math.prod(size for size, _, _ in digits)
        for size, axes, shards in digits:
            stride //= size
            d = (local // stride) % size
            if axes:
                d = d + lax.axis_index(axes[0] if len(axes) == 1 else axes) * size
            out = out * (size * shards) + d
        return out


@functools.lru_cache(maxsize=64)
def _ring(spec: AttentionSpec, axis_name, n: int, q_global: bool, budget, steps, interpret, index):
    """The ring as a `jax.custom_vjp` of the local blocks (`forward.forward`,
    `backward.backward`), built once per static configuration."""
    r = RingStep(
        spec, axis_name, n, q_global, budget, steps, interpret, index,
        skippable=can_skip(spec, q_global), rows=chunk_rows(spec, budget),
    )  # fmt: skip

    @jax.custom_vjp
    def ring(q, k, v, extras):
        return forward.forward(r, q, k, v, extras)[0]

    ring.defvjp(functools.partial(forward.forward, r), functools.partial(backward.backward, r))
    return ring
