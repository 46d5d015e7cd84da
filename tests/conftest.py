import jax
import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def normal(rng, shape, dtype=np.float32):
    return jax.numpy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
