"""Find T×S arrays in compiled HLO text."""

from __future__ import annotations

import re

_SHAPE = re.compile(r"\b(?:f|bf|s|u|pred)\d*\[([\d,]+)\]")


def txs_shapes(hlo_text: str, t: int, s: int) -> set[str]:
    """Shapes in ``hlo_text`` with a T dimension next to an S dimension."""
    found = set()
    for match in _SHAPE.finditer(hlo_text):
        dims = [int(d) for d in match.group(1).split(",") if d]
        for a, b in zip(dims, dims[1:], strict=False):
            if (a, b) in ((t, s), (s, t)):
                found.add(match.group(0))
    return found
