"""JAX's persistent compilation cache, as the test suite and CI turn it on.

Executables XLA compiled are written to a folder and read back by any later
process compiling the same program (same JAX, jaxlib, devices and flags), so
the lanes and legs of one CI run share their compilations.  A hit changes no
result, only the time: the executable is XLA's own, serialized.

The options are ``jax.config`` names (``jax_compilation_cache_dir``,
``jax_persistent_cache_min_compile_time_secs``,
``jax_persistent_cache_min_entry_size_bytes``), read from the environment
(``JAX_COMPILATION_CACHE_DIR``...) when JAX is imported; this sets them after
the import too.  An option a JAX release lacks is left alone.
"""

from __future__ import annotations

import jax

#: The cache's options (the same names on JAX 0.9 to 0.12).
CACHE_DIR = "jax_compilation_cache_dir"
MIN_COMPILE_TIME = "jax_persistent_cache_min_compile_time_secs"
MIN_ENTRY_SIZE = "jax_persistent_cache_min_entry_size_bytes"


def compilation_cache(path: str | None, *, min_compile_time: float = 0.0) -> bool:
    """Use ``path`` as the persistent compilation cache, keeping every
    executable that took ``min_compile_time`` seconds or more to compile (0:
    all).  ``path`` empty or None turns nothing on.  Whether it was set."""
    if not path:
        return False
    options = {CACHE_DIR: str(path), MIN_COMPILE_TIME: float(min_compile_time), MIN_ENTRY_SIZE: 0}
    for name, value in options.items():
        if not hasattr(jax.config, name):
            if name == CACHE_DIR:
                return False
            continue
        jax.config.update(name, value)
    return True


def compilation_cache_dir() -> str | None:
    """The persistent compilation cache's folder, None when there is none."""
    return getattr(jax.config, CACHE_DIR, None) or None
