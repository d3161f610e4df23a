"""Smoke test of ``benchmarks/delta.py``: two training steps of the small Llama, real processes,
every pull checked bit for bit inside the benchmark (a mismatch exits non-zero)."""

from __future__ import annotations

import os
import re

import pytest

from .test_bench_smoke import run_benchmark

NUM = r"[0-9]+\.[0-9]+"


@pytest.mark.slow
@pytest.mark.heavy  # trains the small Llama in real processes
@pytest.mark.timeout(300)
def test_delta_benchmark_prints_its_line(tmp_path) -> None:
    lines = run_benchmark("delta.py", "--lr", "1e-6", "--steps", "2", "--out", str(tmp_path), timeout=280)
    assert len(lines) == 1, lines
    assert re.fullmatch(
        rf"delta: changed={NUM} read_ratio={NUM} snapshot_overhead={NUM} pull_speedup={NUM} "
        rf"bytes_per_changed={NUM} encode_gbps={NUM}",
        lines[0],
    ), lines
    ratio = float(re.search(r"read_ratio=([0-9.]+)", lines[0]).group(1))
    # Deltas or full reads, as the cost choice finds them on this link and this load (bit-exact
    # either way: the benchmark exits non-zero otherwise); what they cost is the benchmark's figure.
    assert 0 < ratio <= 1.05, lines
    assert os.path.exists(tmp_path / "delta.png")


@pytest.mark.slow
@pytest.mark.heavy  # trains the small Llama in real processes
@pytest.mark.timeout(300)
def test_delta_benchmark_publishes_fp8_blocks(tmp_path) -> None:
    lines = run_benchmark("delta.py", "--lr", "1e-6", "--steps", "2", "--fp8", "--out", str(tmp_path), timeout=280)
    assert len(lines) == 1, lines
    assert re.fullmatch(
        rf"delta: changed={NUM} read_ratio={NUM} snapshot_overhead={NUM} pull_speedup={NUM} "
        rf"bytes_per_changed={NUM} encode_gbps={NUM} fp8",
        lines[0],
    ), lines


@pytest.mark.slow
@pytest.mark.heavy  # trains the small Llama in real processes, in two network namespaces
@pytest.mark.timeout(300)
def test_delta_benchmark_over_a_shaped_link(tmp_path) -> None:
    from tests.hosts import netns_unavailable

    why = netns_unavailable()
    if why:
        pytest.skip(f"--link needs network namespaces: {why}")
    args = ("--lr", "1e-6", "--steps", "3", "--link", "1gbit", "--out", str(tmp_path))
    lines = run_benchmark("delta.py", *args, timeout=280)
    assert len(lines) == 1, lines
    assert re.fullmatch(
        rf"delta: changed={NUM} read_ratio={NUM} snapshot_overhead={NUM} pull_speedup={NUM} "
        rf"bytes_per_changed={NUM} encode_gbps={NUM} link=1gbit",
        lines[0],
    ), lines
    # a full version takes ~80 ms over the link, its deltas a few: chosen every time, and faster
    assert float(re.search(r"pull_speedup=([0-9.]+)", lines[0]).group(1)) > 2, lines
