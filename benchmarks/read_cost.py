"""Per-read costs of this project's transports: where the simulator's defaults come from.

For each transport (``tcp``, ``local``) a serving process registers one region of ``--bytes``
bytes; the reader pulls the same bytes two ways, side by side: as ``--reads`` small entries of one
``ReadBatch`` (``bytes / reads`` each, packed back to back) and as one entry. The difference in CPU
time divided by the number of reads is the per-read cost:

* ``reader_us_per_read``: CPU of the reading process (posting, bookkeeping, receiving);
* ``server_us_per_read``: CPU of the serving process (``/proc/<pid>/stat``), which plays the part
  a NIC plays for one-sided reads (``local`` reads with ``process_vm_readv``: no server work).

Prints one line per transport, ``read_cost: transport=tcp reader_us_per_read=... server_us_per_read=...
rtt_us=... reader_us_per_call=...`` (``rtt_us``: median wall time of one 64-byte read, prepared
once; ``reader_us_per_call``: the reader's median CPU for it, the fixed cost of posting a batch).
Medians of ``--repeat`` pulls. Run: ``PYTHONPATH=. .venv/bin/python benchmarks/read_cost.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from transports import get
from transports._serve import ServingProcess
from transports.base import ReadBatch

TOKEN = "read-cost"


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pull(tr, prep, pid: int) -> tuple[float, float, float]:
    c0, s0, w0 = time.process_time(), _proc_cpu(pid), time.perf_counter()
    tr.read(prep, timeout=60)
    return time.process_time() - c0, _proc_cpu(pid) - s0, time.perf_counter() - w0


def measure(name: str, nbytes: int, reads: int, repeat: int) -> dict:
    size = nbytes // reads
    total = size * reads
    with ServingProcess(name, [{"size": total, "seed": 1}], token=TOKEN, fill="pattern") as peer:
        with get(name)(token=TOKEN.encode()) as tr:
            dst = np.zeros(total, dtype=np.uint8)
            local = tr.register(dst.ctypes.data, dst.nbytes)
            conn = tr.connect(peer.endpoint, timeout=30)
            offs = np.arange(reads, dtype=np.int64) * size
            zeros = np.zeros(reads, dtype=np.int64)
            small = ReadBatch(zeros, offs, zeros, offs, np.full(reads, size, dtype=np.int64))
            bulk = ReadBatch.of([(0, 0, 0, 0, total)])
            tiny = ReadBatch.of([(0, 0, 0, 0, 64)])
            preps = [tr.prepare(conn, peer.descriptors, [local], b) for b in (small, bulk, tiny)]
            samples: dict[str, list[tuple[float, float, float]]] = {"small": [], "bulk": []}
            for _ in range(repeat):  # interleaved, so load from other work hits both alike
                samples["small"].append(_pull(tr, preps[0], peer.pid))
                samples["bulk"].append(_pull(tr, preps[1], peer.pid))
            tiny_runs = [_pull(tr, preps[2], peer.pid) for _ in range(200)]
            for p in preps:
                tr.release(p)
            tr.disconnect(conn)

    def med(kind: str, i: int) -> float:
        return statistics.median(s[i] for s in samples[kind])

    return {
        "transport": name,
        "reads": reads,
        "read_bytes": size,
        "reader_us_per_read": max(0.0, med("small", 0) - med("bulk", 0)) / reads * 1e6,
        "server_us_per_read": max(0.0, med("small", 1) - med("bulk", 1)) / reads * 1e6,
        "wall_us_per_read": max(0.0, med("small", 2) - med("bulk", 2)) / reads * 1e6,
        "rtt_us": statistics.median(t[2] for t in tiny_runs) * 1e6,
        "reader_us_per_call": statistics.median(t[0] for t in tiny_runs) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transports", nargs="*", default=["tcp", "local"])
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument("--reads", type=int, default=131072)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    for name in args.transports:
        r = measure(name, args.bytes, args.reads, args.repeat)
        print(
            f"read_cost: transport={name} reads={r['reads']} read_bytes={r['read_bytes']} "
            f"reader_us_per_read={r['reader_us_per_read']:.3f} server_us_per_read={r['server_us_per_read']:.3f} "
            f"wall_us_per_read={r['wall_us_per_read']:.3f} rtt_us={r['rtt_us']:.1f} "
            f"reader_us_per_call={r['reader_us_per_call']:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
