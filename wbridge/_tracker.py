"""Publisher side of the control plane: which subscribers are live and what they have acked."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .protocol.keys import Keys
from .protocol.records import open_sealed
from .store import Store


@dataclass
class SubscriberView:
    """What a publisher knows of one subscriber."""

    id: int
    ttl: float
    name: str = ""
    dead: bool = False
    layout: str = ""  # hash of its announced layout (``_packing.announce``)


@dataclass
class SubscriberTracker:
    """Scans the subscriber list and tells which are live and what they acked (publisher side).
    Thread-safe: a background publish and the caller's ``subscribers()``/``wait_acked()`` may scan
    at once, and a scan updates ``known`` and the store's lease clock, so one scan at a time."""

    store: Store
    keys: Keys
    token: bytes | None
    known: dict[int, SubscriberView] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def live(self) -> list[SubscriberView]:
        with self.lock:
            return self._scan()

    def _scan(self) -> list[SubscriberView]:
        n = self.store.get_int(self.keys.subs)
        for i in range(1, n + 1):
            if i in self.known:
                continue
            raw = self.store.get(self.keys.sub(i))
            if raw is None:  # counter bumped, record not written yet
                continue
            try:
                d = open_sealed(self.token, self.keys.sub(i), raw)
                self.known[i] = SubscriberView(
                    i, float(d["ttl"]), str(d.get("name", "")), layout=str(d.get("layout", ""))
                )
            except Exception:  # noqa: BLE001 - an unsigned or forged subscriber is ignored
                self.known[i] = SubscriberView(i, 0.0, "<rejected>", dead=True)
        out = []
        for view in self.known.values():
            if view.dead:
                continue
            if not self.store.is_alive(self.keys.sub(view.id, "live"), view.ttl):
                view.dead = True  # a subscriber that comes back registers under a new id
                continue
            out.append(view)
        return out

    def acked(self, view: SubscriberView) -> int:
        return self.store.get_int(self.keys.sub(view.id, "acked"))

    def reading(self, view: SubscriberView) -> int:
        return self.store.get_int(self.keys.sub(view.id, "reading"))

    def wait(self, pred, timeout: float, what: str) -> None:
        """Waits until ``pred(view)`` holds for every live subscriber (re-scanned each poll)."""

        def probe():
            return True if all(pred(s) for s in self.live()) else None

        Store.wait_until(probe, timeout, what, poll=0.001, max_poll=0.02)


def now() -> float:
    return time.time()
