import jax
import numpy as np
import pytest


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


def normal(rng, shape, dtype=np.float32):
    return jax.numpy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
