"""Hypothesis profiles for the property tests.

* ``ci``: derandomized (the same examples on every run, so CI is
  reproducible), no deadline, no example database.  The property tests scale
  their example counts from ``max_examples`` (about 670 examples in all, a
  few minutes on two CPU cores).  CI's ``default-fuzz`` step runs it.
* ``default`` (a plain ``pytest``, the README's command): ``ci`` with 40
  examples where it has 100 (about 270), so the README's test command stays
  within its time.
* ``long``: ten times the examples, random, with the example database — for a
  nightly run or after touching the matcher.
* ``quick``: about 100 examples, derandomized — for the oldest-JAX leg of the
  version matrix (ci/oldest_jax.sh), which checks compatibility, not coverage.

Select a profile with ``python -m pytest --long`` (tests/conftest.py defines
the option), with ``FLASHPASS_HYPOTHESIS_PROFILE=long`` (any profile), or with
``pytest tests/fuzz --hypothesis-profile=long`` (hypothesis's own option: it
needs the profiles registered before pytest configures hypothesis, which
happens only when ``tests/fuzz`` is named on the command line).
"""

import os

from hypothesis import HealthCheck, settings

PROFILE_VARIABLE = "FLASHPASS_HYPOTHESIS_PROFILE"

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=1000, derandomize=False, **_COMMON)
settings.register_profile("quick", max_examples=15, derandomize=True, database=None, **_COMMON)
settings.register_profile("readme", max_examples=40, derandomize=True, database=None, **_COMMON)


def pytest_configure(config):
    """Load the requested profile (this hook also runs when the conftest is
    registered late, before the test modules read ``max_examples``)."""
    requested = os.environ.get(PROFILE_VARIABLE)
    if config.getoption("long", default=False):
        requested = "long"
    if requested:
        settings.load_profile(requested)
    elif settings.get_current_profile_name() == "default":
        settings.load_profile("readme")
