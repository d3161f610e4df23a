"""Smoke test of the end-to-end benchmarks: each runs at a tiny size in real processes (6 of them,
real store, real transports, gloo baselines) and must end with its summary line.

Each run checks every pull bit for bit inside the benchmark and exits non-zero on a mismatch, so a
zero exit status plus the last line is the whole contract checked here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RATIO = r"(?:[0-9]+\.[0-9]{2}|inf|n/a)"


def run_benchmark(script: str, *args: str, timeout: float, pid: list[int] | None = None) -> list[str]:
    """Runs ``benchmarks/<script> --quiet *args``; returns its stdout lines (appends its pid to ``pid``)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    with subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quiet", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        if pid is not None:
            pid.append(proc.pid)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            raise AssertionError(f"{script} ran past {timeout}s:\n{stdout}\n{stderr[-4000:]}") from None
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{stdout}\n{stderr[-4000:]}"
    lines = stdout.strip().splitlines()
    assert lines, f"{script} printed nothing; stderr:\n{stderr[-2000:]}"
    return lines


@pytest.mark.slow
@pytest.mark.timeout(320)  # 37 s alone; 150 s beside the suite's engines
def test_update_e2e_tiny_prints_summary_line(tmp_path) -> None:
    committed = os.path.join(ROOT, "benchmarks", "results", "update_e2e.json")
    before = os.stat(committed).st_mtime_ns if os.path.exists(committed) else None
    lines = run_benchmark(
        "update_e2e.py",
        "--model",
        "tiny",
        "--versions",
        "1",
        "--warmup",
        "1",
        "--staged",
        "none",
        "--no-baseline-b",
        "--bench-repeat",
        "1",
        "--timeout",
        "60",
        "--json",
        "--out",
        str(tmp_path),
        timeout=300,
    )
    # results go where --out says, never over the committed ones
    assert (tmp_path / "update_e2e.json").exists()
    assert (os.stat(committed).st_mtime_ns if os.path.exists(committed) else None) == before
    last = lines[-1]
    assert re.fullmatch(
        rf"update_e2e: local_vs_gather_bcast={RATIO} tcp_vs_gather_bcast={RATIO} "
        rf"efficiency={RATIO} rss_ratio={RATIO}",
        last,
    ), last
    # the table names every method that ran, each with a finite time
    table = "\n".join(lines)
    for method in ("wbridge-tcp", "wbridge-local", "gather-bcast"):
        assert re.search(rf"^\s*{method}\s+[0-9.]+\s", table, re.M), table


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_stall_tiny_prints_summary_line() -> None:
    lines = run_benchmark(
        "stall.py",
        "--model",
        "tiny",
        "--steps",
        "2",
        "--train-s",
        "0.2",
        "--gen-s",
        "0.2",
        "--timeout",
        "60",
        timeout=140,
    )
    last = lines[-1]
    assert re.fullmatch(
        rf"stall: async_vs_baseline={RATIO} one_step_off_vs_baseline={RATIO} "
        rf"sync_vs_baseline={RATIO}",
        last,
    ), last
    assert re.fullmatch(
        rf"stall_pack: pack_vs_plain={RATIO} plain_ms=[0-9.]+ packed_ms=[0-9.]+ rollout_tp=4 cells=[0-9]+", lines[-2]
    ), lines[-2]
    for mode in ("gather-bcast", "sync", "one_step_off", "async"):
        assert re.search(rf"^\s*{mode}\s+[0-9.]+\s", "\n".join(lines), re.M), lines


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_pack_copy_prints_summary_line() -> None:
    lines = run_benchmark("pack_copy.py", "--repeat", "1", timeout=140)
    assert re.fullmatch(rf"pack_copy: packed_vs_plain={RATIO}", lines[-1]), lines[-1]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_control_plane_tiny_prints_summary_lines() -> None:
    lines = run_benchmark(
        "control_plane.py",
        "--publishers",
        "2",
        "--subscribers",
        "4",
        "--procs",
        "2",
        "--versions",
        "3",
        "--warmup",
        "1",
        "--gc-publishers",
        "2",
        "--gc-versions",
        "200",  # the format and a bounded count; the full run (1000 versions, both stores) is the figure
        "--churn-every",
        "100",
        "--stores",
        "tcp",
        timeout=190,
    )
    num = r"[0-9]+(?:\.[0-9]+)?"
    m = re.fullmatch(
        rf"control_plane: store=tcp P=2 S=4 requests_per_version={num} per_party={num} "
        rf"publish_ms={num} keys_after_10=([0-9]+) keys_after_200=([0-9]+)",
        lines[-1],
    )
    assert m, lines[-1]
    assert int(m.group(2)) <= int(m.group(1)) + 10, "the store grew with the versions published"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_zones_small_prints_summary_line() -> None:
    if os.geteuid() != 0:
        pytest.skip("benchmarks/zones.py makes network namespaces: needs root")
    pid: list[int] = []
    lines = run_benchmark("zones.py", "--mb", "16", timeout=190, pid=pid)
    m = re.fullmatch(r"zones: link_bytes_per_version_vs_model=(\S+) all_replicas_s=(\S+) vs_no_relay=(\S+)", lines[-1])
    assert m, lines[-1]
    assert float(m.group(1)) <= 1.15, lines[-1]  # bytes, not time: holds under load too
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"wbz{pid[0]}-" not in out, out  # the run deleted its namespaces (others may run beside it)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zones_delta_small_prints_summary_line() -> None:
    """Deltas across the link: a few percent of the model per version (every replica bit-exact and a
    relay killed mid-version survived, or the run exits non-zero)."""
    if os.geteuid() != 0:
        pytest.skip("benchmarks/zones.py makes network namespaces: needs root")
    lines = run_benchmark("zones.py", "--delta", "--mb", "16", "--versions", "4", timeout=290)
    m = re.fullmatch(
        r"zones: delta=1 link_bytes_per_version_vs_model=(\S+) all_replicas_s=(\S+) vs_full=(\S+)", lines[-1]
    )
    assert m, lines[-1]
    assert float(m.group(1)) <= 0.06, lines[-1]  # bytes, not time: holds under load too
