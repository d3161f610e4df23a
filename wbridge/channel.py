"""Store keys of a channel and the records publishers and subscribers exchange through them.

Layout of a channel ``c`` (all records sealed with the token, see ``records``)::

    wb/c/reg                    registration counter; epoch = (count - 1) // world_size + 1
    wb/c/e/<e>/r/<rank>         publisher rank record: layout, world size, host, served transports
    wb/c/version                the newest committed version's record (v, epoch, slot, fence)
    wb/c/v/<v>/e/<e>/snap       how many publisher ranks of epoch e snapshotted v; the last commits
    wb/c/v/<v>/sum/<rank>       per-rank chunk checksums of v (when enabled)
    wb/c/slot/<s>/fence         bumped by every rank before it overwrites slot s
    wb/c/subs                   subscriber counter; subscriber ids are 1, 2, ...
    wb/c/sub/<i>                subscriber record;  .../live lease, .../acked, .../reading
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .errors import StoreError
from .records import open_sealed, seal
from .store import Store


class Keys:
    def __init__(self, channel: str) -> None:
        if not channel or "/" in channel:
            raise ValueError(f"channel name {channel!r} must be non-empty and contain no '/'")
        self.p = f"wb/{channel}/"

    reg = property(lambda self: self.p + "reg")
    version = property(lambda self: self.p + "version")
    subs = property(lambda self: self.p + "subs")

    def rank(self, epoch: int, rank: int) -> str:
        return f"{self.p}e/{epoch}/r/{rank}"

    def snap(self, v: int, epoch: int) -> str:
        # per epoch: ranks that died half-way through publishing v must not count toward the
        # commit of the v that their restarted selves publish in the next epoch
        return f"{self.p}v/{v}/e/{epoch}/snap"

    def sums(self, v: int, rank: int) -> str:
        return f"{self.p}v/{v}/sum/{rank}"

    def fence(self, slot: int) -> str:
        return f"{self.p}slot/{slot}/fence"

    def sub(self, i: int, what: str = "") -> str:
        return f"{self.p}sub/{i}" + (f"/{what}" if what else "")


@dataclass(frozen=True)
class VersionRecord:
    v: int
    epoch: int
    slot: int
    fence: int
    world_size: int
    zero_copy: bool
    checksums: bool
    committed_at: float

    @classmethod
    def read(cls, store: Store, keys: Keys, token: bytes | None) -> "VersionRecord | None":
        raw = store.get(keys.version)
        if raw is None:
            return None
        d = open_sealed(token, keys.version, raw)
        try:
            return cls(**d)
        except TypeError as e:
            raise StoreError(f"malformed version record: {e}") from None

    def write(self, store: Store, keys: Keys, token: bytes | None) -> None:
        store.set(keys.version, seal(token, keys.version, self.__dict__))


@dataclass
class SubscriberView:
    """What a publisher knows of one subscriber."""

    id: int
    ttl: float
    name: str = ""
    dead: bool = False


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
                self.known[i] = SubscriberView(i, float(d["ttl"]), str(d.get("name", "")))
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
