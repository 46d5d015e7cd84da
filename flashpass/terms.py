"""Extras that are terms the program adds to the scores in another shape.

A site's side arrays usually reach its kernel through transposes, reshapes
and casts of their own axes (`flashpass.site`).  These two change the axes:
a term added while a reshape splits the scores into factors (`Unsplit`), and
a term added to one static block of the scores (`Padded`).  Both are exact
(a reshape, a broadcast, zero padding) and read the term's array whole.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def term_in(x, axes: tuple, sizes: tuple):
    """``x`` (a term's array) with one axis per entry of ``axes`` (``axes[t]``:
    ``x``'s axis feeding axis ``t``, None where broadcast: size 1), sized
    ``sizes``; ``x``'s axes that feed none have size 1 (`Profile`)."""
    used = [a for a in axes if a is not None]
    drop = tuple(a for a in range(x.ndim) if a not in used)
    x = jnp.squeeze(x, drop) if drop else x
    kept = sorted(used)
    x = jnp.transpose(x, [kept.index(a) for a in used])
    return x.reshape([1 if a is None else sizes[t] for t, a in enumerate(axes)])


@dataclasses.dataclass(frozen=True)
class Unsplit:
    """An extra that is a term the program adds to the scores while a reshape
    splits their axes into factors (``split``), before merging them back
    (``merged``): SAM's and ViTDet's decomposed relative positions add
    ``rel_h[..., None]`` and ``rel_w[..., None, :]`` to the scores viewed as
    ``[B, qh, qw, kh, kw]``.  ``apply`` reads the term's un-broadcast array
    (``axes[t]``: its axis feeding split axis ``t``, None where broadcast) and
    returns it in the merged layout: broadcast over the factors of each merged
    group it varies along, size 1 over a group it does not vary along at all.
    Unlike the other transforms it changes the array's axes, so an extra that
    carries it is read whole (never sharded: `flashpass.sharding`)."""

    axes: tuple  # per split axis: the term's axis, or None
    split: tuple  # the split shape
    groups: tuple  # ((split axes, merged axes), ...): the reshape's runs of equal size
    merged: tuple  # the merged shape
    negate: bool = False  # a subtracted term

    def carried(self) -> tuple:
        """Per merged axis: whether the result varies along it (else size 1)."""
        out = [False] * len(self.merged)
        for split, merged in self.groups:
            if any(self.axes[t] is not None for t in split):
                for j in merged:
                    out[j] = True
        return tuple(out)

    def apply(self, x):
        x = term_in(jnp.asarray(x), self.axes, self.split)
        full = list(x.shape)
        for split, _ in self.groups:
            if any(self.axes[t] is not None for t in split):
                for t in split:
                    full[t] = self.split[t]
        carried = self.carried()
        x = jnp.broadcast_to(x, full).reshape(
            [d if carried[j] else 1 for j, d in enumerate(self.merged)]
        )
        return -x if self.negate else x


@dataclasses.dataclass(frozen=True)
class Padded:
    """An extra that is a term the program adds to one static rectangular
    block of the scores (``s.at[..., 1:, 1:].add(b)``, MViTv2's relative
    positions skipping the class token): zero outside the block, so the
    scores plus it are what the program computes.  ``apply`` reads the
    term's array (through ``inner``, an `Unsplit` or None, first; ``axes[t]``:
    the axis feeding block axis ``t``, None where broadcast) and pads it to
    ``shape``.  The result varies along an axis the term does, or the block
    does not cover (`carried`); it has size 1 along the others, so a term
    broadcast over a whole axis stays broadcast.  Its axes are not the
    atom's: read whole (never sharded: `flashpass.sharding`)."""

    axes: tuple  # per block axis: the term's axis, or None
    start: tuple  # the block's first index along each score axis
    block: tuple  # the block's shape
    shape: tuple  # the scores' shape
    inner: object = None  # Unsplit | None: applied to the array first
    negate: bool = False  # a subtracted term

    #: Read whole by every device (its axes are not the atom's).
    reads_whole = True
    #: Why a sharded site with such an extra is kept (`flashpass.sharding`).
    sharded_reason = (
        "a bias is added to a block of the scores (it is padded to the scores whole, "
        "not per shard) and the operands are sharded; kept as written"
    )

    def carried(self) -> tuple:
        """Per score axis: whether the result varies along it (else size 1)."""
        sizes = zip(self.axes, self.block, self.shape, strict=True)
        return tuple(a is not None or b != n for a, b, n in sizes)

    def apply(self, x):
        x = jnp.asarray(x) if self.inner is None else self.inner.apply(x)
        x = term_in(x, self.axes, self.block)
        carried = self.carried()
        # A broadcast axis the block covers only in part is zero elsewhere: real.
        x = jnp.broadcast_to(x, [b if c else 1 for b, c in zip(self.block, carried, strict=True)])
        x = -x if self.negate else x
        widths = [
            (s, n - s - b) if c else (0, 0)
            for s, b, n, c in zip(self.start, self.block, self.shape, carried, strict=True)
        ]
        return jnp.pad(x, widths)
