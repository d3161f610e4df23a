#!/usr/bin/env bash
# The GPU path in one run (one CUDA GPU, under 5 minutes): the Publisher/Subscriber runtime on CUDA
# tensors through nixl, nccl, and (host staging) tcp, local and auto, the bf16 cast, the FP8 block
# transform, deltas, packed slots, staged and zero-copy subscribers, vLLM where its CUDA build
# exists, every byte checked against a CPU reference, then the device figures. The parts and what
# only a GPU exercises: wbridge/testing/gpu_check.py.
#
# Runs on a bare GPU machine: with .venv where scripts/setup.sh made one, else the first python3 on
# PATH whose torch sees a CUDA device ($PYTHON overrides both). A part whose package is missing
# there (nixl-cu12, vLLM's CUDA build) prints `gpu_check: SKIP <part>: <why>` and the others run.
# Where no python has torch, or none sees a GPU: one line `gpu_check: SKIP: <why>`, exit 0.
# Usage: scripts/gpu_check.sh [--device cuda:N|cpu] [--parts NAME ...]
set -euo pipefail
cd "$(dirname "$0")/.."

# probe PY: prints "cuda", "nocuda", "notorch <why>" or "nodeps <module>" (wbridge needs numpy)
probe() {
  "$1" - <<'EOF' 2>/dev/null || echo "notorch its interpreter does not run"
import importlib.util
try:
    import torch
except Exception as e:  # noqa: BLE001
    print(f"notorch {type(e).__name__}: {e}")
    raise SystemExit
missing = [m for m in ("numpy",) if importlib.util.find_spec(m) is None]
print(f"nodeps {missing[0]}" if missing else "cuda" if torch.cuda.is_available() else "nocuda")
EOF
}

PY="${PYTHON:-}"
if [ -z "$PY" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if [ -z "$PY" ]; then
  tried=() fallback=""
  for name in python3 python3.13 python3.12 python3.11 python3.10 python; do
    cand=$(command -v "$name" || true)
    [ -n "$cand" ] || continue
    case " ${tried[*]-} " in *" $cand "*) continue ;; esac
    tried+=("$cand")
    state=$(probe "$cand")
    case "$state" in
      cuda) PY=$cand; break ;;
      nocuda | nodeps*) [ -n "$fallback" ] || fallback=$cand ;;
    esac
  done
  PY=${PY:-$fallback}
  if [ -z "$PY" ]; then
    echo "gpu_check: SKIP: no python here has torch (tried: ${tried[*]:-no python3 on PATH}); scripts/setup.sh makes .venv"
    exit 0
  fi
fi
state=$(probe "$PY")
case "$state" in
  notorch*) echo "gpu_check: SKIP: $PY has no torch (${state#notorch }); scripts/setup.sh makes .venv"; exit 0 ;;
  nodeps*) echo "gpu_check: SKIP: $PY has torch but not ${state#nodeps }, which wbridge needs (pip install ${state#nodeps })"; exit 0 ;;
esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout --kill-after=10 280 "$PY" -m wbridge.testing.gpu_check "$@"
