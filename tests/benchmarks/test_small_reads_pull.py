"""Smoke test of ``benchmarks/small_reads.py --modes pull``: a real publisher process, two real
subscriber processes (the column slice and the same bytes as one tensor), every pull checked bit for
bit inside the benchmark (a mismatch prints ``bit_exact=False`` and exits non-zero)."""

from __future__ import annotations

import re

import pytest

from .test_bench_smoke import run_benchmark

NUM = r"[0-9]+\.[0-9]+"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_small_reads_pull_mode_prints_its_lines() -> None:
    lines = run_benchmark("small_reads.py", "--modes", "pull", "--rows", "512", "--pulls", "3", timeout=280)
    assert len(lines) == 2, lines
    for name, line in zip(("tcp", "local"), lines):
        m = re.fullmatch(
            rf"small_reads: mode=pull transport={name} reads=([0-9]+) small_gbps={NUM} bulk_gbps={NUM} "
            rf"small_vs_bulk={NUM} bit_exact=True",
            line,
        )
        assert m, lines
        # The staged publisher packs the column slice for its reader: a few contiguous reads, not
        # one per row (512 here).
        assert 1 <= int(m.group(1)) < 16, lines
