"""Skip markers for tests of what a JAX version makes flashpass decline."""

from __future__ import annotations

import pytest

from flashpass import compat

#: pallas_gpu runs JAX's Triton flash attention on JAX < 0.11.1 only
#: (`compat.TRITON_ATTENTION`); later versions deprecate it and it declines.
requires_triton = pytest.mark.skipif(
    not compat.TRITON_ATTENTION, reason="JAX deprecates the Triton flash attention (0.11.1+)"
)
