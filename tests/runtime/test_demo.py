"""``wbridge demo`` passes with a quiet log (``tests.logs``), and its bit-exact check fails when one
read is corrupted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.logs import noise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def demo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "wbridge.cli", "demo", "--tiny", "--versions", "2", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_passes_and_its_check_can_fail() -> None:
    ok = demo()
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "demo: OK, every pull bit-exact" in ok.stderr
    assert not noise(ok.stderr), noise(ok.stderr)
    rows = [line for line in ok.stdout.splitlines() if line.strip().endswith("yes")]
    assert len(rows) == 4, ok.stdout  # 2 versions x 2 rollouts
    bad = demo("--inject-fault", "flip-bit")
    assert bad.returncode == 1, bad.stderr[-3000:]
    assert "NOT bit-exact" in bad.stderr and "demo: FAILED" in bad.stderr
