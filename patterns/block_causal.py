"""Causal between blocks of positions, bidirectional within one, as `BlockCausal`.

``i // b >= j // b`` on the query and key positions (block diffusion language
models, frame-causal video), however it is spelled: read by value from the
folded constant mask, which must equal the op at every index, with at least
two query blocks and a block of at least two keys (a block of one is
`Causal`, one block of queries a key mask).  Anything else is left to the
other readings, or a dense `Mask`.
"""

from __future__ import annotations

import numpy as np

from flashpass.ops.block_causal import BlockCausal

from .common import folded_matrix, query_key_axes
from .masks import mask_recogniser


@mask_recogniser(rank=80)
def recognise_block_causal(build, factor, keep_when, fill) -> bool:
    """``i // b >= j // b`` with a static ``b``, by value."""
    axes = query_key_axes(build, factor, fill)
    if axes is None or not keep_when:
        return False
    keep = folded_matrix(build.scope, factor, axes)
    size = None if keep is None else block_size(keep.astype(bool))
    if size is None:
        return False
    return build.add_descriptor(BlockCausal(size, fill), factor, keep_when, fill)


def block_size(keep: np.ndarray) -> int | None:
    """``b`` if ``keep[i, j] == (j // b <= i // b)`` for every ``i``, ``j``, with
    ``2 <= b < T`` and ``b < S``; else None."""
    t_len, s_len = keep.shape
    size = int(keep[0].sum())
    if not (2 <= size < t_len and size < s_len):
        return None
    i, j = np.arange(t_len)[:, None], np.arange(s_len)[None, :]
    return size if np.array_equal(keep, j // size <= i // size) else None
