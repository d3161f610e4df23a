"""Transport throughput, side by side: every wbridge transport, the machine's ceilings, the raw engines.

    python benchmarks/transport_throughput.py [--size 1GiB] [--op-size 4MiB] [--repeat 3] [--json FILE]

In one run, each reading ``size`` bytes in ops of ``op_size`` into an already-touched destination:

- every wbridge transport installed here (``transports.bench.run_bench``: a serving process, one
  prepared batch read ``repeat`` times after a warm-up, bytes checked);
- the ceilings: ``iperf3`` over loopback (one stream and ``--streams`` streams; the better one) for
  TCP, a single-thread numpy copy of the same size into a touched destination for memory;
- the raw engines with no wbridge code around them: Mooncake ``transfer_sync_read`` per op and
  ``batch_transfer_sync_read`` over tcp (the better one counts), NIXL ``READ`` of the same ops.

GB/s are 10**9 bytes per second over ``repeat`` timed reads, median and best. The ratios use the
best of each side: on a shared, loaded machine the best read is the one least disturbed by
neighbours, and both sides of a ratio are measured minutes apart. The last line is exactly::

    transport_throughput: tcp_vs_iperf3=<r> local_vs_memcpy=<r> mooncake_vs_raw=<r> nixl_vs_raw=<r> tcp_vs_mooncake_tcp=<r>

(``n/a`` where a side could not be measured). Before it, two ``host:`` lines (at the start and
at the end) give what decides same-host copy speed besides the code: CPUs, NUMA nodes, huge-page
settings for anonymous memory and shmem, and the load average. Each wbridge transport is measured right after what
it is compared with, and the whole set ``--rounds`` times. Targets: tcp >= 0.9x iperf3; local >= 0.9x memcpy;
mooncake and nixl >= 0.95x their raw engines; wbridge tcp >= 1.3x raw Mooncake over tcp.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import transports
from transports.bench import control, parse_size, run_bench
from transports.bench.loopback import LoopbackServer
from transports.bench.memory import Buffer
from transports.bench.raw import READERS, iperf3_loopback


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sysfs(path: str) -> str:
    """The selected value of a sysfs setting (``always [madvise] never`` -> ``madvise``), or ``?``."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return "?"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text


def host_facts() -> str:
    """What decides same-host copy speed besides the code: CPUs, NUMA nodes (a reader on another
    node than the publisher's pages reads remote memory), transparent huge pages for anonymous
    memory (the memcpy baseline) and for shmem (the ``local`` transport's memfd host buffers; 4
    KiB pages otherwise), and the load average."""
    try:
        nodes = len([n for n in os.listdir("/sys/devices/system/node") if n.startswith("node")])
    except OSError:
        nodes = 0
    thp = "/sys/kernel/mm/transparent_hugepage/"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"host: cpus={len(os.sched_getaffinity(0))} numa_nodes={nodes or '?'} "
        f"thp_anon={_sysfs(thp + 'enabled')} thp_shmem={_sysfs(thp + 'shmem_enabled')} load_average={load}"
    )


# -- raw engines: a bench server on loopback registers its region with them (transports.bench.raw) -----
@contextmanager
def _raw_reader(engine: str, size: int, op_size: int) -> Iterator[tuple[Any, Any, Callable[[], bool]]]:
    """A bare ``engine`` (nixl, mooncake) reading ``size`` bytes in ops of ``op_size`` from a bench
    server process on loopback: ``(reader, prepared batch of the whole region, check())``."""
    with LoopbackServer(["tcp"], size) as server:
        ch = control.dial("127.0.0.1", server.port, server.token.encode(), 60)
        try:
            seed = ch.recv(60)["seed"]
            info = ch.request({"op": "raw", "engine": engine}, 60)["info"]
            dst = Buffer(size)
            dst.fill_byte(0xA5)  # touched before timing, and wrong until read
            reader = READERS[engine](info, dst.addr, size, "cpu", "127.0.0.1")
            try:
                starts = np.arange(0, size, op_size, dtype=np.int64)
                handle = reader.prepare(starts, starts, op_size)
                yield reader, handle, lambda: dst.check(seed)
                reader.release(handle)
            finally:
                reader.close()
            ch.request({"op": "bye"}, 60)
        finally:
            ch.close()


def _timed(fn: Callable[[], Any], repeat: int, warmup: int = 1) -> list[float]:
    times = []
    for i in range(warmup + repeat):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def memcpy(size: int, repeat: int) -> tuple[float, float]:
    """(median, best) GB/s of a single-thread numpy copy into a destination already touched
    (``transports.bench.memcpy_ceiling`` measures the same; this keeps the best read as well)."""
    src = np.full(size, 1, dtype=np.uint8)
    dst = np.full(size, 2, dtype=np.uint8)
    times = _timed(lambda: np.copyto(dst, src), repeat)
    return size / statistics.median(times) / 1e9, size / min(times) / 1e9


def raw_mooncake(size: int, op_size: int, repeat: int) -> dict:
    with _raw_reader("mooncake", size, op_size) as (reader, handle, check):
        t_single = _timed(lambda: reader.read_each(handle, 120.0), repeat)
        t_batch = _timed(lambda: reader.read(handle, 120.0), repeat)
        ok = check()
    single_gbps, batch_gbps = size / statistics.median(t_single) / 1e9, size / statistics.median(t_batch) / 1e9
    return {
        "engine": "mooncake-raw (tcp)",
        "gbps": max(single_gbps, batch_gbps),
        "single_gbps": single_gbps,
        "batch_gbps": batch_gbps,
        "best": size / min(t_single + t_batch) / 1e9,
        "verified": ok,
    }


def raw_nixl(size: int, op_size: int, repeat: int) -> dict:
    with _raw_reader("nixl", size, op_size) as (reader, handle, check):
        times = _timed(lambda: reader.read(handle, 120.0), repeat)
        ok = check()
    return {
        "engine": "nixl-raw (UCX READ)",
        "gbps": size / statistics.median(times) / 1e9,
        "best": size / min(times) / 1e9,
        "verified": ok,
    }


# -- the run ------------------------------------------------------------------------------------
def _measure(item: str, size: int, op: int, rep: int, streams: int) -> dict:
    """One measurement: ``{"what", "median", "best", "verified"}`` (GB/s), or the same with ``error``."""
    try:
        if item == "memcpy":
            median, best = memcpy(size, rep)
            return {"what": "memcpy (numpy, 1 thread)", "median": median, "best": best, "verified": "-"}
        if item == "iperf3":
            got = {s: iperf3_loopback(size, s) for s in sorted({1, streams})}
            best = max([x for x in got.values() if x], default=None)
            label = ", ".join(f"-P {s}: {'n/a' if x is None else f'{x:.2f}'}" for s, x in got.items())
            return {"what": f"iperf3 loopback (best of {label})", "median": best, "best": best, "verified": "-"}
        if item in ("mooncake-raw", "nixl-raw"):
            r = (raw_mooncake if item == "mooncake-raw" else raw_nixl)(size, op, rep)
            extra = f" (per-op {r['single_gbps']:.2f}, batch {r['batch_gbps']:.2f})" if "single_gbps" in r else ""
            return {"what": r["engine"] + extra, "median": r["gbps"], "best": r["best"], "verified": r["verified"]}
        r = run_bench(item, size, op, streams, repeat=rep)
        ok = r["verified"] and r["server_status"] == 0
        return {"what": f"wbridge {item}", "median": r["gbps"], "best": r["gbps_best"] if ok else None, "verified": ok}
    except Exception as e:  # noqa: BLE001 - one failing item must not hide the others
        return {
            "what": item if "raw" in item or item in ("memcpy", "iperf3") else f"wbridge {item}",
            "median": None,
            "best": None,
            "verified": False,
            "error": f"error: {e!r}"[:120],
        }


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    ap.add_argument("--op-size", type=parse_size, default=parse_size("4MiB"))
    ap.add_argument("--streams", type=int, default=4, help="tcp streams (and iperf3's second run)")
    ap.add_argument("--repeat", type=int, default=5, help="timed reads per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="times the whole set is measured (best counts)")
    ap.add_argument(
        "--transports",
        default=",".join(transports.available()),
        help="comma-separated wbridge transports to run (default: all installed)",
    )
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE as JSON")
    args = ap.parse_args(argv)
    size, op, rep = args.size, args.op_size, args.repeat
    names = [t for t in args.transports.split(",") if t]
    # Each wbridge transport right next to what it is compared with, the whole set ``rounds`` times
    # (neighbours' load changes by the minute here; the best of each item over the rounds counts).
    order = []
    for name in names:
        order += {
            "tcp": ["iperf3", "tcp"],
            "local": ["memcpy", "local"],
            "mooncake": ["mooncake-raw", "mooncake"],
            "nixl": ["nixl-raw", "nixl"],
        }.get(name, [name])
    order += [ref for ref in ("iperf3", "memcpy", "mooncake-raw", "nixl-raw") if ref not in order]
    runs: dict[str, list[dict]] = {item: [] for item in order}
    start = host_facts()
    _log(start)
    for rnd in range(args.rounds):
        for item in order:
            _log(f"round {rnd + 1}/{args.rounds}: {item} ...")
            runs[item].append(_measure(item, size, op, rep, args.streams))
    rows, gb = [], {}
    for item in order:
        ok = [r for r in runs[item] if r.get("best") and r["verified"] is not False]
        gb[item] = max((r["best"] for r in ok), default=None)
        last = runs[item][-1]
        rows.append(
            {
                "what": last["what"],
                "GB/s": statistics.median([r["median"] for r in ok]) if ok else None,
                "best": gb[item],
                "bit-exact": last["verified"] if not last.get("error") else last["error"],
            }
        )

    width = max(len(r["what"]) for r in rows)
    print(f"{start} (at the start)\n{host_facts()} (at the end)")
    print(
        f"transport throughput: {size} bytes in {op}-byte ops, {args.rounds} rounds of {rep} timed reads "
        "(GB/s: median, best)"
    )
    print(f"{'what'.ljust(width)}  {'median':>7}  {'best':>7}  bit-exact")

    def num(x: float | None) -> str:
        return "n/a" if x is None else format(x, ".2f")

    for r in rows:
        print(f"{r['what'].ljust(width)}  {num(r['GB/s']):>7}  {num(r['best']):>7}  {r['bit-exact']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "size": size,
                    "op_size": op,
                    "repeat": rep,
                    "rounds": args.rounds,
                    "rows": rows,
                    "gbps": gb,
                    "runs": runs,
                },
                f,
                indent=1,
            )
    print(
        f"transport_throughput: tcp_vs_iperf3={_ratio(gb.get('tcp'), gb['iperf3'])} "
        f"local_vs_memcpy={_ratio(gb.get('local'), gb['memcpy'])} "
        f"mooncake_vs_raw={_ratio(gb.get('mooncake'), gb.get('mooncake-raw'))} "
        f"nixl_vs_raw={_ratio(gb.get('nixl'), gb.get('nixl-raw'))} "
        f"tcp_vs_mooncake_tcp={_ratio(gb.get('tcp'), gb.get('mooncake-raw'))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
