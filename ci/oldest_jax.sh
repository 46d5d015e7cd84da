#!/usr/bin/env bash
# The JAX version matrix's second leg: the oldest supported JAX (the lower bounds
# in pyproject.toml, pinned in ci/constraints-oldest.txt), in a virtual
# environment of its own; the main suite runs on the versions in constraints.txt.
#
#   ci/oldest_jax.sh            # from the repository root or anywhere
#
# Runs the core tests (matching, near misses, API, bad input), the golden jaxprs,
# the compat self-test and the property tests on the `quick` hypothesis profile:
# about two minutes.  The kernel-conformance and model-free integration tests run
# on the newest JAX (ci/newest_jax.sh) and the pinned versions; the sharding,
# model and benchmark tests on the pinned versions only.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.ci-venv-oldest
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# No [test] extra: the model libraries it pulls in need a newer JAX.
"$venv/bin/python" -m pip install --quiet -e . pytest hypothesis -c ci/constraints-oldest.txt
"$venv/bin/python" -c 'import jax; print("oldest-JAX leg: jax", jax.__version__)'
FLASHPASS_HYPOTHESIS_PROFILE=quick "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_matching.py tests/test_negative.py tests/test_api.py tests/test_bad_input.py \
    tests/test_golden.py tests/test_compat.py tests/fuzz \
    tests/test_training.py -k "not every_spelling"
