"""The ``wbridge`` command outside a checkout: the benchmark scripts say in one line that they need one;
the two-host benchmarks, part of the package, run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _installed(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``wbridge`` run as a wheel installs it: the three packages, no benchmarks/ beside them."""
    for pkg in ("wbridge", "planner", "transports"):
        if not (tmp_path / pkg).exists():
            shutil.copytree(os.path.join(ROOT, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    argv = [sys.executable, "-m", "wbridge.cli", *args]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(60)
def test_bench_outside_a_checkout_says_so_in_one_line(tmp_path):
    proc = _installed(tmp_path, "bench", "update", "--versions", "1")
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a source checkout" in lines[0] and "update_e2e.py" in lines[0], lines


@pytest.mark.timeout(60)
def test_the_two_host_benchmarks_need_no_checkout(tmp_path):
    """``bench transport`` and ``bench update --serve/--connect`` are part of the package: their help
    shows outside a checkout, and ``bench update``'s says what it runs without --serve/--connect."""
    update = _installed(tmp_path, "bench", "update", "--help")
    assert update.returncode == 0, update.stderr
    assert "--serve" in update.stdout and "--connect HOST:PORT" in update.stdout and "update_e2e.py" in update.stdout
    transport = _installed(tmp_path, "bench", "transport", "--help")
    assert transport.returncode == 0 and "--connect HOST:PORT" in transport.stdout, transport.stderr


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
