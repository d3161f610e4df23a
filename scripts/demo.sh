#!/usr/bin/env bash
# Quick start 1: set up, then run the local publish/pull demo (4 trainers, 2 rollouts, ~512 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/wbridge demo "$@"
