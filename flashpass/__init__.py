"""flashpass: rewrite every attention site in a JAX function to a flash-attention kernel.

@flashpass.optimize
def model(params, tokens): ...

print(model.explain(params, tokens))   # what was rewritten, and why not
"""

from .api import Optimized, explain, optimize
from .report import Fallback, Report, Rewrite, Unrecognised

__version__ = "0.1.0"


def __getattr__(name):
    """``flashpass.export`` on first use: its machinery (the StableHLO lifter)
    is imported only then, not by ``import flashpass``."""
    if name == "export":
        import importlib

        return importlib.import_module(".export", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Fallback",
    "Optimized",
    "Report",
    "Rewrite",
    "Unrecognised",
    "explain",
    "export",
    "optimize",
    "__version__",
]
