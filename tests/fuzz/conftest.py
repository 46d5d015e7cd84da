"""Hypothesis profiles for the property tests.

* ``ci`` (the default): derandomized (the same examples on every run, so CI is
  reproducible), no deadline, no example database.  The property tests scale
  their example counts from ``max_examples`` (about 650 examples in all).
* ``long``: ten times the examples, random, with the example database — for a
  nightly run or after touching the matcher.

Select ``long`` with ``FLASHPASS_HYPOTHESIS_PROFILE=long`` or with
``pytest tests/fuzz --hypothesis-profile=long`` (that option needs the
profiles registered before pytest configures hypothesis, which happens when
``tests/fuzz`` is named on the command line; the environment variable works
for any invocation).
"""

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=1000, derandomize=False, **_COMMON)

_requested = os.environ.get("FLASHPASS_HYPOTHESIS_PROFILE")
if _requested:
    settings.load_profile(_requested)
elif settings.get_current_profile_name() == "default":
    settings.load_profile("ci")
