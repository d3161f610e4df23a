"""Fault-test processes: the runtime actors plus what fault tests need (re-registering after a
restart, the subscriber list, joining a test host's network namespace), and helpers to stop a pull
half-way (``wbridge.testing.faults.Pause``) and wait for it."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

from tests.runtime.actors import PubActor, SubActor

CLONE_NEWNET = 0x40000000


def join_netns(name: str) -> None:
    """Moves this process into network namespace ``name`` (``ip netns``). Called first thing in a
    freshly forked worker, while it has one thread: threads started later inherit the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(netns: str, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A ``Worker`` factory: ``Worker("pub", in_netns, host.name, FaultPub, ...)`` runs on that test host."""
    join_netns(netns)
    return factory(*args, **kwargs)


class FaultPub(PubActor):
    def reregister(self) -> int:
        """Registers again (every rank does after a restart): a new epoch."""
        return self.pub.register(self.tensors)

    def subscribers(self) -> list[dict]:
        return self.pub.subscribers()

    def epoch(self) -> int:
        return self.pub._reg.epoch  # noqa: SLF001 - test introspection

    def held(self) -> dict:
        """What this process holds: open fds, and bytes of memfd (shared memory) mappings."""
        shm = 0
        with open("/proc/self/maps") as f:
            for line in f:
                if "memfd:" in line:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    shm += hi - lo
        return {"fds": len(os.listdir("/proc/self/fd")), "shm": shm}


class FaultSub(SubActor):
    def live_key(self) -> str:
        return self.sub.keys.sub(self.sub.id, "live")


def pause_fault(tmp_path, on_reads: tuple[int, ...], hold: float = 60.0) -> tuple[tuple[str, dict], str, str]:
    """A ``fault=`` for ``SubActor`` that stops reads ``on_reads`` half-way until released; returns
    it with the signal and release file paths."""
    signal_path, release_path = str(tmp_path / "paused"), str(tmp_path / "release")
    fault = ("pause", {"signal_path": signal_path, "release_path": release_path, "hold": hold, "on_reads": on_reads})
    return fault, signal_path, release_path


def wait_paused(signal_path: str, count: int, timeout: float = 30.0) -> None:
    """Blocks until ``count`` reads stopped half-way (each appends a line to ``signal_path``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(signal_path) as f:
                if len(f.readlines()) >= count:
                    return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {count} paused reads within {timeout}s")
        time.sleep(0.01)


def release(release_path: str) -> None:
    open(release_path, "w").close()
