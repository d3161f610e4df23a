#!/usr/bin/env bash
# Quick start 2: set up, then run the test suite (GPU-only tests skip where no GPU exists).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
exit $rc
