"""Many small reads against one bulk read of the same bytes, per transport, side by side in one run.

    PYTHONPATH=. python benchmarks/small_reads.py [--modes transport,pull] [--transports tcp,local] [--rows 16384]
        [--repeat 5] [--rounds 3] [--pulls 7] [--quiet]

Two modes, each per transport. ``transport`` (the ``staging=ZeroCopy()`` case, nothing packed) times the
transport's own reads; ``pull`` times whole pulls through a real ``Publisher`` and ``Subscriber``s,
where the staged publisher's reader-ordered slot turns the column slice into contiguous reads.

**Mode transport.** The case is a column slice: a ``[rows, 2048]`` bf16 tensor published whole (one region of
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

**Mode pull.** This process is the trainer: a ``Publisher`` (staged, the default ``one_step_off``
mode, hosting the tcp store, serving only the measured transport) of two bf16 tensors, ``w``
``[rows, 2048]`` and ``b`` ``[rows / 2, 2048]``. Two subscriber processes (``_common.start_actors``)
pull from it over that transport: ``small`` declares ``Shard("w", (rows, 2048))`` for a local
``[rows, 1024]`` tensor (columns ``0:1024``), ``bulk`` declares the whole of ``b``: the same bytes as
one contiguous tensor. Every version changes every element of both tensors; after each publish
both subscribers pull it, in alternating order, and each pull is checked bit-exact (a hash of the
subscriber's tensor against the trainer's values). The first two versions are a warm-up (connects,
plans, the first packing); ``pulls`` more are timed by the subscribers' own ``PullStats`` (seconds
and bytes of the pull). Per transport it prints::

    small_reads: mode=pull transport=<name> reads=<n> small_gbps=<g> bulk_gbps=<g> small_vs_bulk=<r> bit_exact=<b>

``reads`` is the most ops any timed column-sliced pull made; the GB/s are the **medians** over the
timed pulls (a pull's time holds more than its read, so single pulls jitter more than bare reads)
and ``small_vs_bulk`` is their ratio (target >= 0.5 on tcp and local). A mismatch anywhere makes the
script exit non-zero (after printing its lines). Without ``--quiet`` each pull's time and ops go to stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import sys
import time
from typing import Any

import numpy as np
import torch
from _common import TOKEN, free_port, median, open_publisher, start_actors, stop_all

import transports
from transports._copy import run_chunks, serial_chunks
from transports._serve import ServingProcess, region_bytes
from transports.base import ReadBatch
from wbridge import Shard

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


def digest(t: torch.Tensor) -> str:
    """A hash of a bf16 tensor's bytes."""
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


class PullActor:
    """A subscriber process of the pull mode.

    - ``url``, ``channel``, ``transport``: the store, channel and transport to pull with.
    - ``kind``: ``"small"`` (columns ``0:1024`` of ``w``) or ``"bulk"`` (the whole of ``b``).
    - ``rows``: rows of ``w`` (``b`` has half as many).
    """

    def __init__(self, url: str, channel: str, transport: str, kind: str, rows: int) -> None:
        from wbridge import Shard, Subscriber

        if kind == "small":
            self.tensor = torch.zeros(rows, TAKE_BYTES // 2, dtype=torch.bfloat16)
            decl = Shard("w", (rows, COLS_BYTES // 2))
        else:
            self.tensor = torch.zeros(rows // 2, COLS_BYTES // 2, dtype=torch.bfloat16)
            decl = Shard("b", (rows // 2, COLS_BYTES // 2))
        self.sub = Subscriber(channel, url, token=TOKEN, transport=transport, name=f"small-reads-{kind}")
        self.sub.register({"w" if kind == "small" else "b": (self.tensor, decl)})

    def pull(self, v: int, timeout: float) -> dict:
        got = self.sub.pull(min_version=v, timeout=timeout)
        last = self.sub.stats.last
        return {"v": got, "seconds": last.seconds, "nbytes": last.nbytes, "ops": last.ops, "hash": digest(self.tensor)}

    def close(self) -> None:
        self.sub.close()


def measure_pull(name: str, rows: int, pulls: int, warmup: int = 2, timeout: float = 120.0, quiet: bool = True) -> dict:
    """One publisher of ``w`` and ``b`` serving ``name``; the column-sliced and the bulk subscriber pull each."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randint(-(2**15), 2**15, (rows, COLS_BYTES // 2), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    b = torch.randint(-(2**15), 2**15, (rows // 2, COLS_BYTES // 2), dtype=torch.int16, generator=gen)
    b = b.view(torch.bfloat16)
    url, channel = f"tcp://127.0.0.1:{free_port()}", f"small-reads-{name}"
    decls = {"w": (w, Shard("w", tuple(w.shape))), "b": (b, Shard("b", tuple(b.shape)))}
    pub = open_publisher(channel, url, 0, 1, decls, name, host_store=True)
    actors: dict[str, Any] = {}
    samples: dict[str, list[dict]] = {"small": [], "bulk": []}
    exact = True
    try:
        specs = [(f"pull-{k}", PullActor, (url, channel, name, k, rows), {}) for k in ("small", "bulk")]
        actors = dict(zip(("small", "bulk"), start_actors(specs, timeout)))
        for i in range(warmup + pulls):
            for t in (w, b):  # every element changes, so a skipped write fails the hash
                t.view(torch.int16).add_(i + 1)
            want = {"small": digest(w[:, : TAKE_BYTES // 2]), "bulk": digest(b)}
            v = pub.publish(timeout=timeout)
            for kind in ("small", "bulk") if i % 2 else ("bulk", "small"):
                got = actors[kind].call("pull", v, timeout, call_timeout=timeout + 30)
                exact &= got["v"] == v and got["hash"] == want[kind]
                if i >= warmup:
                    samples[kind].append(got)
                if not quiet:
                    print(f"{name} v{v} {kind}: {got['seconds'] * 1e3:.1f} ms ops={got['ops']}", file=sys.stderr)
    finally:
        stop_all(list(actors.values()))
        pub.close()
    gbps = {k: median([s["nbytes"] / s["seconds"] / 1e9 for s in v]) for k, v in samples.items()}
    return {
        "transport": name,
        "reads": max(s["ops"] for s in samples["small"]),
        "small_gbps": gbps["small"],
        "bulk_gbps": gbps["bulk"],
        "small_vs_bulk": gbps["small"] / gbps["bulk"],
        "bit_exact": bool(exact),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="transport,pull", help="comma-separated: transport, pull")
    ap.add_argument("--transports", default="tcp,local", help="comma-separated transports to measure")
    ap.add_argument("--rows", type=int, default=16384, help="rows of the [rows, 2048] bf16 tensor (even)")
    ap.add_argument("--repeat", type=int, default=5, help="transport mode: timed reads per kind per round")
    ap.add_argument("--rounds", type=int, default=3, help="transport mode: rounds of alternating small and bulk reads")
    ap.add_argument("--pulls", type=int, default=7, help="pull mode: timed versions (each pulled by both subscribers)")
    ap.add_argument("--quiet", action="store_true", help="no per-pull progress on stderr")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - {"transport", "pull"}:
        ap.error(f"--modes takes transport and pull, got {args.modes!r}")
    if args.rows < 2 or args.rows % 2 or args.pulls < 1:
        ap.error("--rows must be even and >= 2, --pulls >= 1")
    ok = True
    for name in [n for n in args.transports.split(",") if n]:
        if "transport" in modes:
            r = measure(name, args.rows, args.repeat, args.rounds)
            extra = f" copy_ceiling={copy_ceiling(args.rows, args.repeat):.2f}" if name == "local" else ""
            print(
                f"small_reads: transport={name} reads={r['reads']} small_gbps={r['small_gbps']:.2f} "
                f"bulk_gbps={r['bulk_gbps']:.2f} small_vs_bulk={r['small_vs_bulk']:.2f}{extra} "
                f"gc_per_read={r['gc_per_read']:.1f} bit_exact={r['bit_exact']}",
                flush=True,
            )
            ok &= r["bit_exact"]
        if "pull" in modes:
            r = measure_pull(name, args.rows, args.pulls, quiet=args.quiet)
            print(
                f"small_reads: mode=pull transport={name} reads={r['reads']} small_gbps={r['small_gbps']:.2f} "
                f"bulk_gbps={r['bulk_gbps']:.2f} small_vs_bulk={r['small_vs_bulk']:.2f} bit_exact={r['bit_exact']}",
                flush=True,
            )
            ok &= r["bit_exact"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
