"""``benchmarks/soak.py`` in small: 10 versions with kills, run as a user would run it; the last
line has the documented format and shows no torn pull and no hang."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.hosts import ROOT

LAST_LINE = re.compile(r"^soak: versions=(\d+) pulls=(\d+) torn=(\d+) hangs=(\d+) restarts=(\d+)$")


@pytest.mark.timeout(240)
def test_soak_smoke() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--versions", "10",
                          "--kill-prob", "0.25", "--seed", "3", "--timeout", "30"],
                         capture_output=True, text=True, timeout=220, env=env, cwd=ROOT)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    m = LAST_LINE.match(lines[-1])
    assert m, f"last line {lines[-1]!r} is not the soak line; stderr: {out.stderr[-2000:]}"
    versions, pulls, torn, hangs, restarts = map(int, m.groups())
    assert (versions, torn, hangs) == (10, 0, 0), lines[-2:]
    assert pulls >= 10 and restarts >= 1, lines[-2:]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
