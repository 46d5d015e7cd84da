import os
import pathlib

# The suite runs strict: an internal error of the pass (a crash in the matcher,
# planner or rewriter) re-raises and fails the test instead of becoming a
# fallback.  Tests of the non-strict behaviour say so explicitly.
os.environ.setdefault("FLASHPASS_STRICT", "1")

# JAX's persistent compilation cache, in .jax-cache/ at the checkout's root
# (git-ignored): every pytest process of a run (the 8-device session, the
# mutation check's and the examples' subprocesses, CI's lanes and legs) reads
# back what another compiled.  A hit is XLA's own executable, so no verdict
# depends on it; `JAX_COMPILATION_CACHE_DIR= pytest` runs cold, without it.
ROOT = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from flashpass import compat  # noqa: E402

compat.compilation_cache(
    os.environ["JAX_COMPILATION_CACHE_DIR"],
    min_compile_time=float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)


def pytest_addoption(parser):
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="property tests (tests/fuzz): the 'long' hypothesis profile, ten times the "
        "examples of the default 'ci' profile, random, with the example database",
    )


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The large grids' cases outside their default-set sample are `slow`
    (tests/tiers.py); marked before `-m` selects."""
    import tiers

    tiers.mark(items, pytest.mark.slow)
