"""A relay: the serving side of a zone subscriber's staging buffer, and what it fetches for its zone.

A subscriber with ``zone=Zone(Z, relay=True)`` serves the version it is assembling or holds to the
subscribers of zone Z (``wbridge.pull.zone`` reads it): ``RelayServer`` is the buffer and a stamp
(``protocol.stamps``) registered with the subscriber's own transports, and a sealed record under
``Keys.zone_relay(Z, k)`` with the byte ranges of the buffer that hold version ``v`` and were checked.

``Fetcher`` is what crosses the link: a zone reader's reads of byte ranges of its buffer from the
publishers. A relay's own range (``Fetcher.start``, in a background thread) comes as deltas onto the
version the buffer holds where they can be used (the range widened to whole checksum chunks, the
session's reads clipped to it: ``Clipped``), announced once applied and checked; else in full, in
``OWN_CHUNKS`` chunks, each announced once its stamps (and, with ``verify``, checksums) are checked.
What peers did not bring comes the same way (``Fetcher.rest``). Every read from the publishers
fails over to replicas as a plain pull does.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._lifecycle import quietly
from .._selection import publisher_capabilities
from .._tensors import address, alloc_bytes
from ..errors import TransportError
from ..protocol import checksum as _checksum
from ..protocol.channel import ChannelStore
from ..protocol.records import b64
from ..protocol.stamps import STAMP_BYTES, STAMP_MAGIC, STAMP_STABLE, STAMP_WRITING
from ..protocol.version import VersionRecord
from . import delta as _delta
from .connect import failover
from .context import Attempt, PullContext, PullResult
from .ranges import Ranges, clip, part, union, widen
from .reads import check_stamps, read_sources, verify_sources
from .session import Session, SourcesFailed

log = logging.getLogger("wbridge")

ANN_KEEP = 64  # a relay deletes announcement keys older than this many announcements, this many at a time
OWN_CHUNKS = 4  # a relay announces its own range in this many chunks, as they arrive


class RelayServer:
    """The serving side of a relay: its buffer, stamp and record.

    - ``chan``: the channel's store, keys (of the generation joined) and token.
    - ``zone``: the zone it serves.
    - ``transports``: the subscriber's transports to serve on, by name (its buffer already registered).
    - ``regions``: each transport's registration of the buffer.
    - ``size``: the buffer's size in bytes.
    - ``layout``: the hash of the subscriber's layout (readers with another layout do not use it).
    - ``sub_id``, ``ttl``, ``name``: the subscriber's id (its lease key), lease ttl and name.
    """

    def __init__(
        self,
        chan: ChannelStore,
        zone: str,
        transports: dict[str, Any],
        regions: dict[str, Any],
        size: int,
        layout: str,
        sub_id: int,
        lease: str,
        ttl: float,
        name: str,
    ) -> None:
        self.chan, self.store, self.keys, self.zone = chan, chan.store, chan.keys, zone
        store, keys = chan.store, chan.keys
        self.transports, self.size, self.sub_id = transports, size, sub_id
        self.stamp = alloc_bytes(STAMP_BYTES, "cpu")
        self.stamp.numpy().view(np.uint64)[:] = (STAMP_MAGIC, 0, STAMP_WRITING, 0)
        self.stamp_regions: dict[str, Any] = {}
        served = {}
        for n, t in transports.items():
            self.stamp_regions[n] = r = t.register(address(self.stamp), STAMP_BYTES, device="cpu")
            served[n] = {"endpoint": b64(t.endpoint()), "regions": [[b64(regions[n].descriptor), b64(r.descriptor)]]}
        self.base = {
            "id": sub_id,
            "lease": lease,
            "ttl": ttl,
            "name": name,
            "layout": layout,
            "size": size,
            "caps": publisher_capabilities(list(transports)),
            "transports": served,
        }
        self.v = self.epoch = 0
        self.nonce = ""  # the version's nonce (``VersionRecord.identity``)
        self.held: Ranges = []
        self.lock = threading.Lock()
        self.key = keys.zone_relay(zone, store.add(keys.zone_count(zone), 1))
        self._write()

    def _write(self) -> None:
        rec = {**self.base, "v": self.v, "epoch": self.epoch, "nonce": self.nonce, "held": [list(r) for r in self.held]}
        self.chan.write(self.key, rec)

    def begin(self, identity: tuple[int, int, str]) -> None:
        """About to write the version of ``identity`` (``VersionRecord.identity``) into the buffer:
        withdraw what it held, then the stamp."""
        if identity == (self.v, self.epoch, self.nonce):
            return
        v, epoch, nonce = identity
        self.v, self.epoch, self.nonce, self.held = v, epoch, nonce, []
        self._write()
        self.stamp.numpy().view(np.uint64)[:] = (STAMP_MAGIC, v, STAMP_STABLE, epoch)

    def hold(self, ranges: Ranges, version: tuple[int, int, str] | None = None, wake: bool = True) -> None:
        """Announces that ``ranges`` of the buffer now hold the version begun (verified), unless
        another ``version`` (its identity) was begun since; called from the thread fetching its own
        range and the one reading peers. ``wake``: bytes new to the zone (from publishers) wake the
        zone's waiting readers; bytes read from peers do not (their owner's announcement did)."""
        with self.lock:
            if version is not None and version != (self.v, self.epoch, self.nonce):
                return
            self.held = union(self.held + list(ranges))
            self._write()
            if wake:
                self.announce()

    def announce(self) -> None:
        """Wakes the zone's readers blocked in ``ZonePeers.wait`` (once the record is written): the
        zone's next announcement key appears; each ``ANN_KEEP``-th deletes ``ANN_KEEP`` old ones."""
        keys, zone = self.keys, self.zone
        n = self.store.add(keys.zone_announced(zone), 1)
        self.store.set(keys.zone_announcement(zone, n), b"1")
        if n % ANN_KEEP == 0 and n >= 2 * ANN_KEEP:
            old = [keys.zone_announcement(zone, k) for k in range(n - 2 * ANN_KEEP + 1, n - ANN_KEEP + 1)]
            quietly(self.store.delete_many, old)

    def close(self) -> None:
        quietly(self.store.delete, self.key)
        self.stamp.numpy().view(np.uint64)[2] = STAMP_WRITING
        for n, r in self.stamp_regions.items():
            quietly(self.transports[n].deregister, r)
        self.stamp_regions = {}


@dataclass(frozen=True)
class Clipped:
    """A session's reads clipped to byte ranges of the buffer, to pull them as deltas (kept while the
    session and the ranges are: its delta geometry is computed once).

    - ``session``: the session it was clipped from.
    - ``ranges``: the ranges asked for.
    - ``wide``: those widened to whole checksum chunks (the check that follows reads none again).
    - ``clipped``: ``session`` with each source's reads clipped to ``wide`` (sources with none left out).
    """

    session: Session
    ranges: Ranges
    wide: Ranges
    clipped: Session


@dataclass(frozen=True)
class Own:
    """What a relay's own range took: the attempt (a new session after a failover), the bytes read
    from the publishers, the seconds, and the delta pull's result (None: read in full)."""

    attempt: Attempt
    nbytes: int
    seconds: float
    done: PullResult | None


class Fetcher:
    """A zone reader's reads of byte ranges of its buffer from the publishers.

    - ``ctx``: the subscriber's pull context.
    - ``zone``: its zone (in logs).
    - ``relay``: its ``RelayServer`` if it relays (what it fetches is announced there), else None.
    - ``pool``: the threads a relay's own range is fetched on.
    """

    def __init__(self, ctx: PullContext, zone: str, relay: RelayServer | None, pool: ThreadPoolExecutor) -> None:
        self.ctx, self.zone, self.relay, self.pool = ctx, zone, relay, pool
        self.clipped: Clipped | None = None  # the last ``plan``
        self.sums_of: tuple[int, int, str] | None = None  # the version whose publisher sums ``sums`` holds
        self.sums: dict = {}  # by rank, read once per version however many ranges are checked

    def start(self, a: Attempt, mine: Ranges) -> tuple[Future, Ranges]:
        """Fetches the relay's own range ``mine`` in the background (``own``): as deltas onto what
        the buffer holds where it can (the range widened to whole checksum chunks, checked without
        reading any of them again over the link), else in full. Returns the future of its ``Own``
        and the ranges it covers."""
        plan = self.plan(a, mine)
        mine = plan.wide if plan is not None else mine
        return self.pool.submit(self.own, a, mine, plan), mine

    def own(self, a: Attempt, mine: Ranges, plan: Clipped | None) -> Own:
        """A relay's own range ``mine``: as deltas with ``plan`` where they can be used, announced
        once applied and checked; else (no plan, or the deltas turn out unusable) in full, chunk by
        chunk from the publishers, each announced once checked. A failure is announced too (it
        wakes the zone reader waiting on its peers)."""
        t0, n, rec = time.monotonic(), 0, a.rec
        try:
            if plan is not None:
                done = self.deltas(plan, a)
                if done is not None:
                    self.hold(mine, rec.identity)
                    return Own(a, done.from_publishers, time.monotonic() - t0, done)
                log.info("subscriber %s: zone %s: deltas of version %d unusable; range in full", *self.who(rec))
            # fetched in the background, announced chunk by chunk: peers read the first chunks
            # from here while the later ones still cross the link
            for chunk in (c for r in mine for c in _split(r, max(1, OWN_CHUNKS // len(mine)))):
                a, k = self.full(a, [chunk])
                if self.ctx.verify:  # never serve bytes corrupted in flight (readers check them anyway)
                    self.verify(a, [chunk])
                n += k
                self.hold([chunk], rec.identity)
        except BaseException:
            if self.relay is not None:
                quietly(self.relay.announce)
            raise
        return Own(a, n, time.monotonic() - t0, None)

    def rest(self, a: Attempt, missing: Ranges) -> tuple[Attempt, PullResult | None, int]:
        """What peers did not bring: as deltas too where they can be used, else in full. The deltas
        are read for ``missing`` widened to whole checksum chunks, and they are byte differences: a
        byte a peer brought inside such a chunk gets its difference again, and like a byte a failed
        peer's read left wrong it fails the check and its chunk is read again. Returns the attempt,
        the delta pull's result (None: read in full) and the bytes read in full."""
        plan = self.plan(a, missing)
        done = self.deltas(plan, a) if plan is not None else None
        if done is not None:
            self.hold(plan.wide)
            return a, done, 0
        a, n = self.full(a, missing)
        self.hold(missing)
        return a, None, n

    def deltas(self, plan: Clipped, a: Attempt) -> PullResult | None:
        """The deltas since ``a.held`` of ``plan``'s reads applied to the buffer and checked
        (``wbridge.pull.delta``), then the publishers' stamps; None before any write where the
        deltas cannot be used."""
        clipped, rec = plan.clipped, a.rec
        try:
            done = _delta.pull(self.ctx, clipped, rec, a.held.v, a.deadline)
        except TransportError as e:  # (a source died mid-pull: the full read fails over)
            log.warning("subscriber %s: zone %s: delta pull of version %d failed (%s)", *self.who(rec), e)
            return None
        if done is not None:
            check_stamps(self.ctx, clipped.sources, rec.stamp, a.deadline)
        return done

    def plan(self, a: Attempt, ranges: Ranges) -> Clipped | None:
        """``a.session``'s reads clipped to ``ranges`` widened to whole checksum chunks, where
        ``a.rec`` can be pulled as deltas onto ``a.held``; else None."""
        rec, held, session = a.rec, a.held, a.session
        if held is None or (held.epoch, held.incs) != (rec.epoch, rec.incs) or not 0 < rec.v - held.v:
            return None
        kept = self.clipped
        if kept is None or kept.session is not session or kept.ranges != ranges:
            self.release()
            wide = widen([s.batch for s in session.sources], ranges, _checksum.CHUNK)
            sources = [replace(s, batch=clip(s.batch, wide), prepared={}, checks={}) for s in session.sources]
            sources = [s for s in sources if len(s.batch)]  # a source none of whose bytes are here
            clipped = replace(session, sources=sources, delta=None, closers=[])
            self.clipped = kept = Clipped(session, ranges, wide, clipped)
        if not kept.clipped.sources or not _delta.usable(self.ctx, kept.clipped, rec, held):
            return None
        return kept

    def full(self, a: Attempt, ranges: Ranges | None) -> tuple[Attempt, int]:
        """Reads the destination bytes ``ranges`` (None: all) from the publishers (the session's
        plan clipped to them) and checks their stamps; fails over to replicas as a plain pull does.
        Returns the attempt (a new session after a failover) and the bytes read."""
        ctx = self.ctx
        while True:
            parts = [
                replace(s, batch=s.batch if ranges is None else clip(s.batch, ranges), prepared={}, checks={})
                for s in a.session.sources
            ]
            try:
                read_sources(ctx, parts, a.rec.slot, a.deadline)
                break
            except SourcesFailed as failed:
                a = replace(a, session=failover(ctx, a.session, failed, a.deadline))
            finally:
                for s in parts:
                    for prep in s.prepared.values():
                        quietly(ctx.endpoints[s.transport].release, prep)
        check_stamps(ctx, a.session.sources, a.rec.stamp, a.deadline)
        return a, sum(s.batch.total_bytes for s in parts)

    def verify(self, a: Attempt, ranges: Ranges | None) -> None:
        """Checks the destination's bytes ``ranges`` (None: all) against the publishers' chunk sums
        (``IntegrityError``); the zone reader reads relays only where the publishers keep them."""
        parts = [s if ranges is None else replace(s, batch=clip(s.batch, ranges)) for s in a.session.sources]
        if self.sums_of != a.rec.identity:  # each version's sums are read once, however many ranges
            self.sums_of, self.sums = a.rec.identity, {}
        # a range checks the chunks it holds whole; the chunks at its edges are checked once the
        # whole buffer is in: re-reading them from publishers would cross the link
        verify_sources(self.ctx, parts, a.rec, a.deadline, self.sums, partial=ranges is None)

    def hold(self, ranges: Ranges, version: tuple[int, int, str] | None = None) -> None:
        """Announces ``ranges`` on the relay, if it relays (``RelayServer.hold``)."""
        if self.relay is not None and ranges:
            self.relay.hold(ranges, version)

    def who(self, rec: VersionRecord) -> tuple[str, str, int]:
        return self.ctx.name, self.zone, rec.v

    def release(self) -> None:
        """Releases what the last ``plan`` holds (its delta scratch buffers)."""
        kept, self.clipped = self.clipped, None
        if kept is not None:
            for close in kept.clipped.closers:
                quietly(close)


def _split(r: tuple[int, int], n: int) -> Ranges:
    """Range ``r`` in ``n`` near-equal pieces (boundaries ``ALIGN``ed from its start)."""
    lo, hi = r
    return [(lo + a, lo + b) for a, b in (part(hi - lo, j, n) for j in range(n)) if b > a]


__all__ = ["ANN_KEEP", "OWN_CHUNKS", "Clipped", "Fetcher", "Own", "RelayServer"]
