"""flashpass: rewrite every attention site in a JAX function to a flash-attention kernel.

@flashpass.optimize
def model(params, tokens): ...

print(model.explain(params, tokens))   # what was rewritten, and why not
"""

from .api import Optimized, explain, optimize
from .report import Fallback, Report, Rewrite, Unrecognised

__version__ = "0.1.0"

__all__ = [
    "Fallback",
    "Optimized",
    "Report",
    "Rewrite",
    "Unrecognised",
    "explain",
    "optimize",
    "__version__",
]
