#!/usr/bin/env bash
# Quick start 1: set up, then run the local publish/pull demo (4 trainers, 2 rollouts, a 472 MiB model:
# each rollout pulls its 236 MiB half of every version).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --core  # the demo needs .venv only (scripts/test.sh sets up the rest)
exec .venv/bin/wbridge demo "$@"
