#!/usr/bin/env bash
# Quick start 2: set up, then run the test suite (GPU-only tests skip where no GPU exists).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --fast: the inner-loop tier (under 2 minutes here): every module, without the tests marked slow
# (real vLLM engines, Mooncake's open/close cycles, multi-process model training, benchmark runs).
# Tests run on 6 pytest-xdist workers: most slow tests wait (leases, timeouts, restarts), so 6
# overlap well even on 2 cores; the CPU-bound ones (marked heavy) run two at a time (tests/conftest.py).
# Later arguments win: `scripts/test.sh -n 0` runs everything in one process, for debugging.
args=(-n 6)
# The suite starts hundreds of Python processes; with PYTHONDONTWRITEBYTECODE set (many CI images
# set it) each compiles wbridge, the tests and the benchmarks again: tests/runtime took 131.7
# CPU-seconds so, 120.8 with bytecode caches (__pycache__, ignored by git).
unset PYTHONDONTWRITEBYTECODE
for a in "$@"; do
  if [ "$a" = "--fast" ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "${args[@]}"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
exit $rc
