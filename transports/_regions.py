"""The serving side's table of registered regions, for the two-sided transports (tcp, nccl).

A region in use by a read (a DATA frame or a send being posted from it) is counted; ``remove``
stops new reads of a region at once and waits until the reads in flight are done, so its memory
may be reused as soon as ``deregister`` returns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import TransportError


@dataclass(eq=False)
class Served:
    """A served region: its size, its start address, what the transport sends from, and its device."""

    nbytes: int
    addr: int = 0
    handle: Any = None
    device: str = "cpu"
    users: int = 0


class RegionTable:
    """Registered regions by id; ``kind`` names the transport in errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._regions: dict[int, Served] = {}
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._regions)

    def __contains__(self, rid: int) -> bool:
        return rid in self._regions

    def add(self, rid: int, entry: Served) -> None:
        with self._cond:
            self._regions[rid] = entry

    def remove(self, rid: int, timeout: float) -> None:
        """Stops serving ``rid``; waits up to ``timeout`` for the reads still using it."""
        with self._cond:
            entry = self._regions.pop(rid, None)
            if entry is not None and not self._cond.wait_for(lambda: entry.users == 0, timeout):
                raise TransportError(f"{self.kind}: region {rid} still being sent after {timeout}s")

    def acquire(self, ids: np.ndarray) -> tuple[list[Served] | None, str]:
        """The regions named by ``ids`` (unique), each marked in use; or ``None`` and why."""
        with self._cond:
            out = []
            for rid in ids.tolist():
                entry = self._regions.get(rid)
                if entry is None:
                    return None, f"region {rid} is not registered"
                out.append(entry)
            for entry in out:
                entry.users += 1
            return out, ""

    def release(self, entries: list[Served]) -> None:
        with self._cond:
            for entry in entries:
                entry.users -= 1
            self._cond.notify_all()
