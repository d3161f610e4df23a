"""Smoke test of ``benchmarks/delta.py``: two training steps of the small Llama, real processes,
every pull checked bit for bit inside the benchmark (a mismatch exits non-zero). Its bytes are
checked pull by pull against what the delta format costs (``delta.json``); its timing ratios are
the benchmark's figures, with their targets in its docstring, and are not asserted here."""

from __future__ import annotations

import json
import os
import re
import statistics

import pytest

from .test_bench_smoke import run_benchmark

NUM = r"[0-9]+\.[0-9]+"
# A delta carries 4 bytes per changed bf16 word (an index and the word), so 2 x the changed fraction
# of a full pull's bytes, plus its tables and headers: 0.04-0.06% of a full pull here.
TABLES = 0.005
# the benchmark's line (``delta.py``'s docstring), options it ran with after it
LINE = (
    rf"delta: changed={NUM} read_ratio={NUM} snapshot_overhead={NUM} pull_speedup={NUM} "
    rf"bytes_per_changed={NUM} encode_gbps={NUM}"
)


def run_delta(out_dir, *args: str, tail: str = "") -> str:
    """Runs ``benchmarks/delta.py`` with ``args``, writing to ``out_dir``; returns its one line,
    checked to be ``LINE`` followed by ``tail``."""
    lines = run_benchmark("delta.py", *args, "--out", str(out_dir), timeout=280)
    assert len(lines) == 1, lines
    assert re.fullmatch(LINE + tail, lines[0]), lines
    return lines[0]


def check_bytes(line: str, out_dir) -> list[dict]:
    """Every pull after the first read either exactly a full pull's bytes (the choice went to a full
    read) or a delta no larger than its changed words and tables; ``read_ratio`` is their mean over
    a full pull. Returns the pulls."""
    (result,) = json.load(open(out_dir / "delta.json"))
    full = result["rows"][0]["full_bytes"]
    pulls = result["rows"][1:]
    assert pulls and all(r["full_bytes"] == full for r in pulls), pulls
    for r in pulls:
        assert r["changed"] > 0, r  # every AdamW step changes some bf16 words
        if r["delta_delta"]:
            assert r["delta_bytes"] <= full * (2 * r["changed"] + TABLES), (r, full)
        else:
            assert r["delta_bytes"] == full and r["delta_why"] != "delta", (r, full)
    ratio = statistics.fmean(r["delta_bytes"] for r in pulls) / full
    assert re.search(rf"read_ratio={ratio:.4f} ", line), (line, ratio)
    return pulls


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_delta_benchmark_prints_its_line(tmp_path) -> None:
    line = run_delta(tmp_path, "--lr", "1e-6", "--steps", "2")
    # deltas or full reads, as the cost choice finds them on this link and this load (bit-exact
    # either way: the benchmark exits non-zero otherwise), each costing what it should
    check_bytes(line, tmp_path)
    assert os.path.exists(tmp_path / "delta.png")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_delta_benchmark_publishes_fp8_blocks(tmp_path) -> None:
    run_delta(tmp_path, "--lr", "1e-6", "--steps", "2", "--fp8", tail=" fp8")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_delta_benchmark_over_a_shaped_link(tmp_path) -> None:
    from tests.hosts import netns_unavailable

    why = netns_unavailable()
    if why:
        pytest.skip(f"--link needs network namespaces: {why}")
    line = run_delta(tmp_path, "--lr", "1e-6", "--steps", "3", "--link", "1gbit", tail=" link=1gbit")
    # a full version takes ~80 ms over the link, its deltas a few: chosen every time (how much faster
    # they are is the benchmark's pull_speedup, its target in benchmarks/delta.py)
    pulls = check_bytes(line, tmp_path)
    assert all(r["delta_delta"] for r in pulls), [r["delta_why"] for r in pulls]
