#!/usr/bin/env bash
# The whole GPU check on a bare GPU machine: its python3 (with a CUDA torch), no network.
# Installs the wheels carried in .whl/ (`make gpu-wheels` here) into /tmp/site, then runs
# `python3 -m benchmarks.gpu_check --require-cuda` (results: $OUT/gpu_check.json).
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! python3 -c "import pydantic, xxhash, fsspec" 2>/dev/null; then
    echo "gpu_check_device: a dependency of resumekit is missing on this machine;" \
         "run 'make gpu-wheels' where pip works and carry .whl" >&2
    exit 3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 -m benchmarks.gpu_check --require-cuda "$@"
