"""Zones and relays: each version crosses the link between clusters once, not once per replica.

A subscriber with ``zone=Z, relay=True`` (always staged) serves its staging buffer, the version it
is assembling or holds, to subscribers of zone Z. ``RelayServer`` (``wbridge.pull.relay``) is that
serving side: the buffer
and a stamp (``protocol.stamps``: magic, version, state, epoch) registered with the subscriber's
own served transports (tcp and local by default, bound to its ``host``), and a sealed record under
``Keys.zone_relay(Z, k)``: its layout hash, endpoints, region descriptors, the version ``v`` it holds
and ``held``, the byte ranges of its buffer that hold ``v`` and were verified.

``ZoneReader.read`` replaces a zone subscriber's publisher reads of one version (its relays as it sees
them: ``wbridge.pull.peers``; what it reads from the publishers: ``relay.Fetcher``):

1. A version held whole by relays of Z with the same layout (same bytes at the same offsets) is read
   from them, split evenly.
2. Otherwise the live relays of Z with that layout split the buffer into equal byte ranges (ordered
   by relay record): relay i of N reads range i from the publishers (the publisher plan clipped to
   it) in a background thread, in ``relay.OWN_CHUNKS`` chunks, and announces each chunk once the
   publishers' stamps are checked; a non-relay subscriber reads no range.
3. Meanwhile each reads the ranges it misses from the peers that announce them, as they appear,
   checking each peer's stamp after the data; in between it blocks on the store until a relay of
   the zone announces more (``RelayServer.announce``, ``ZonePeers.wait``). Once its own range is
   in, after twice the time that took without progress (at least ``STALL_MIN_S``: a relay died or
   is stuck), or halfway to the pull's deadline, the rest comes from the publishers.

Deltas across the link. Where the publishers encode deltas and a relay's buffer holds a version
``a`` whole (its last pull succeeded) that the deltas can bring to ``v`` (``wbridge.pull.delta``:
same epoch and packing, ``v - a`` within the ring), the relay reads its range as deltas: the
session's plan clipped to the range widened to whole checksum chunks (``ranges.widen``: the check
that follows re-reads nothing over the link), applied onto its buffer by ``delta.pull`` (which
checks every chunk and repairs what does not match), the publishers' stamps checked, then
announced in one piece. Readers still read whole ranges from relays (bytes inside the zone).
Ranges a relay still misses when its peers stall come as deltas too: the buffer holds ``a`` there,
delta entries carry the new words (bytes a peer already brought stay right) and bytes a failed
peer read left wrong fail the check and are read again. A relay that cannot (a new relay, one
further behind than the ring, deltas that turn out unusable) reads its range in full, as above.
A zone subscriber with no relay to read from takes deltas from the publishers as a plain
subscriber does. ``PullStats.delta`` says whether a pull applied deltas.

A subscriber with a layout no relay of Z has (not staged, another TP, fused tensors) plans with the
planner against the relays of Z that hold the version whole, their layouts as one more set of
sources (balanced over them as replicas), and reads the publishers if there are none or that fails.

Exactness. Every range announced was read and checked before it was announced (with ``verify=True``
and publisher checksums, also against the checksums; a peer whose bytes fail them is dropped).
Before a relay writes a new version into its buffer it withdraws its ranges (``held = []``) and sets
its stamp to the new version; a reader reads the stamp after the data and drops ranges whose stamp
does not say "version v, stable, epoch e" (the seqlock of publisher slots), re-reading them
elsewhere. A peer that fails at the transport, is slow or serves bad bytes is not read for
``peers.DISTRUST_S``. Readers never read another
zone's relays (the zone is part of the key) and use publishers whatever the publishers' zone.
Relays whose lease lapsed are skipped and their record deleted by whoever sees it first (and by
publisher rank 0 with the subscriber's keys).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import transports as _transports
from planner.builder import build_plan
from planner.errors import PlanError
from planner.layout import RankLayout
from planner.plan import Plan
from transports.base import ReadBatch

from .._deadline import Deadline
from ..errors import IntegrityError, StaleVersionError, StoreError, TransportError, WaitTimeout
from ..protocol.stamps import Stamp
from ..protocol.version import VersionRecord
from . import delta as _delta
from .context import Attempt, PullContext, PullResult
from .peers import Peer, ZonePeers, number
from .ranges import Ranges, part, subtract, union
from .reads import check_stamps
from .relay import Fetcher, RelayServer

log = logging.getLogger("wbridge")

RELAY_TRANSPORTS = ("tcp", "local")  # what a relay serves by default (the subscriber's own transports)
RELAY_SHARE = 0.5  # of the time left: what reads from relays may take before publishers stand in
STALL_MIN_S = 1.0  # a reader waits at least this long without progress before going to publishers


class ZoneReader:
    """A zone subscriber's reads of one version through the relays of its zone (and publishers).

    - ``ctx``: the subscriber's pull context (store, keys, transports, destination, name).
    - ``zone``: its zone.
    - ``relay``: its ``RelayServer`` if it relays, else None.
    - ``layout``: the hash of its layout; ``size``: its staging buffer's size (None: not staged).
    """

    def __init__(self, ctx: PullContext, zone: str, relay: RelayServer | None, layout: str, size: int | None) -> None:
        self.ctx, self.zone, self.relay, self.layout, self.size = ctx, zone, relay, layout, size
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="wbridge-zone")
        self.peers = ZonePeers(ctx, zone, relay.key if relay is not None else None)
        self.fetch = Fetcher(ctx, zone, relay, self.pool)  # what comes from the publishers
        self.plan: tuple[tuple, Plan] | None = None  # a foreign layout's plan over full relays, by relays

    def read(self, a: Attempt) -> tuple[Attempt, PullResult]:
        """Fills the staging buffer with version ``a.rec`` (deltas apply onto ``a.held``, the version
        the buffer holds whole, if any). Returns the attempt (a new session after a publisher
        failover) and what was read (bytes from publishers, from relays, deltas). The caller checks
        the publishers' stamps afterwards as usual."""
        rec = a.rec
        # A relay waits for its peers' ranges until they make no progress for twice the time its
        # own range took (a peer died or is stuck); a subscriber that relays nothing waits while
        # some relay works on the version. Neither waits past half the pull's timeout.
        give_up = a.deadline.share(0.5)
        if self.relay is not None:
            self.relay.begin(rec.identity)
        everyone = self.peers.scan()
        peers = [p for p in everyone if p.layout == self.layout and int(p.record.get("size", -1)) == self.size]
        if self.relay is None and not peers:  # no relay with this layout: plan over full relays
            return self._planned(everyone, a)
        whole = [(0, self.size)]
        missing: Ranges = whole if self.size else []
        from_pub = from_peers = rest = 0
        full = [p for p in peers if p.identity == rec.identity and not subtract(whole, list(p.held))]
        own = None
        if self.relay is not None and not full and missing:
            group = sorted([self.relay.key, *(p.key for p in peers)], key=number)
            own, mine = self.fetch.start(a, [part(self.size, group.index(self.relay.key), len(group))])
            missing = subtract(missing, mine)
        try:
            missing, from_peers = self._complete(own, a, peers, missing, give_up)
        finally:
            if own is not None:
                own.exception()  # never leave it writing into the buffer once this returns
        used: list[PullResult] = []
        if own is not None:
            got = own.result()
            a, from_pub = got.attempt, from_pub + got.nbytes
            used += [got.done] if got.done is not None else []
        if missing:  # what peers did not bring
            a, done, rest = self.fetch.rest(a, missing)
            from_pub += rest + (done.from_publishers if done is not None else 0)
            used += [done] if done is not None else []
        # deltas: the caller checks nothing more, so bytes read in full from publishers are too
        unchecked = from_peers > 0 or bool(used and rest and self.ctx.verify)
        a, from_pub, from_peers = self._checked(a, from_pub, from_peers, unchecked)
        ops = len(a.session.plan) + sum(u.ops for u in used)
        return a, PullResult(from_pub, from_peers, ops, sum(u.repaired for u in used), delta=bool(used))

    def _checked(self, a: Attempt, from_pub: int, from_peers: int, unchecked: bool) -> tuple[Attempt, int, int]:
        """The whole buffer checked once it is in (the chunks at the ranges' edges included) where
        some of it is ``unchecked``; bytes that fail are read again from the publishers, every relay
        of this pull distrusted."""
        if not unchecked:
            return a, from_pub, from_peers
        try:
            self.fetch.verify(a, None)
        except IntegrityError as e:
            log.warning("subscriber %s: zone %s relays served bad bytes (%s); publishers", self.ctx.name, self.zone, e)
            self.peers.distrust_connected()
            a, n = self.fetch.full(a, None)
            from_pub, from_peers = from_pub + n, 0
        return a, from_pub, from_peers

    def _complete(
        self, own: Future | None, a: Attempt, peers: list[Peer], missing: Ranges, give_up: Deadline
    ) -> tuple[Ranges, int]:
        """Reads what peers announce of ``missing`` until nothing is missing, the peers stall or
        ``give_up``; returns what is still missing and the bytes read from peers."""
        last, seen, stall = time.monotonic(), None, STALL_MIN_S
        failed: set[str] = set()
        from_peers = 0
        while missing and peers:
            if own is not None and own.done() and own.exception() is not None:
                break  # raised below
            got, gone = self._from_peers(a, peers, missing, failed, give_up)
            failed |= gone
            if got:
                from_peers += sum(hi - lo for lo, hi in got)
                missing = subtract(missing, got)
                if self.relay is not None:  # (read from peers: their owner's announcement woke the zone)
                    self.relay.hold(got, wake=False)
                continue
            now = time.monotonic()
            state = {(p.key, p.v, p.held) for p in peers}
            if state != seen:
                last, seen = now, state
            if own is not None and not own.done():
                last = now  # the stall clock starts once its own range is in
            elif own is not None:
                stall = max(STALL_MIN_S, 2.0 * own.result().seconds)
            busy = self.relay is None and any(p.identity == a.rec.identity for p in peers)
            if now > give_up.at or (now - last > stall and not busy):
                log.warning("subscriber %s: zone %s relays stalled; rest from publishers", self.ctx.name, self.zone)
                break
            due = give_up.at if busy or (own is not None and not own.done()) else min(give_up.at, last + stall)
            self.peers.wait(min(max(0.001, due - now), STALL_MIN_S))
            peers = [p for p in self.peers.scan() if p.key not in failed and p.layout == self.layout]
        return missing, from_peers

    def _planned(self, peers: list[Peer], a: Attempt) -> tuple[Attempt, PullResult]:
        """A subscriber whose layout no relay has: the planner's reads from the relays that hold
        version ``a.rec`` whole (any layouts: one more source each), else from the publishers (as
        deltas onto ``a.held`` where they can be used)."""
        rec = a.rec
        full = [p for p in peers if p.identity == rec.identity]
        full = sorted((p for p in full if not subtract([(0, int(p.record["size"]))], list(p.held))), key=_number_of)
        if full:
            try:  # a frozen relay must not take the pull's whole timeout: publishers get the rest
                n = self._from_full(full, rec, a.deadline.share(RELAY_SHARE))
                self.fetch.verify(a, None)  # relays are peers: checked, every byte
                return a, PullResult(0, n, len(self.plan[1]) if self.plan else 0)
            except (TransportError, StaleVersionError, StoreError, PlanError, IntegrityError, WaitTimeout) as e:
                log.warning(
                    "subscriber %s: reading zone %s relays failed (%s); publishers", self.ctx.name, self.zone, e
                )
                for p in full:
                    self.peers.distrust(p.key)
        elif _delta.usable(self.ctx, a.session, rec, a.held):  # nothing written yet: the buffer holds ``held``
            try:
                done = _delta.pull(self.ctx, a.session, rec, a.held.v, a.deadline)
            except TransportError as e:  # a source died mid-pull: the full read below fails over
                log.warning("subscriber %s: zone %s: delta pull of version %d failed (%s)", *self.fetch.who(rec), e)
                done = None
            if done is not None:
                return a, done
        a, n = self.fetch.full(a, None)
        return a, PullResult(n, 0, len(a.session.plan))

    def _from_full(self, full: list[Peer], rec: VersionRecord, deadline: Deadline) -> int:
        ctx = self.ctx
        key = tuple((p.key, p.layout) for p in full)
        if self.plan is None or self.plan[0] != key:
            layouts = []
            for i, p in enumerate(full):
                lk = ctx.keys.reader_layout(p.layout)
                raw = ctx.store.get(lk)
                if raw is None:
                    raise StoreError(f"relay {p.key}: its layout {p.layout} is not in the store")
                layouts.append(replace(RankLayout.from_dict(ctx.chan.open(lk, raw)), rank=i))
            self.plan = (key, build_plan(layouts, ctx.dest.layout))
        jobs = []
        for s in self.plan[1].sources:
            src = self.peers.connect(full[s.src_rank], deadline)
            batch = ReadBatch(s.src_region, s.src_offset, s.dst_region, s.dst_offset, s.nbytes)
            jobs.append((src, self.pool.submit(self.peers.read, src, batch, deadline)))
        errors = [f.exception() for _, f in jobs]  # every read over (each bounded) before any error
        for e in errors:
            if e is not None:
                raise e
        for src, _ in jobs:
            check_stamps(ctx, [src], _relay_stamp(rec), deadline, self.pool)
        return self.plan[1].total_bytes

    def _from_peers(
        self, a: Attempt, peers: list[Peer], missing: Ranges, failed: set[str], deadline: Deadline
    ) -> tuple[Ranges, set[str]]:
        """Reads what ``peers`` announce of ``missing``, spread evenly over the peers that hold each
        piece, within ``deadline`` (half the pull's: a frozen peer leaves time for publishers);
        returns the ranges read and checked, and the peers that failed."""
        rec = a.rec
        holders = [p for p in peers if p.identity == rec.identity and p.key not in failed and p.held]
        if not holders:
            return [], set()
        cuts = sorted({x for p in holders for r in p.held for x in r} | {x for r in missing for x in r})
        load: dict[str, int] = {p.key: 0 for p in holders}
        work: dict[str, Ranges] = {p.key: [] for p in holders}
        for start, end in zip(cuts, cuts[1:]):
            if subtract([(start, end)], missing):
                continue  # not missing (cut points are the union of both sides' boundaries)
            cand = [p.key for p in holders if not subtract([(start, end)], list(p.held))]
            n = len(cand)
            for i in range(n):  # split each piece over its holders, the least loaded first
                lo, hi = part(end - start, i, n)
                k = min(cand, key=lambda c: load[c])
                cand.remove(k)
                if hi > lo:
                    load[k] += hi - lo
                    work[k].append((start + lo, start + hi))
        by_key = {p.key: p for p in holders}
        got: Ranges = []
        gone: set[str] = set()
        jobs = {}
        for k, w in work.items():
            if not w:
                continue
            try:  # connecting here, not in the pool: it may open this side's transport
                src = self.peers.connect(by_key[k], deadline)
            except (TransportError, StoreError) as e:
                self.peers.failed(k, e, gone)
                continue
            batch = ReadBatch.of([(0, lo, 0, lo, hi - lo) for lo, hi in union(w)])
            jobs[k] = (src, self.pool.submit(self.peers.read, src, batch, deadline))
        for k, (src, f) in jobs.items():
            try:
                f.result()
                # the stamp after the data: the peer still holds version v (it withdrew nothing)
                check_stamps(self.ctx, [src], _relay_stamp(rec), deadline, self.pool)
                self.fetch.verify(a, union(work[k]))  # relays are peers: always checked
                got += work[k]
            except (TransportError, StaleVersionError, IntegrityError) as e:
                self.peers.failed(k, e, gone)
        return union(got), gone

    def close(self) -> None:
        self.fetch.release()
        self.peers.close()
        self.pool.shutdown(wait=False)
        if self.relay is not None:
            self.relay.close()


def join_zone(ctx: PullContext, zone: str, relay: bool, layout: str) -> ZoneReader:
    """The zone reader of a subscriber (layout hash ``layout``); a relay (staged: its buffer is
    ``ctx.dest.buffers[0]``) serves its buffer on tcp and local (or on its one chosen transport) and
    names its record in its subscriber record (collected with it)."""
    dest = ctx.dest
    size = int(dest.buffers[0].numel()) if dest.staged else None
    server = None
    if relay:
        ends, m = ctx.endpoints, ctx.member
        names = [n for n in RELAY_TRANSPORTS if n in _transports.available()]
        names = names if ends.preference == "auto" else [ends.preference]
        served = {n: ends.open(n) for n in names}
        regions = {n: ends.regions(n)[0] for n in names}
        server = RelayServer(m.chan, zone, served, regions, size, layout, m.id, m.lease.key, m.ttl, ctx.name)
        m.announce(m.layout, server.key)
    return ZoneReader(ctx, zone, server, layout, size)


def _relay_stamp(rec: VersionRecord) -> Stamp:
    """What a relay's stamp says while its buffer holds ``rec``'s version: its one buffer is slot 0."""
    return Stamp(rec.v, rec.epoch)


def _number_of(peer: Peer) -> int:
    return peer.number


__all__ = ["RELAY_SHARE", "RELAY_TRANSPORTS", "STALL_MIN_S", "ZoneReader", "join_zone"]
