"""Checks shared by the per-transport tests of the optional engines (mooncake, nixl, nccl)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import Counter

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


def fd_targets(pid: int | str = "self") -> Counter:
    """What the descriptors of process ``pid`` point at (socket inodes, files, ``anon_inode:...``): a
    multiset, so that descriptors open in a baseline and closed meanwhile (an earlier test's garbage,
    a connection the peer closes late) neither hide nor fake a leak: ``fd_targets() - base`` is what
    is new."""
    targets: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets[os.readlink(f"/proc/{pid}/fd/{fd}")] += 1
        except OSError:  # the descriptor listdir itself used, or one closed meanwhile
            pass
    return targets


def thread_names(pid: int | str = "self") -> Counter:
    """The kernel names (``comm``) of the OS threads of process ``pid``, and for this process the
    names of its Python threads (``py:...``): a multiset, for messages."""
    names: Counter = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            pass
    if pid == "self":
        names.update(f"py:{t.name}" for t in threading.enumerate())
    return names


def _listed(c: Counter, most: int = 12) -> str:
    """The entries of a multiset for a message: the first ``most``, then how many in all."""
    items = sorted(c.elements())
    return str(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


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
        # fds are compared by what they point at, not counted: the serving process closes its end of a
        # reader's connection only once it notices the reader closed it, so under load the warm-up's
        # socket may still be open (CLOSE_WAIT) in the baseline and close later. A count then stays
        # below the baseline for good (an "equal counts" wait failed after 20 s); by target, a baseline
        # fd closing later is fine and any fd the cycles left open (a new socket inode, one more copy
        # of a path) is still a leak.
        base_server = server.command(op="stats")
        server_fds, server_threads = fd_targets(server.pid), thread_names(server.pid)
        base = (os_threads(), threading.active_count())
        base_fds, base_threads = fd_targets(), thread_names()
        for _ in range(cycles):
            cycle()
        # engine threads wind down asynchronously; "no growth" (other tests' leftovers may still end)
        deadline = time.monotonic() + TIMEOUT

        def grown() -> bool:
            return bool(fd_targets() - base_fds) or any(
                now > then for now, then in zip((os_threads(), threading.active_count()), base)
            )

        while grown() and time.monotonic() < deadline:
            time.sleep(0.05)
        if grown():
            raise AssertionError(
                f"{name}: after {cycles} cycles this process keeps new fds {_listed(fd_targets() - base_fds)}; "
                f"OS threads, Python threads {base} -> {(os_threads(), threading.active_count())}, "
                f"new threads {_listed(thread_names() - base_threads)}"
            )
        deadline = time.monotonic() + TIMEOUT  # the server's own wait: it notices closed connections later

        def server_left() -> str:
            """What the serving process keeps beyond its baseline ("" if nothing)."""
            now = server.command(op="stats")
            new_fds = fd_targets(server.pid) - server_fds
            if new_fds or now["threads"] > base_server["threads"]:
                return (
                    f"new fds {_listed(new_fds)}; Python threads {base_server['threads']} -> {now['threads']}, "
                    f"new OS threads {_listed(thread_names(server.pid) - server_threads)}"
                )
            moved = {k: (base_server[k], now[k]) for k in ("regions", "connections") if now[k] != base_server[k]}
            return f"(before, after): {moved}" if moved else ""

        while (left := server_left()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"{name}: after {cycles} cycles the serving process keeps {left}"
        status = server.stop()
        assert status == 0, f"{name}: the serving process exited with status {status}"
