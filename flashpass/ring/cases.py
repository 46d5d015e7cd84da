"""Which kernel runs each step of a ring (`ring.py`), and with what spec.

On device ``i`` ring step ``s`` attends the local query block to the K/V
block that started on device ``(i - s) mod n``.  With blocks of equal length
``L`` (self-attention sharded evenly) the query block then starts
``d = s * L`` positions after the keys on devices ``i >= s`` (the block's own
case) and ``d = (s - n) * L`` on devices ``i < s`` (the wrapped case): within
one case ``d`` is the same on every device, so the position masks translate
into a static spec of the step in local positions, which a kernel declaring
`Kernel.ring_step` runs (`Kernel.step_forward`, `Kernel.step_backward`).  A
causal mask at ``d`` keeps keys ``c <= r + d + offset``: the diagonal block
is causal, the earlier blocks are whole, the wrapped ones excluded (skipped).

A case whose masks depend on the device beyond ``d`` (chunk and prefix
masks), or translate into a band no kernel spec states (a window's lower
edge above the diagonal, a causal edge below it), dropout (its keep-mask is
drawn at global positions), and every case of a ring whose blocks differ in
length or whose queries are local (inside the user's ``shard_map``) run the
ring's own plain-JAX step, which takes every op.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flashpass.kernels.base import CheckContext, Kernel

from ..ops import EXCLUDED, step_shape
from ..select import choose
from ..spec import AttentionSpec, ExtraSpec

#: What the step runs when no kernel takes it: the ring's own plain-JAX step.
PLAIN = "plain JAX"


@dataclasses.dataclass(frozen=True)
class StepCase:
    """How the devices of one case of a ring step run it.

    ``skip``: the position masks exclude every key of the visiting block (and
    the ring may skip such blocks); else ``kernel`` runs ``spec`` (the step in
    local positions), or, when ``kernel`` is None, the ring's plain-JAX step
    does (``why``: the reason)."""

    skip: bool = False
    kernel: Kernel | None = None
    spec: AttentionSpec | None = None
    why: str = ""


def local_ops(spec: AttentionSpec, d: int):
    """The score ops of a step whose query block starts ``d`` positions after
    its key block, in local positions: a tuple, `EXCLUDED` when they
    exclude every key, or a string saying why no static spec states them."""
    t, s = spec.q_len, spec.kv_len
    ops, why = [], None  # (an op that excludes the block wins over one not stated)
    for op in spec.ops:
        local = op.at_offset(d, t, s)
        if local is EXCLUDED:
            return EXCLUDED
        if isinstance(local, str):
            why = why or local
        elif local is not None:
            ops.append(local)
    return why or tuple(ops)


def step_spec(spec: AttentionSpec, ops: tuple) -> AttentionSpec:
    """``spec``'s step with score ops ``ops``: extras sized to the blocks, kv
    lengths int32 (the ring shifts them to the block, `shifted_lengths`), the
    output in float32 (the ring merges partial outputs in float32)."""
    lengths = {i for op in ops for i in op.key_counts(spec.kv_len)}
    extras = tuple(
        ExtraSpec(
            step_shape(e.shape, spec.q_len, spec.kv_len),
            "int32" if i in lengths else e.dtype,
        )
        if len(e.shape) == 4
        else e
        for i, e in enumerate(spec.extras)
    )
    return spec.with_ops(ops, extras=extras, out_dtype="float32")


def plan_steps(
    spec: AttentionSpec,
    n: int,
    q_global: bool,
    skippable: bool,
    kernels: list[Kernel],
    ctx: CheckContext | None,
) -> tuple[tuple[StepCase, ...], ...]:
    """Per ring step, its cases ``(own, wrapped)`` (step 0: ``(own,)``).

    ``skippable``: the ring may skip a block the masks exclude (no kv lengths
    or boolean masks that would leave a row with no key at all).  ``kernels``
    are tried in order for each case (those declaring `Kernel.ring_step`,
    chosen as a site's kernel is, `select.choose`: checked and probed)."""
    steppers = [k for k in kernels if k.ring_step and k.grad]
    steps = []
    for step in range(n):
        cases = []
        for d in (step * spec.kv_len,) + (((step - n) * spec.kv_len,) if step else ()):
            cases.append(_case(spec, d, q_global, skippable, steppers, ctx))
        steps.append(tuple(cases))
    return tuple(steps)


def _case(spec, d, q_global, skippable, steppers, ctx) -> StepCase:
    if not q_global:
        return StepCase(why="the queries are local (inside the user's shard_map)")
    if spec.q_len != spec.kv_len:
        return StepCase(why="query and key blocks differ in length")
    ops = local_ops(spec, d)
    if ops is EXCLUDED:
        if skippable:
            return StepCase(skip=True)
        return StepCase(why="a block the masks exclude that a row may still need")
    if isinstance(ops, str):
        return StepCase(why=ops)
    if not steppers or ctx is None:
        return StepCase(why="no kernel declares ring steps here")
    local = step_spec(spec, ops)
    kernel, rejections = choose(local, steppers, ctx, step=True)
    if kernel is not None:
        return StepCase(kernel=kernel, spec=local)
    return StepCase(why=" | ".join(f"{k}: {'; '.join(r)}" for k, r in rejections.items()))


def shifted_lengths(lengths, k0, bound: int):
    """A kv-lengths array as a block whose keys start at ``k0`` reads it
    (int32): clipped to ``[-bound, bound]`` first, so a sentinel length cannot
    wrap round when shifted.  ``bound`` (the global key count plus the largest
    ``|KvLengths.shift|`` plus one) keeps every ``clip(L + shift, 0, S)``."""
    wide = jnp.clip(lengths, -bound, bound).astype(jnp.int32)
    return wide - jnp.asarray(k0, jnp.int32)


def describe(steps) -> str:
    """The kernels the ring's steps run, e.g. ``"blockwise"`` or
    ``"blockwise, plain JAX"`` (skipped blocks not counted)."""
    names = []
    for cases in steps:
        for case in cases:
            if case.skip:
                continue
            name = case.kernel.name if case.kernel is not None else PLAIN
            if name not in names:
                names.append(name)
    return ", ".join(names) or "none (every block skipped)"
