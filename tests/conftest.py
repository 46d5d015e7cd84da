import os

# The suite runs strict: an internal error of the pass (a crash in the matcher,
# planner or rewriter) re-raises and fails the test instead of becoming a
# fallback.  Tests of the non-strict behaviour say so explicitly.
os.environ.setdefault("FLASHPASS_STRICT", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


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
