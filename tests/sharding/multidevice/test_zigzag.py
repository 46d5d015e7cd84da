"""The zig-zag layout of a load-balanced causal ring (flashpass/ring/zigzag.py), 8 CPU devices.

The site moves each half-block of q, k and v to its zig-zag device and the
output back; here the moves themselves: device ``j`` must hold chunks ``j``
and ``2n - 1 - j`` of the sequence, and the way back must be the identity.
"""

import jax
import numpy as np
import pytest
from sharded_testing import P, mesh, put

from flashpass.ring import zigzag

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see conftest)")


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_moves_give_each_device_its_zigzag_chunks_and_back(n):
    m = mesh((n,), ("seq",))
    c = 3  # rows per chunk: 2n chunks in all
    positions = np.arange(2 * n * c, dtype=np.int32).reshape(1, 1, -1, 1)
    x = put(m, P(None, None, "seq"), positions)
    moves = zigzag._Moves("seq", n)
    spec = P(None, None, "seq")

    def there(x):
        return moves.to_zigzag(x)

    def round_trip(x):
        return moves.from_zigzag(moves.to_zigzag(x))

    mapped = [
        jax.jit(jax.shard_map(f, mesh=m, in_specs=spec, out_specs=spec))
        for f in (there, round_trip)
    ]
    zig, back = (np.asarray(f(x)).reshape(n, 2 * c) for f in mapped)
    for j in range(n):
        want = np.concatenate(
            [np.arange(j * c, (j + 1) * c), np.arange((2 * n - 1 - j) * c, (2 * n - j) * c)]
        )
        np.testing.assert_array_equal(zig[j], want)
    np.testing.assert_array_equal(back.reshape(-1), positions.reshape(-1))


def test_critical_path_halves():
    """The slowest device's score blocks over a causal ring: ``n - 1/2`` in
    the contiguous order, ``n / 2`` balanced."""
    assert zigzag.critical_path(8, zigzag=False) == 7.5
    assert zigzag.critical_path(8, zigzag=True) == 4.0
    assert zigzag.critical_path(2, zigzag=True) == 1.0
