"""The matcher: program → sites, one module per piece of the attention pattern.

The engine calls one entry point, `match_scopes`: every scope's attention
sites, paired with their backward where the program is differentiated, and
the near misses.  ``match`` finds the sites of a scope, ``builder`` assembles a
site's score ops from its recognised steps, ``backward`` proves a site's
backward in its own scope and ``scans`` in a remat body or a loop's backward
loop; the piece modules (``chain``, ``masks``, ``softmax``...) read the parts.
Helpers shared between the modules are public in ``common``.
"""

from .match import match_scopes
from .softmax_like import SoftmaxLike

__all__ = ["SoftmaxLike", "match_scopes"]
