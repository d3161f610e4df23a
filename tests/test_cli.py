"""The ``wbridge`` command outside a checkout: ``bench`` says in one line that it needs one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(60)
def test_bench_outside_a_checkout_says_so_in_one_line(tmp_path):
    # what a wheel installs: the three packages, no benchmarks/ beside them
    for pkg in ("wbridge", "planner", "transports"):
        shutil.copytree(os.path.join(ROOT, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "wbridge.cli", "bench", "update", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a source checkout" in lines[0] and "update_e2e.py" in lines[0], lines


@pytest.mark.timeout(60)
def test_bench_help_is_the_benchmarks_own():
    proc = subprocess.run(
        [sys.executable, "-m", "wbridge.cli", "bench", "plan", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    assert "plan_scale" in proc.stdout and "{transport,update" not in proc.stdout, proc.stdout[:400]
