"""Transport throughput: ``wbridge bench transport --transport X --size 1GiB --op-size 4MiB --streams K``.

``run_bench`` starts a serving process holding one region of ``size`` bytes, reads it whole in ops
of ``op_size`` into a destination that is already touched (so page faults are not counted), checks
the bytes and reports GB/s (10**9 bytes per second). ``memcpy_ceiling`` and ``iperf3_ceiling`` measure
what the same machine allows, for the ratios in ``benchmarks/transport_throughput.py``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import get
from ._serve import ServingProcess, check_region
from ._util import free_port
from .base import ReadBatch

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """``"1GiB"`` -> 1073741824; also ``4MiB``, ``512k``, ``1e6``, plain integers."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1GiB, 4MiB, 65536)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _progress(label: str) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        bar = "#" * (30 * done // max(total, 1))
        sys.stderr.write(f"\r{label} [{bar:<30}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def run_bench(
    transport: str,
    size: int,
    op_size: int,
    streams: int = 4,
    *,
    repeat: int = 5,
    warmup: int = 1,
    token: str = "bench",
    options: dict | None = None,
    timeout: float = 120.0,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Reads ``size`` bytes in ops of ``op_size`` from a serving process ``repeat`` times; returns figures.

    ``streams`` goes to transports that take it; ``options`` are extra constructor keywords (both sides).
    """
    if size <= 0 or op_size <= 0:
        raise ValueError("size and op_size must be positive")
    cls = get(transport)
    opts = dict(options or {})
    if "streams" in inspect.signature(cls.__init__).parameters:
        opts.setdefault("streams", streams)
    nops = -(-size // op_size)
    starts = np.arange(nops, dtype=np.int64) * op_size
    batch = ReadBatch(np.zeros(nops), starts, np.zeros(nops), starts, np.minimum(op_size, size - starts))
    dst = np.empty(size, dtype=np.uint8)
    dst.fill(0xA5)  # touch every page before timing
    times: list[float] = []
    with (
        ServingProcess(
            transport, [{"size": size, "seed": 1}], token=token, options=opts, fill="pattern", timeout=timeout
        ) as server,
        cls(token=token.encode(), **opts) as t,
    ):
        local = t.register(dst.ctypes.data, size)
        peer = t.connect(server.endpoint, timeout=timeout)
        prep = t.prepare(peer, server.descriptors, [local], batch)
        for i in range(warmup + repeat):
            t0 = time.perf_counter()
            t.read(prep, timeout=timeout)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            if progress:
                progress(i + 1, warmup + repeat)
        ok = check_region(dst, 1, "pattern")
        t.release(prep)
        t.disconnect(peer)
        t.deregister(local)
        status = server.stop()
    gbps = [size / s / 1e9 for s in times]
    return {
        "transport": transport,
        "size": size,
        "op_size": op_size,
        "ops": nops,
        "streams": opts.get("streams"),
        "options": {k: v for k, v in opts.items() if k != "streams"},
        "repeat": repeat,
        "seconds": times,
        "gbps": statistics.median(gbps),
        "gbps_best": max(gbps),
        "verified": ok,
        "server_status": status,
    }


def memcpy_ceiling(size: int, repeat: int = 5) -> float:
    """GB/s of a single-thread numpy copy of ``size`` bytes into a destination already touched."""
    src = np.full(size, 1, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    dst.fill(2)
    best = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best.append(time.perf_counter() - t0)
    return size / statistics.median(best[1:]) / 1e9


def iperf3_ceiling(size: int, streams: int = 1, timeout: float = 120.0) -> float | None:
    """GB/s of ``iperf3`` sending ``size`` bytes over loopback; ``None`` where iperf3 is missing."""
    exe = shutil.which("iperf3")
    if exe is None:
        return None
    port = free_port()
    server = subprocess.Popen(
        [exe, "-s", "-1", "-B", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(50):  # the server needs a moment to listen; retry while the connection is refused
            out = subprocess.run(
                [exe, "-c", "127.0.0.1", "-p", str(port), "-n", str(size), "-P", str(streams), "-J"],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            try:
                return json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
            except (ValueError, KeyError):
                if "refused" not in out.stdout + out.stderr:
                    return None
            time.sleep(0.1)
        return None
    finally:
        server.kill()
        server.wait(10)


def _table(rows: Sequence[dict[str, Any]]) -> str:
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols), "  ".join("-" * width[c] for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wbridge bench transport", description=__doc__.split("\n")[0])
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    ap.add_argument("--op-size", type=parse_size, default=parse_size("4MiB"))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra transport constructor keyword (JSON value), e.g. method=\"vm\"",
    )
    ap.add_argument("--ceiling", action="store_true", help="also measure memcpy and iperf3 loopback ceilings")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    options = {}
    for kv in args.option:
        key, _, value = kv.partition("=")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    res = run_bench(
        args.transport,
        args.size,
        args.op_size,
        args.streams,
        repeat=args.repeat,
        options=options,
        progress=None if args.json else _progress(f"{args.transport} {_human(args.size)}"),
    )
    if args.ceiling:
        res["memcpy_gbps"] = memcpy_ceiling(args.size)
        res["iperf3_gbps"] = iperf3_ceiling(args.size)
    if args.json:
        print(json.dumps(res))
    else:
        row = {
            "transport": res["transport"],
            "size": _human(res["size"]),
            "op size": _human(res["op_size"]),
            "ops": res["ops"],
            "streams": res["streams"] or "-",
            "GB/s (median)": f"{res['gbps']:.2f}",
            "GB/s (best)": f"{res['gbps_best']:.2f}",
            "bit-exact": res["verified"],
        }
        for k in ("memcpy_gbps", "iperf3_gbps"):
            if k in res:
                row[k.replace("_gbps", " GB/s")] = "n/a" if res[k] is None else f"{res[k]:.2f}"
        print(_table([row]))
    return 0 if res["verified"] and res["server_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
