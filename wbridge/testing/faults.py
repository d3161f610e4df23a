"""Fault injection for tests and drills: transport wrappers that misbehave on purpose."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from transports.base import ReadBatch, Region, Transport


class Delegating(Transport):
    """Forwards every call to ``inner``; subclasses override what they break."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(token=inner.token, host=inner.host)
        self.inner = inner
        self.name = f"{inner.name}+{type(self).__name__.lower()}"

    def register(self, addr: int, nbytes: int, *, device: str = "cpu") -> Region:
        return self.inner.register(addr, nbytes, device=device)

    def host_buffer(self, nbytes: int) -> Any | None:
        return self.inner.host_buffer(nbytes)

    def deregister(self, region: Region) -> None:
        self.inner.deregister(region)

    def endpoint(self) -> bytes:
        return self.inner.endpoint()

    def connect(self, endpoint: bytes, *, timeout: float) -> Any:
        return self.inner.connect(endpoint, timeout=timeout)

    def prepare(
        self, peer: Any, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> Any:
        return (self.inner.prepare(peer, remote_regions, local_regions, batch), list(local_regions), batch)

    def read(self, prepared: Any, *, timeout: float) -> None:
        self.inner.read(prepared[0], timeout=timeout)

    def release(self, prepared: Any) -> None:
        self.inner.release(prepared[0])

    def disconnect(self, peer: Any) -> None:
        self.inner.disconnect(peer)

    def close(self) -> None:
        self._closed = True
        self.inner.close()


class FlipBit(Delegating):
    """Flips one bit of the byte ``at`` bytes past where the first read of a batch lands (0: its
    first byte; further on, bytes of the batch's next reads where they land after it), on reads
    number ``on_reads`` (1-based), counting only batches of at least ``min_ops`` reads (to skip
    verification re-reads, say) and ``min_bytes`` bytes (to skip the few bytes of stamps)."""

    def __init__(
        self, inner: Transport, on_reads: Sequence[int] = (1,), min_ops: int = 1, min_bytes: int = 0, at: int = 0
    ) -> None:
        super().__init__(inner)
        self.on_reads = set(on_reads)
        self.min_ops, self.min_bytes, self.at = min_ops, min_bytes, at
        self.reads = 0

    def read(self, prepared: Any, *, timeout: float) -> None:
        inner, local, batch = prepared
        self.inner.read(inner, timeout=timeout)
        if len(batch) < self.min_ops or batch.total_bytes < self.min_bytes:
            return
        self.reads += 1
        if self.reads in self.on_reads and len(batch):
            region = local[int(batch.dst_region[0])]
            if region.device != "cpu":
                raise NotImplementedError("FlipBit corrupts host memory only")
            if not 0 <= self.at < batch.total_bytes:
                raise ValueError(f"FlipBit: byte {self.at} is past the batch's {batch.total_bytes} bytes")
            byte = ctypes.c_uint8.from_address(region.addr + int(batch.dst_offset[0]) + self.at)
            byte.value ^= 0x01


class Slow(Delegating):
    """Completes reads number ``on_reads`` and then sleeps ``delay`` seconds before returning,
    the way a slow reader holds a slot (a publisher may overwrite it meanwhile)."""

    def __init__(self, inner: Transport, delay: float, on_reads: Sequence[int] = (1,)) -> None:
        super().__init__(inner)
        self.delay = delay
        self.on_reads = set(on_reads)
        self.reads = 0

    def read(self, prepared: Any, *, timeout: float) -> None:
        import time

        self.inner.read(prepared[0], timeout=timeout)
        self.reads += 1
        if self.reads in self.on_reads:
            time.sleep(min(self.delay, timeout))


def split_batch(batch: ReadBatch, at: int) -> tuple[ReadBatch, ReadBatch]:
    """The reads of ``batch`` before and after its byte ``at`` (in batch order); a read that
    straddles ``at`` is cut in two."""
    n = batch.nbytes
    start = np.cumsum(n) - n
    end = start + n
    head = start < at
    tail = end > at
    skip = np.clip(at - start, 0, None)[tail]
    first = ReadBatch(
        batch.src_region[head],
        batch.src_offset[head],
        batch.dst_region[head],
        batch.dst_offset[head],
        np.minimum(end[head], at) - start[head],
    )
    second = ReadBatch(
        batch.src_region[tail],
        batch.src_offset[tail] + skip,
        batch.dst_region[tail],
        batch.dst_offset[tail] + skip,
        n[tail] - skip,
    )
    return first, second


class Pause(Delegating):
    """Stops reads number ``on_reads`` (1-based, counting only the batches described below)
    half-way: the first half of the batch's bytes is read, a line is appended to ``signal_path``,
    then the read waits until ``release_path`` exists (or ``hold`` seconds, or the read's timeout)
    before reading the second half. Tests kill a peer or cut a link while a pull is stopped there;
    without ``release_path`` it is a reader that sleeps ``hold`` seconds between its ops. Only
    batches of ``min_ops`` to ``max_ops`` reads and at least ``min_bytes`` bytes count
    (``max_ops=1``: verification re-reads; ``min_bytes`` skips the few bytes of slot stamps)."""

    def __init__(
        self,
        inner: Transport,
        signal_path: str | None = None,
        release_path: str | None = None,
        hold: float = 60.0,
        on_reads: Sequence[int] = (1,),
        min_ops: int = 1,
        max_ops: int | None = None,
        min_bytes: int = 1024,
    ) -> None:
        super().__init__(inner)
        self.signal_path, self.release_path = signal_path, release_path
        self.hold = hold
        self.on_reads = set(on_reads)
        self.min_ops, self.max_ops, self.min_bytes = min_ops, max_ops, min_bytes
        self.reads = 0
        self._count = threading.Lock()  # sources are read from parallel threads

    def prepare(
        self, peer: Any, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> Any:
        halves = []
        if batch.total_bytes >= 2:  # both halves then hold at least one byte
            halves = [
                self.inner.prepare(peer, remote_regions, local_regions, b)
                for b in split_batch(batch, batch.total_bytes // 2)
            ]
        return (self.inner.prepare(peer, remote_regions, local_regions, batch), halves, batch)

    def read(self, prepared: Any, *, timeout: float) -> None:
        whole, halves, batch = prepared
        counted = self.min_ops <= len(batch) <= (self.max_ops or len(batch)) and batch.total_bytes >= self.min_bytes
        with self._count:
            if counted:
                self.reads += 1
            number = self.reads
        pause = counted and number in self.on_reads and len(halves) == 2
        if not pause:
            self.inner.read(whole, timeout=timeout)
            return
        deadline = time.monotonic() + timeout
        self.inner.read(halves[0], timeout=timeout)
        if self.signal_path:
            with open(self.signal_path, "a") as f:
                f.write(f"{os.getpid()} paused read {number} after {int(batch.total_bytes // 2)} bytes\n")
        until = min(deadline, time.monotonic() + self.hold)
        while time.monotonic() < until and not (self.release_path and os.path.exists(self.release_path)):
            time.sleep(min(0.01, max(0.0, until - time.monotonic())))
        self.inner.read(halves[1], timeout=max(0.001, deadline - time.monotonic()))

    def release(self, prepared: Any) -> None:
        whole, halves, _ = prepared
        for p in (whole, *halves):
            self.inner.release(p)


WRAPPERS = {"flip-bit": FlipBit, "slow": Slow, "pause": Pause}


def wrapper(kind: str, **kwargs: Any):
    """A transport wrapper for ``inject``: ``wrapper("slow", delay=2.0)``."""
    cls = WRAPPERS[kind]
    return lambda t: cls(t, **kwargs)


def inject(sub: Any, wrap: Any) -> Any:
    """Makes ``sub`` (a ``Subscriber``, before its first pull) open every transport through
    ``wrap(transport)``: fault injection for tests and the demo, kept out of the public signature.
    Returns ``sub``."""
    sub.transports.wrap(wrap)
    return sub


class FailConnect(Delegating):
    """``connect`` fails with ``TransportError`` when the wrapped transport is named ``only``
    (an unusable same-host path, say), to exercise fallback to the next transport."""

    def __init__(self, inner: Transport, only: str = "local") -> None:
        super().__init__(inner)
        self.only = only

    def connect(self, endpoint: bytes, *, timeout: float) -> Any:
        from transports.errors import TransportError

        if self.inner.name == self.only:
            raise TransportError(f"{self.only}: connect refused by fault injection")
        return self.inner.connect(endpoint, timeout=timeout)


WRAPPERS["fail-connect"] = FailConnect
