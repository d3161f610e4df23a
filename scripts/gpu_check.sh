#!/usr/bin/env bash
# GPU path check (one CUDA GPU, torch, nixl-cu12): CUDA tensors as publisher and subscriber memory
# through nixl (VRAM), bit-exact reads, bandwidth against torch's device copy. Skips with a clear
# message where no GPU exists. Bounded to under 5 minutes. Usage: scripts/gpu_check.sh [--size BYTES]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout --kill-after=10 280 "$PY" scripts/gpu_check.py "$@"
