"""tests/sharding runs on 8 simulated CPU devices, in a pytest session of its own.

XLA reads ``--xla_force_host_platform_device_count`` once, before JAX starts,
so the multi-device tests (``multidevice/``) cannot share the main session's
single device.  In the main session only ``test_session.py`` is collected: it
runs ``pytest tests/sharding`` in a subprocess with the flag set, where the
multi-device tests are collected instead.  To run them directly::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        pytest tests/sharding
"""

import os

DEVICE_FLAG = "--xla_force_host_platform_device_count"
IN_SESSION = DEVICE_FLAG in os.environ.get("XLA_FLAGS", "")

collect_ignore = ["test_session.py", "test_multiprocess.py"] if IN_SESSION else ["multidevice"]
