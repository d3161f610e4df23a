"""The relays of a zone as one of its readers sees them: their records, connections, reads, distrust.

``ZonePeers.scan`` reads the zone's relay records (numbered 1 .. the zone's relay counter, in one
batched read, then their leases in another), leaving out the reader's own, those distrusted lately
and those whose lease lapsed (their records are deleted by whoever sees them first). Any store
client can write the counter: the numbers of a forged jump of it are passed over (logged once).
``ZonePeers.wait`` blocks on the store until a relay announces more (``RelayServer.announce``).

A relay is connected to on first read (``connect``: the best transport both sides have, its stamp
registered as a publisher's is) and again when its record names other endpoints. One that fails at
the transport, is slow or frozen, or serves bad bytes is distrusted for ``DISTRUST_S``: its
connection is dropped and scans leave it out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from transports.base import ReadBatch

from .._deadline import Deadline
from .._lifecycle import quietly
from .._selection import candidates
from ..errors import WaitTimeout
from ..protocol.keys import COUNTER_JUMP_MAX, COUNTER_WINDOW
from .context import PullContext
from .session import Source, connect_source

log = logging.getLogger("wbridge")

DISTRUST_S = 30.0  # a relay that was slow, frozen or served bad bytes is not read for this long
ABSENT_S = 10.0  # a relay number whose record stays missing this long is looked at no more


@dataclass(frozen=True)
class Peer:
    """A live relay of the zone as its record says."""

    key: str
    id: int
    layout: str
    v: int
    epoch: int
    nonce: str
    held: tuple[tuple[int, int], ...]
    record: dict

    @property
    def identity(self) -> tuple[int, int, str]:
        """The version it holds (``VersionRecord.identity``)."""
        return self.v, self.epoch, self.nonce

    @property
    def number(self) -> int:
        """Its relay number in the zone (the order relays split the buffer in)."""
        return number(self.key)


class ZonePeers:
    """The relays of a zone, for one reader of it.

    - ``ctx``: the reader's pull context (store, keys, transports, name).
    - ``zone``: the zone.
    - ``own``: the reader's own relay record key (a relay never reads itself), or None.
    """

    def __init__(self, ctx: PullContext, zone: str, own: str | None) -> None:
        self.ctx, self.zone, self.own = ctx, zone, own
        self.announced = 0  # the zone's announcement counter, read before the records by scan()
        self.absent: dict[int, float] = {}  # record number -> when first found missing
        self.counted = 0  # the zone's relay counter as of the last scan
        self.skipped: list[tuple[int, int]] = []  # record numbers of forged jumps, not looked at
        self.connected: dict[str, tuple[tuple, Source]] = {}  # record key -> (endpoints, connection)
        self.distrusted: dict[str, float] = {}  # relay record key -> until when it is not read

    def scan(self) -> list[Peer]:
        """The zone's live relays (the reader's own aside); deletes the records of dead ones."""
        ctx = self.ctx
        store, keys = ctx.store, ctx.keys
        # the announcement counter before the records: every announcement up to it is in them
        counters = store.get_many([keys.zone_count(self.zone), keys.zone_announced(self.zone)])
        count, self.announced = (_int(x) for x in counters)
        now = time.monotonic()
        nums = [k for k in self._numbers(count) if now - self.absent.get(k, now) < ABSENT_S]
        rkeys = [keys.zone_relay(self.zone, k) for k in nums]
        found = []
        for k, key, raw in zip(nums, rkeys, store.get_many(rkeys)):
            if raw is None:
                self.absent.setdefault(k, now)
                continue
            self.absent.pop(k, None)
            if key == self.own:
                continue
            if self.distrusted.get(key, 0.0) > now:
                continue  # slow, frozen or wrong lately: read elsewhere
            try:
                d = ctx.chan.open(key, raw)
                found.append((key, d, str(d["lease"]), float(d["ttl"])))
            except Exception:  # noqa: BLE001 - an unsigned or malformed record is no relay
                continue
        leases = store.get_many([lease for _, _, lease, _ in found]) if found else []
        out = []
        for (key, d, lease, ttl), value in zip(found, leases):
            if not lease.startswith(keys.p) or not store.judge_alive(lease, value, ttl):
                quietly(store.delete, key)  # collected by whoever sees it dead first
                continue
            held = tuple((int(a), int(b)) for a, b in d.get("held", []))
            nonce = str(d.get("nonce", ""))
            out.append(Peer(key, int(d["id"]), str(d["layout"]), int(d["v"]), int(d["epoch"]), nonce, held, d))
        return out

    def _numbers(self, count: int) -> list[int]:
        """The relay record numbers to look at: 1 .. ``count`` but those of a forged jump of the
        counter (any store client can write it: by more than ``COUNTER_JUMP_MAX`` since the last
        scan), logged once; relays numbered after it (its newest ``COUNTER_WINDOW``) and after a
        repair (the counter went back) are looked at."""
        if count < self.counted:  # repaired: the numbers of a forged jump are given out again
            self.skipped = []
        elif count - self.counted > COUNTER_JUMP_MAX:
            log.warning(
                "subscriber %s: zone %s relay counter jumped from %d to %d: ignoring the numbers between",
                self.ctx.name,
                self.zone,
                self.counted,
                count,
            )
            self.skipped.append((self.counted + 1, count - COUNTER_WINDOW))
        self.counted = count
        nums: list[int] = []
        lo = 1
        for a, b in sorted(self.skipped):
            nums += range(lo, min(a, count + 1))
            lo = max(lo, b + 1)
        return nums + list(range(lo, count + 1))

    def wait(self, timeout: float) -> None:
        """Blocks in the store (TCPStore wait, etcd watch) until the zone's announcement after the
        last ``scan`` (at once if made since; one deleted before the wait costs ``timeout``)."""
        ctx = self.ctx
        try:
            ctx.store.wait(ctx.keys.zone_announcement(self.zone, self.announced + 1), timeout)
        except WaitTimeout:
            pass

    def connect(self, peer: Peer, deadline: Deadline) -> Source:
        """The connection to ``peer`` (made on first use, and again when its endpoints changed)."""
        local = self.ctx.endpoints
        d = peer.record
        ends = tuple(sorted((n, x["endpoint"]) for n, x in d["transports"].items()))
        known = self.connected.get(peer.key)
        if known is not None and known[0] == ends:
            return known[1]
        if known is not None:
            self.drop(peer.key)
        options = candidates(local.preference, local.caps, d["caps"])
        src, _ = connect_source(-peer.id, d, ReadBatch.of([]), options, local.open, deadline, self.ctx.name)
        self.connected[peer.key] = (ends, src)
        return src

    def read(self, src: Source, batch: ReadBatch, deadline: Deadline) -> None:
        """Posts ``batch`` from a relay's buffer (its stamp is checked next)."""
        ends = self.ctx.endpoints
        t = ends[src.transport]
        prep = t.prepare(src.peer, src.regions[0], ends.regions(src.transport), batch)
        try:
            t.read(prep, timeout=deadline.left(0.1))
        finally:
            quietly(t.release, prep)

    def failed(self, key: str, e: Exception, gone: set[str]) -> None:
        """Relay ``key`` failed this pull (``e``): distrusted, and added to ``gone``."""
        log.warning("subscriber %s: relay %s failed (%s); its bytes come from elsewhere", self.ctx.name, key, e)
        self.distrust(key)
        gone.add(key)

    def distrust(self, key: str) -> None:
        """Not read for ``DISTRUST_S`` (slow, frozen or wrong): its connection is dropped."""
        self.distrusted = {k: t for k, t in self.distrusted.items() if t > time.monotonic()}
        self.distrusted[key] = time.monotonic() + DISTRUST_S
        self.drop(key)

    def distrust_connected(self) -> None:
        """Every relay connected to is distrusted (bytes from one of them failed a whole-buffer check)."""
        for key in list(self.connected):
            self.distrust(key)

    def drop(self, key: str) -> None:
        known = self.connected.pop(key, None)
        if known is None:
            return
        src = known[1]
        t = self.ctx.endpoints.get(src.transport)
        if t is None:
            return
        for prep in src.stamp_prepared.values():
            quietly(t.release, prep)
        if src.stamp_region is not None:
            quietly(t.deregister, src.stamp_region)
        quietly(t.disconnect, src.peer)

    def close(self) -> None:
        for key in list(self.connected):
            self.drop(key)


def number(key: str) -> int:
    """The relay number in a relay record key (``Keys.zone_relay``)."""
    return int(key.rsplit("/", 1)[1])


def _int(raw: bytes | None) -> int:
    """A counter's value; a malformed one (any store client can write it) counts as 0."""
    try:
        return max(0, int(raw or 0))
    except ValueError:
        return 0


__all__ = ["DISTRUST_S", "Peer", "ZonePeers", "number"]
