"""Checks shared by the per-transport tests of the optional engines (mooncake, nixl, nccl)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np

import transports
from transports.base import ReadBatch

from .peer import Peer, region_bytes

TOKEN = "engine-token"
TIMEOUT = 20.0
GARBAGE = 0xC3


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if family == socket.AF_INET:
                addr = socket.inet_ntop(family, raw[::-1])
            else:
                addr = socket.inet_ntop(family, b"".join(struct.pack("<I", x) for x in struct.unpack(">4I", raw)))
            out.append((addr, int(hexport, 16)))
    return out


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def open_read_close_cycles(name: str, cycles: int, options: dict | None = None) -> None:
    """``cycles`` x (open, register, connect, prepare, read, release, disconnect, deregister, close) against
    one serving process; afterwards this process has the fds, OS threads and Python threads it had,
    and the server is back to its regions, fds, threads and connections."""
    cls = transports.get(name)
    opts = dict(options or {})
    size = 1 << 16
    want = region_bytes(size, 5)
    dst = np.empty(size, dtype=np.uint8)
    with Peer(name, [{"size": size, "seed": 5}], token=TOKEN, options=opts, timeout=TIMEOUT) as server:

        def cycle() -> None:
            with cls(token=TOKEN.encode(), **opts) as t:
                local = t.register(dst.ctypes.data, size)
                peer = t.connect(server.endpoint, timeout=TIMEOUT)
                prep = t.prepare(peer, server.descriptors, [local], ReadBatch.of([(0, 0, 0, 0, size)]))
                dst.fill(GARBAGE)
                t.read(prep, timeout=TIMEOUT)
                assert np.array_equal(dst, want)
                t.release(prep)
                t.disconnect(peer)
                t.deregister(local)
                assert t.num_regions == 0

        cycle()  # warm-up: imports, lazily loaded engine libraries
        base_server = server.command(op="stats")
        base = (fds(), os_threads(), threading.active_count())
        for _ in range(cycles):
            cycle()
        # engine threads wind down asynchronously; "no growth" (other tests' leftovers may still end)
        deadline = time.monotonic() + TIMEOUT

        def grown() -> bool:
            return any(now > then for now, then in zip((fds(), os_threads(), threading.active_count()), base))

        while grown() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not grown(), (
            f"fds, OS threads, Python threads: {base} -> {(fds(), os_threads(), threading.active_count())}"
        )
        deadline = time.monotonic() + TIMEOUT  # the server's own wait: it notices closed connections later
        while True:
            now = server.command(op="stats")
            if (
                all(now[k] == base_server[k] for k in ("fds", "threads", "regions", "connections"))
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.05)
        assert {k: now[k] for k in base_server if k != "ok"} == {k: base_server[k] for k in base_server if k != "ok"}
        assert server.stop() == 0
