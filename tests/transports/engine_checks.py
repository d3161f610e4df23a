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


def fd_targets(pid: int | str = "self") -> list[str]:
    """What each open fd of process ``pid`` points at (``socket:[inode]``, a path, ``anon_inode:...``)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # the fd of the listdir itself, or one closed meanwhile
            continue
    return sorted(out)


def thread_names(pid: int | str = "self") -> list[str]:
    """The kernel name (``comm``) of every OS thread of process ``pid``; for this process, then every
    Python thread's name too (``py:...``)."""
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    py = [f"py:{t.name}" for t in threading.enumerate()] if pid == "self" else []
    return sorted(names) + sorted(py)


def _added(before: list[str], after: list[str]) -> list[str]:
    """The entries of ``after`` beyond those of ``before`` (a multiset difference)."""
    rest = list(before)
    out = []
    for x in after:
        if x in rest:
            rest.remove(x)
        else:
            out.append(x)
    return out


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
                assert np.array_equal(dst, want), f"{name}: read {np.count_nonzero(dst != want)} wrong bytes"
                t.release(prep)
                t.disconnect(peer)
                t.deregister(local)
                assert t.num_regions == 0, f"{name}: {t.num_regions} regions left after deregister"

        cycle()  # warm-up: imports, lazily loaded engine libraries
        base_server = server.command(op="stats")
        server_fds, server_threads = fd_targets(server.pid), thread_names(server.pid)
        base = (fds(), os_threads(), threading.active_count())
        base_fds, base_threads = fd_targets(), thread_names()
        for _ in range(cycles):
            cycle()
        # engine threads wind down asynchronously; "no growth" (other tests' leftovers may still end)
        deadline = time.monotonic() + TIMEOUT

        def grown() -> bool:
            return any(now > then for now, then in zip((fds(), os_threads(), threading.active_count()), base))

        while grown() and time.monotonic() < deadline:
            time.sleep(0.05)
        if grown():
            raise AssertionError(
                f"{name}: after {cycles} cycles this process grew: fds, OS threads, Python threads "
                f"{base} -> {(fds(), os_threads(), threading.active_count())}; "
                f"new fds {_added(base_fds, fd_targets())}, new threads {_added(base_threads, thread_names())}"
            )
        deadline = time.monotonic() + TIMEOUT  # the server's own wait: it notices closed connections later
        keys = [k for k in base_server if k != "ok"]
        while True:
            now = server.command(op="stats")
            if all(now[k] == base_server[k] for k in keys) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if any(now[k] != base_server[k] for k in keys):
            raise AssertionError(
                f"{name}: after {cycles} cycles the server's stats differ: "
                f"{ {k: base_server[k] for k in keys} } -> { {k: now[k] for k in keys} }; fds gone "
                f"{_added(fd_targets(server.pid), server_fds)}, new {_added(server_fds, fd_targets(server.pid))}; "
                f"OS threads gone {_added(thread_names(server.pid), server_threads)}, "
                f"new {_added(server_threads, thread_names(server.pid))}"
            )
        status = server.stop()
        assert status == 0, f"{name}: the serving process exited with status {status}"
