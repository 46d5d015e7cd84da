"""Attention sinks: a logit column concatenated to the scores (gpt-oss).

``softmax(concatenate([s, sink], axis=key))[..., :-1] @ v`` gives every row
one more logit in the softmax's normaliser, with no value: the sink takes
weight from the keys.  keras-hub's gpt-oss writes it so, with the sink a
learned ``[H]`` logit broadcast to ``[B, H, T, 1]``.

The chain reads the ``concatenate`` as a `SinkStep`; it becomes a `Sink` op
whose extra is the column, un-broadcast.  The column may come first
(``[sink, s]`` and ``p[..., 1:]``).  Nothing may follow it on the scores but
casts and transposes (a scale or mask after it would change the sink too);
the probabilities must drop the column with a ``slice`` before ``P·V``
(`patterns.probabilities`), and the softmax may subtract any row constant
first, e.g. the max over scores and sink together (`patterns.softmax`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flashpass.spec import Sink

from .chain import Step, rule
from .common import Miss, Profile, profile, where


@dataclasses.dataclass
class SinkStep(Step):
    """``concatenate`` of one sink column to the scores along ``axis``;
    ``at`` is "end" (``[s, sink]``) or "start" (``[sink, s]``)."""

    axis: int
    profile: Profile
    at: str

    def apply(self, build) -> Miss | None:
        role = build.roles[self.axis]
        if role != "S":
            what = {"T": "query"}.get(role, "batch or head")
            return Miss(
                f"a column is concatenated to the scores along the {what} axis, not the key axis"
            )
        if build.sink is not None:
            return Miss("two sink columns are concatenated to the scores")
        dtype = build.scope.dtype(self.profile.base)
        if not jnp.issubdtype(dtype, jnp.floating):
            return Miss(f"the sink logits are {dtype}, not floating point")
        index, shape4 = build.add_extra(self.profile, None, dtype)
        build.ops.append(Sink(index, shape4))
        build.sink = self.at
        return None


@rule("concatenate")
def _concatenate(scope, node, out):
    if len(node.ins) != 2:
        return Miss(
            f"{len(node.ins)} arrays concatenated to the scores; a sink is one column{where(node)}",
            node,
        )
    axis = node.params["dimension"]
    readings = []
    for position, at in ((0, "end"), (1, "start")):
        chain, side = node.ins[position], node.ins[1 - position]
        shape = scope.shape(side)
        if shape[axis] != 1:
            continue
        prof = profile(scope, side, shape)
        # The column is broadcast along the key axis of the scores: one logit per row.
        axes = tuple(None if t == axis else a for t, a in enumerate(prof.axes))
        readings.append(SinkStep(node, chain, axis, Profile(prof.base, axes, prof.target), at))
    if not readings:
        return Miss(
            f"`concatenate` of the scores with more than one column (a sink is one logit "
            f"per row){where(node)}",
            node,
        )
    return readings
