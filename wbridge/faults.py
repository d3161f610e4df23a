"""Fault injection for tests and drills: transport wrappers that misbehave on purpose."""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

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

    def prepare(self, peer: Any, remote_regions: Sequence[bytes], local_regions: Sequence[Region],
                batch: ReadBatch) -> Any:
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
    """Flips one bit of the first byte of the first read, on reads number ``on_reads`` (1-based),
    counting only batches of at least ``min_ops`` reads (to skip verification re-reads, say)."""

    def __init__(self, inner: Transport, on_reads: Sequence[int] = (1,), min_ops: int = 1) -> None:
        super().__init__(inner)
        self.on_reads = set(on_reads)
        self.min_ops = min_ops
        self.reads = 0

    def read(self, prepared: Any, *, timeout: float) -> None:
        inner, local, batch = prepared
        self.inner.read(inner, timeout=timeout)
        if len(batch) < self.min_ops:
            return
        self.reads += 1
        if self.reads in self.on_reads and len(batch):
            region = local[int(batch.dst_region[0])]
            if region.device != "cpu":
                raise NotImplementedError("FlipBit corrupts host memory only")
            byte = ctypes.c_uint8.from_address(region.addr + int(batch.dst_offset[0]))
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


WRAPPERS = {"flip-bit": FlipBit, "slow": Slow}


def wrapper(kind: str, **kwargs: Any):
    """A ``transport_wrapper`` for ``Subscriber``: ``wrapper("slow", delay=2.0)``."""
    cls = WRAPPERS[kind]
    return lambda t: cls(t, **kwargs)
