"""Many small reads against one bulk read of the same bytes, per transport, side by side in one run.

    PYTHONPATH=. python benchmarks/small_reads.py [--transports tcp,local] [--rows 16384] [--repeat 5] [--rounds 3]

The case is a column slice: a ``[rows, 2048]`` bf16 tensor published whole (one region of
``rows * 4096`` bytes in a serving process) and a reader taking columns ``0:1024``, i.e. ``rows``
reads of 2 KiB, 4 KiB apart in the source and back to back in the destination: exactly the
``ReadBatch`` the planner makes for it. The bulk side reads the same number of bytes as one run.
Both batches are prepared once on one peer and read alternately (``repeat`` timed reads each per
round, ``rounds`` rounds), and every read is checked bit-exact. Per transport it prints::

    small_reads: transport=<name> reads=<n> small_gbps=<g> bulk_gbps=<g> small_vs_bulk=<r> gc_per_read=<c>

``small_vs_bulk`` is the bulk read's best time over the small reads' best time (1.0: the reads cost
nothing beyond their bytes; target >= 0.5 on tcp and local). For ``local``, ``copy_ceiling`` is the
same ratio for a bare in-process copy of the same pattern, by the executor ``local`` uses for it
(``transports._copy.serial_chunks``: torch's copy loop on this thread), against one ``memmove``: what
this machine's memory allows that strided gather, with no transport at all. ``gc_per_read`` counts the
garbage collections this process ran per small read (Python objects made per read trigger them).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import time

import numpy as np
import torch

import transports
from transports._copy import run_chunks, serial_chunks
from transports._serve import ServingProcess, region_bytes
from transports.base import ReadBatch

COLS_BYTES = 2048 * 2  # a row of the bf16 tensor
TAKE_BYTES = 1024 * 2  # columns 0:1024


def batches(rows: int) -> tuple[ReadBatch, ReadBatch]:
    """(the column slice as ``rows`` reads, the same bytes as one read)."""
    r = np.arange(rows, dtype=np.int64)
    zeros = np.zeros(rows, dtype=np.int64)
    small = ReadBatch(zeros, r * COLS_BYTES, zeros, r * TAKE_BYTES, np.full(rows, TAKE_BYTES))
    bulk = ReadBatch.of([(0, 0, 0, 0, rows * TAKE_BYTES)])
    return small, bulk


def measure(name: str, rows: int, repeat: int, rounds: int, timeout: float = 120.0) -> dict:
    size = rows * COLS_BYTES
    src = region_bytes(size, 7).reshape(rows, COLS_BYTES)
    want_small = np.ascontiguousarray(src[:, :TAKE_BYTES]).reshape(-1)
    want_bulk = src.reshape(-1)[: rows * TAKE_BYTES]
    dst = np.full(rows * TAKE_BYTES, 0xA5, dtype=np.uint8)  # touched before timing
    small, bulk = batches(rows)
    times: dict[str, list[float]] = {"small": [], "bulk": []}
    collections = 0  # garbage collections (any generation) during the timed small reads
    exact = True
    with (
        ServingProcess(name, [{"size": size, "seed": 7}], token="bench", timeout=timeout) as server,
        transports.get(name)(token=b"bench") as t,
    ):
        local = t.register(dst.ctypes.data, dst.nbytes)
        peer = t.connect(server.endpoint, timeout=timeout)
        prep = {k: t.prepare(peer, server.descriptors, [local], b) for k, b in (("small", small), ("bulk", bulk))}
        for _ in range(rounds):
            for kind in ("small", "bulk"):
                t.read(prep[kind], timeout=timeout)  # warm-up, and the bit-exact check
                exact &= bool(np.array_equal(dst, want_small if kind == "small" else want_bulk))
                before = sum(x["collections"] for x in gc.get_stats())
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    t.read(prep[kind], timeout=timeout)
                    times[kind].append(time.perf_counter() - t0)
                if kind == "small":
                    collections += sum(x["collections"] for x in gc.get_stats()) - before
        for p in prep.values():
            t.release(p)
        t.disconnect(peer)
        t.deregister(local)
    best = {k: min(v) for k, v in times.items()}
    return {
        "transport": name,
        "reads": rows,
        "small_gbps": dst.nbytes / best["small"] / 1e9,
        "bulk_gbps": dst.nbytes / best["bulk"] / 1e9,
        "small_vs_bulk": best["bulk"] / best["small"],
        "gc_per_read": collections / (rounds * repeat),
        "bit_exact": exact,
    }


def copy_ceiling(rows: int, repeat: int) -> float:
    """Bulk ``memmove`` time over the strided gather of the same bytes that ``local`` makes, in this process."""
    src = np.full(rows * COLS_BYTES, 7, dtype=np.uint8)
    dst = np.full(rows * TAKE_BYTES, 0xA5, dtype=np.uint8)
    rows_view = torch.from_numpy(src).view(rows, COLS_BYTES)[:, :TAKE_BYTES]
    chunks = serial_chunks(torch.from_numpy(dst).view(rows, TAKE_BYTES), rows_view)

    def best(fn) -> float:
        fn()
        return min(_timed(fn) for _ in range(repeat))

    bulk = best(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, dst.nbytes))
    return bulk / best(lambda: run_chunks(chunks))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transports", default="tcp,local", help="comma-separated transports to measure")
    ap.add_argument("--rows", type=int, default=16384, help="rows of the [rows, 2048] bf16 tensor")
    ap.add_argument("--repeat", type=int, default=5, help="timed reads per kind per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of alternating small and bulk reads")
    args = ap.parse_args(argv)
    for name in [n for n in args.transports.split(",") if n]:
        r = measure(name, args.rows, args.repeat, args.rounds)
        extra = f" copy_ceiling={copy_ceiling(args.rows, args.repeat):.2f}" if name == "local" else ""
        print(
            f"small_reads: transport={name} reads={r['reads']} small_gbps={r['small_gbps']:.2f} "
            f"bulk_gbps={r['bulk_gbps']:.2f} small_vs_bulk={r['small_vs_bulk']:.2f}{extra} "
            f"gc_per_read={r['gc_per_read']:.1f} bit_exact={r['bit_exact']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
