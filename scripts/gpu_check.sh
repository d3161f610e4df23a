#!/usr/bin/env bash
# The GPU path in one run (one CUDA GPU, under 5 minutes, set up by scripts/setup.sh): the
# Publisher/Subscriber runtime on CUDA tensors through nixl, nccl, and (host staging) tcp, local and
# auto, the bf16 cast, the FP8 block transform, deltas, packed slots, staged and zero-copy
# subscribers, vLLM where its CUDA build exists, every byte checked against a CPU reference, then
# the device figures. The parts and
# what only a GPU exercises: wbridge/testing/gpu_check.py. Prints `gpu_check: SKIP: <why>` and exits
# 0 where no GPU exists. Usage: scripts/gpu_check.sh [--device cuda:N|cpu] [--parts NAME ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout --kill-after=10 280 "$PY" -m wbridge.testing.gpu_check "$@"
