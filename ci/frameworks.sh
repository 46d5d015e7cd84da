#!/usr/bin/env bash
# The frameworks legs (steps of every .ci/run): the model tests that need PyTorch
# or MaxText, each in a virtual environment of its own.
#
#   ci/frameworks.sh            # every part
#   ci/frameworks.sh torchax    # PyTorch through torchax (Python 3.11)
#   ci/frameworks.sh zoo_torch  # the zoo's hf_torch and timm samples (transformers 5)
#   ci/frameworks.sh torch      # both PyTorch legs, one after the other (CI's step)
#   ci/frameworks.sh maxtext    # MaxText's own attention (Python 3.12, newest JAX)
#
# Why venvs of their own: the only torch that torchax 0.0.13 imports with is 2.12,
# whose registry build is the CUDA one (it runs on the CPU); MaxText needs
# Python 3.12 and the newest JAX. Without them the test modules skip
# (pytest.importorskip), so each leg first checks that its libraries import: a
# leg whose tests would all skip fails instead. Times: ci/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=("${@:-torchax zoo_torch maxtext}")
[ "${parts[*]}" != torch ] || parts=(torchax zoo_torch)
# shellcheck disable=SC2206
parts=(${parts[*]})

# Both PyTorch legs share one venv: torch 2.12's registry build is the CUDA one
# (about 5.6 GB installed), and two copies of it, with pip's cache of the
# download, once filled a CI machine's disk. pip keeps no cache here (a fresh
# CI machine would never read it back); a venv left from an earlier run is
# reused as it is. Each leg installs the versions it was written for, so either
# runs first: the torchax leg the main constraints' transformers 4.57, the zoo
# leg transformers 5 and timm 1.0 (its expected results were swept with them).
torch_venv=.ci-venv-torch

# `need_disk GB`: fail, saying so, when the checkout's disk has less than GB free.
need_disk() {
    local free_kb
    free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
    echo "free disk: $((free_kb / 1024 / 1024)) GB (this leg needs about $1 GB)"
    if [ "$free_kb" -lt $(($1 * 1024 * 1024)) ]; then
        echo "frameworks leg: FAILED, less than $1 GB free for torch's CUDA build"
        return 1
    fi
}

make_torch_venv() {
    if "$torch_venv/bin/python" -c 'import torch, torchax' >/dev/null 2>&1; then
        return 0
    fi
    need_disk 7 || return 1
    python3 -m venv "$torch_venv"
    "$torch_venv/bin/python" -m pip install --quiet --no-cache-dir --upgrade pip
    "$torch_venv/bin/python" -m pip install --quiet --no-cache-dir "torch==2.12.*" \
        "torchax==0.0.13" -c constraints.txt
}

torchax_leg() {
    make_torch_venv || return 1
    "$torch_venv/bin/python" -m pip install --quiet --no-cache-dir -e ".[test]" "torch==2.12.*" \
        "torchax==0.0.13" "diffusers==0.35.*" -c constraints.txt
    "$torch_venv/bin/python" -m pip install --quiet --no-cache-dir --no-deps -r ci/no-deps.txt
    "$torch_venv/bin/python" -c 'import torch, torchax, diffusers; print("torchax leg: torch", torch.__version__)'
    "$torch_venv/bin/python" -m pytest -q -p no:cacheprovider \
        tests/models/test_torchax_models.py tests/test_torch_layouts.py tests/export/test_fixtures.py
}

# The zoo's PyTorch suites (hf_torch, timm). transformers 5 brings the Hub's
# `kernels` package, whose name the repository's own kernels/ folder shadows
# when run from the root: it is removed.
zoo_torch_leg() {
    make_torch_venv || return 1
    "$torch_venv/bin/python" -m pip install --quiet --no-cache-dir -e . pytest optax \
        "torch==2.12.*" "torchax==0.0.13" "timm==1.0.*" "transformers==5.*" \
        -c <(grep -vE '^(transformers|huggingface-hub|tokenizers|safetensors|keras-hub|keras)==' \
            constraints.txt)
    "$torch_venv/bin/python" -m pip uninstall --quiet -y kernels || true
    "$torch_venv/bin/python" -c 'import torch, torchax, timm, transformers; print("zoo leg: transformers", transformers.__version__)'
    "$torch_venv/bin/python" -m pytest -q -p no:cacheprovider -m slow tests/zoo -k "hf_torch or timm"
}

maxtext_leg() {
    local venv=.ci-venv-maxtext version
    version=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1 || true)
    if ! PYENV_VERSION="$version" python3.12 -c 'import sys' >/dev/null 2>&1; then
        echo "frameworks leg, maxtext: SKIPPED, no Python 3.12 (MaxText needs it)"
        return 0
    fi
    PYENV_VERSION="$version" python3.12 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # MaxText's wheel declares no dependencies; these are what importing its
    # AttentionOp and pyconfig needs.
    "$venv/bin/python" -m pip install --quiet -e . pytest hypothesis "maxtext==0.2.5" flax aqtp \
        tokamax chex omegaconf pydantic jaxtyping optax qwix absl-py pathwaysutils jinja2 \
        -c ci/constraints-newest.txt
    "$venv/bin/python" -c 'import maxtext, jax; print("maxtext leg: jax", jax.__version__)'
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/models/test_maxtext.py
}

status=0
for part in "${parts[@]}"; do
    echo "+ frameworks leg: $part"
    "${part}_leg" || status=1
done
exit "$status"
