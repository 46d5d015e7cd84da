"""A convolution over the scores: read only to say why the site is kept.

EfficientFormerV2 (and other "talking-heads" vision blocks) pass the scores
``[B, H, T, S]`` through a 1x1 convolution whose channels are the heads, and
some blocks a depthwise k x k one: each score then mixes the scores of other
heads, or of neighbouring queries and keys.  A softmax row reads scores from
outside its own ``q_t · k`` row, which no attention kernel computes; the site
is kept, and its reason says so rather than naming an unknown operation.
"""

from __future__ import annotations

import math

from .chain import rule
from .common import Miss, where


@rule("conv_general_dilated")
def _conv(scope, node, out):
    rhs_shape = scope.shape(node.ins[1])
    dn = node.params["dimension_numbers"]
    spatial = [rhs_shape[a] for a in dn.rhs_spec[2:]]
    groups = node.params.get("feature_group_count", 1)
    channels_in = scope.shape(node.ins[0])[dn.lhs_spec[1]]
    if math.prod(spatial) == 1 and groups == channels_in:
        # One weight per channel: a scale, not a mixing; not read (yet).
        return Miss(f"a per-channel 1x1 convolution of the scores{where(node)}", node)
    what = "heads" if math.prod(spatial) == 1 else "neighbouring queries and keys"
    return Miss(
        f"a convolution over the scores mixes the scores of other {what} into each one "
        "before the softmax (talking-heads attention), so each softmax row reads scores "
        "outside its own query's: a kernel computes that only on the mixed queries' and keys' "
        f"copies side by side, which the pass does not build{where(node)}; kept as written",
        node,
    )
