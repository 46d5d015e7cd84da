#!/usr/bin/env bash
# The JAX version matrix's third leg: the newest supported JAX (the top of the
# range in pyproject.toml, pinned in ci/constraints-newest.txt), in a virtual
# environment of its own on Python 3.12 (JAX 0.11+ wheels need it); the main
# suite runs on the versions in constraints.txt.
#
#   ci/newest_jax.sh            # from the repository root or anywhere
#
# Python 3.12 is `python3.12` on PATH, else the newest 3.12.x that pyenv
# manages (PYENV_VERSION=3.12.x python3.12).  With neither, the leg says so and
# is skipped (exit status 0).  No model libraries are installed (but flax, which
# the gpu extra's tokamax brings): it runs the core tests, the golden jaxprs, the
# compat self-test, the kernel conformance tests (Pallas in interpret mode) and
# the tokamax adapter's tests (tokamax's XLA implementations on CPU), these three
# with JAX's DeprecationWarnings as errors, the model-free integration tests
# (kernels end to end, lowering, jax.nn.dot_product_attention), training steps,
# the 8-device sharding tests (rings) and flashpass.export (lift and splice routes;
# about 2 minutes of the leg's 11).  Of the ring-step numerics
# (tests/kernels/test_ring_steps.py) it runs each kernel's causal float32 case,
# which exercises the private backward entry points compat wraps; the other
# cases run on the pinned versions (interpret mode is slower on the newest JAX).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.ci-venv-newest

python312=()
if python3.12 -c 'import sys' >/dev/null 2>&1; then
    python312=(python3.12)
elif command -v pyenv >/dev/null 2>&1; then
    version=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1 || true)
    if [ -n "$version" ] && PYENV_VERSION="$version" python3.12 -c 'import sys' >/dev/null 2>&1; then
        python312=(env PYENV_VERSION="$version" python3.12)
    fi
fi
if [ ${#python312[@]} -eq 0 ]; then
    echo "newest-JAX leg: SKIPPED, no Python 3.12 found (neither python3.12 on PATH nor"
    echo "a 3.12.x under pyenv); JAX 0.11+ needs Python 3.12, so the newest JAX is untested."
    exit 0
fi

"${python312[@]}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# No [test] extra: the model libraries are tested on constraints.txt only.
# The gpu extra (tokamax): the tokamax adapter joins the GPU order on this JAX, and
# tests/kernels/test_tokamax.py and the conformance suite run it through tokamax's
# XLA implementations on CPU (about 20 s to install, 30 s of tests).
"$venv/bin/python" -m pip install --quiet -e ".[gpu]" pytest hypothesis -c ci/constraints-newest.txt
"$venv/bin/python" -c 'import sys, jax; print("newest-JAX leg: jax", jax.__version__, "on Python", sys.version.split()[0])'
# JAX's deprecations are errors for flashpass's imports and its kernels' tracing
# (the compat self-test and every kernel's conformance cases; pallas_gpu, whose
# Triton kernel JAX deprecates, declines every site from JAX 0.11.1 on).
"$venv/bin/python" -W error::DeprecationWarning -c \
    'import flashpass, flashpass.kernels; assert flashpass.compat.tokamax_module()'
FLASHPASS_HYPOTHESIS_PROFILE=quick "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    -W error::DeprecationWarning \
    tests/test_compat.py tests/kernels/test_conformance.py tests/kernels/test_tokamax.py
FLASHPASS_HYPOTHESIS_PROFILE=quick "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_matching.py tests/test_negative.py tests/test_api.py tests/test_bad_input.py \
    tests/test_golden.py \
    tests/kernels --ignore=tests/kernels/test_conformance.py --ignore=tests/kernels/test_tokamax.py \
    tests/test_kernel_integration.py tests/test_lowering.py \
    tests/models/test_jax_nn.py tests/test_training.py tests/sharding/test_session.py \
    tests/export \
    -k "not every_spelling and not (merge_to_the_reference and not causal-float32)"
