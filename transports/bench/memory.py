"""The bench's memory: the region a server serves and the destination a client reads into, in host
memory or on a CUDA device, and the known bytes (a seeded pattern) a client checks what it read against.

The pattern is ``transports._serve``'s: a random block of ``PATTERN_PERIOD`` bytes (a prime) made
from the seed, repeated from offset 0 of the region, so any range can be produced or checked alone
and a block landing at a wrong offset shows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._serve import PATTERN_PERIOD, region_bytes

CHUNK = 64 << 20  # bytes filled or checked at a time (a bounded temporary, also on a device)


def pattern(seed: int, offset: int, nbytes: int) -> np.ndarray:
    """The pattern's bytes ``[offset, offset + nbytes)``."""
    block = region_bytes(PATTERN_PERIOD, seed)
    return np.resize(np.roll(block, -(offset % PATTERN_PERIOD)), nbytes)


def check_device(device: str) -> str:
    """``cpu`` or ``cuda:N`` (``cuda`` means ``cuda:0``); ``ValueError`` for anything else."""
    if device == "cpu":
        return device
    kind, _, index = device.partition(":")
    if kind == "cuda" and (index == "" or index.isdigit()):
        return f"cuda:{index or 0}"
    raise ValueError(f"a device is cpu or cuda:N, not {device!r}")


class Buffer:
    """``nbytes`` of memory at ``addr``, on ``device``; ``close()`` frees it (idempotent).

    - ``nbytes``: its size.
    - ``device``: ``cpu`` or ``cuda:N``.
    - ``host_buffer``: for ``cpu``, a writable buffer to use (a transport's ``host_buffer``), or None
      for fresh memory.
    """

    def __init__(self, nbytes: int, device: str = "cpu", host_buffer: Any = None) -> None:
        self.nbytes, self.device = nbytes, check_device(device)
        self._owner: Any = host_buffer
        if self.device == "cpu":
            if host_buffer is not None:
                self._host = np.frombuffer(host_buffer, dtype=np.uint8, count=nbytes)
            else:
                self._host = np.empty(nbytes, dtype=np.uint8)
            self.addr = self._host.ctypes.data
        else:
            import torch

            self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.addr = self._dev.data_ptr()

    def _chunks(self, lo: int, hi: int | None) -> list[tuple[int, int]]:
        hi = self.nbytes if hi is None else hi
        return [(a, min(a + CHUNK, hi)) for a in range(lo, hi, CHUNK)]

    def _write(self, a: int, data: np.ndarray) -> None:
        if self.device == "cpu":
            self._host[a : a + len(data)] = data
        else:
            import torch

            self._dev[a : a + len(data)].copy_(torch.from_numpy(data))

    def _read(self, a: int, b: int) -> np.ndarray:
        if self.device == "cpu":
            return self._host[a:b]
        return self._dev[a:b].cpu().numpy()

    def fill_pattern(self, seed: int, lo: int = 0, hi: int | None = None) -> None:
        """Writes the pattern of ``seed`` into ``[lo, hi)`` (the bytes the region holds there)."""
        for a, b in self._chunks(lo, hi):
            self._write(a, pattern(seed, a, b - a))

    def fill_byte(self, byte: int, lo: int = 0, hi: int | None = None) -> None:
        """Writes ``byte`` everywhere in ``[lo, hi)`` (so a read that lands nothing shows)."""
        for a, b in self._chunks(lo, hi):
            self._write(a, np.full(b - a, byte, dtype=np.uint8))

    def check(self, seed: int, lo: int = 0, hi: int | None = None) -> bool:
        """Whether ``[lo, hi)`` holds the pattern of ``seed`` there."""
        return all(np.array_equal(self._read(a, b), pattern(seed, a, b - a)) for a, b in self._chunks(lo, hi))

    def close(self) -> None:
        self._host = self._dev = None
        self._owner = None

    def __repr__(self) -> str:
        return f"Buffer({self.nbytes} bytes on {self.device} at {self.addr:#x})"
