"""`Dropout`: the program's own dropout on the softmax's output."""

from __future__ import annotations

import dataclasses

import numpy as np

from .base import ScoreOp


@dataclasses.dataclass(frozen=True)
class Dropout(ScoreOp):
    """Dropout on the *probabilities*, exactly as ``jax.random.bernoulli`` drew it.

    Not a score op: the spec's op on the probabilities (``spec.dropout``), it
    applies to the softmax output ``p``::

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

    uniform = True
    stage = "probabilities"

    @property
    def size(self) -> int:
        """Elements of the program's keep-mask."""
        return int(np.prod(self.mask_shape, dtype=np.int64))

    def extras_read(self):
        return (self.index,)

    def at_offset(self, d, t, s):
        return "dropout (its keep-mask is drawn at global positions)"
