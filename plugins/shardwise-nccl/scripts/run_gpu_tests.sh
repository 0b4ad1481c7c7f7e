#!/usr/bin/env bash
# GPU checks for shardwise-nccl, for a machine with a CUDA GPU.
#
# Installs nothing from the network. It expects a CUDA build of torch, pluggy
# and pytest already installed in $PYTHON's environment; shardwise and
# shardwise-nccl are used as installed, or installed from this checkout with
# `pip install --no-deps --no-build-isolation -e` when missing.
#
#   plugins/shardwise-nccl/scripts/run_gpu_tests.sh            # 1 rank
#   NPROC=4 plugins/shardwise-nccl/scripts/run_gpu_tests.sh    # 4 ranks, one GPU each
#
# Environment: PYTHON (default python3), NPROC (ranks for the smoke program,
# default 1, at most the number of GPUs), PYTEST_ARGS (extra pytest options).
set -euo pipefail

scripts="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
plugin="$(dirname "$scripts")"
repo="$(cd "$plugin/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-1}"

step() { printf '\n== %s\n' "$*"; }

step "torch and CUDA"
"$PYTHON" - <<'PY'
import sys

import torch
import torch.distributed as dist

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL available: {dist.is_nccl_available()}")
if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit("error: no usable CUDA device (a CPU-only torch build, or no GPU visible); run this on a GPU machine")
if not dist.is_nccl_available():
    sys.exit("error: this torch build has no NCCL")
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}  {torch.cuda.get_device_name(i)}")
PY

step "shardwise and shardwise-nccl"
for module in pluggy pytest; do
    "$PYTHON" -c "import $module" 2>/dev/null || { echo "error: $module is not installed for $PYTHON" >&2; exit 1; }
done
if ! "$PYTHON" -c 'import importlib.metadata as m; m.version("shardwise"); m.version("shardwise-nccl")' 2>/dev/null; then
    echo "installing shardwise and shardwise-nccl from $repo (editable, no dependencies)"
    "$PYTHON" -m pip install --no-deps --no-build-isolation \
        -e "$repo/packages/shardwise" -e "$plugin"
fi
"$PYTHON" -m shardwise info

step "plugin tests (plugins/shardwise-nccl/tests)"
pytest_args=(-q -p no:cacheprovider -rs)
if "$PYTHON" -c 'import pytest_timeout' 2>/dev/null; then
    pytest_args+=(--timeout=300)
fi
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of options
"$PYTHON" -m pytest "${pytest_args[@]}" ${PYTEST_ARGS:-} "$plugin/tests"

step "torchrun smoke program, $NPROC rank(s)"
if command -v timeout >/dev/null; then
    run_with_timeout=(timeout --kill-after=30 600)
else
    run_with_timeout=()
fi
"${run_with_timeout[@]}" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    "$scripts/nccl_smoke.py"

step "all GPU checks passed"
