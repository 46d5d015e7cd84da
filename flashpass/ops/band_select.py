"""`BandSelect`: a mask that reads a different key mask on each band of diagonals."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .base import KeepOp, with_shape


@dataclasses.dataclass(frozen=True)
class BandSelect(KeepOp):
    """``s = where(masks[band(j - i)][j], s, fill)``.

    The diagonals ``d = j - i`` are cut at ``offsets`` (increasing) into
    bands ``(-inf, o_0], (o_0, o_1], ..., (o_last, inf)``; band ``b`` keeps the
    keys ``extras[indices[b]]`` keeps, a ``[B|1, H|1, 1, S]`` boolean.  A mask
    computed elementwise from key-side data (a padding vector) and positional
    patterns that depend on ``j - i`` only (causal, a sliding window) is one
    (`patterns.band_select` proves it and builds each band's key mask):
    keras-hub's ``minimum(int(padding)[:, None], int(causal))`` is the bands
    ``d <= 0`` (``padding != 0``) and ``d > 0`` (``padding < 0``): an int
    padding input need not hold only 0 and 1, and this reads it exactly.
    O(B·S) data per band, never ``T x S``.
    """

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    fill: float

    descriptors_doc = {
        "band_select": "a key mask per band of diagonals "
        "(`where(j - i <= d, a[j], b[j])`: int padding merged with causal or window masks)"
    }
    word = "band-select"
    reason_words = "a key mask per band of diagonals"

    def extras_read(self):
        return tuple(dict.fromkeys(self.indices))

    def keep(self, qi, kj, extras, kv_len=None):
        d = kj - qi
        keep = extras[self.indices[-1]]
        for offset, index in zip(self.offsets[::-1], self.indices[-2::-1], strict=True):
            keep = jnp.where(d <= offset, extras[index], keep)
        return keep

    def at_offset(self, d, t, s):
        return "masks choosing between key masks by diagonals depend on the device's position"

    def localized(self, shape4):
        return with_shape(self, shape4)
