"""Zones and relays: each version crosses the link between clusters once, not once per replica.

A subscriber with ``zone=Z, relay=True`` (always staged) serves its staging buffer, the version it
is assembling or holds, to subscribers of zone Z. ``RelayServer`` is that serving side: the buffer
and a stamp (``protocol.stamps``: magic, version, state, epoch) registered with the subscriber's
own served transports (tcp and local by default, bound to its ``host``), and a sealed record under
``Keys.zone_relay(Z, k)``: its layout hash, endpoints, region descriptors, the version ``v`` it holds
and ``held``, the byte ranges of its buffer that hold ``v`` and were verified.

``ZoneReader.read`` replaces a zone subscriber's publisher reads of one version:

1. A version held whole by relays of Z with the same layout (same bytes at the same offsets) is read
   from them, split evenly.
2. Otherwise the live relays of Z with that layout split the buffer into equal byte ranges (ordered
   by relay record): relay i of N reads range i from the publishers (the publisher plan clipped to
   it) in a background thread, in ``OWN_CHUNKS`` chunks, and announces each chunk once the
   publishers' stamps are checked; a non-relay subscriber reads no range.
3. Meanwhile each reads the ranges it misses from the peers that announce them, as they appear,
   checking each peer's stamp after the data; in between it blocks on the store until a relay of
   the zone announces more (``RelayServer.announce``, ``ZoneReader.wait``). Once its own range is
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
elsewhere. A peer that fails at the transport is dropped for the pull. Readers never read another
zone's relays (the zone is part of the key) and use publishers whatever the publishers' zone.
Relays whose lease lapsed are skipped and their record deleted by whoever sees it first (and by
publisher rank 0 with the subscriber's keys).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import transports as _transports
from planner.builder import build_plan
from planner.errors import PlanError
from planner.layout import RankLayout
from planner.plan import Plan
from transports.base import ReadBatch

from .._lifecycle import quietly
from .._selection import candidates
from ..errors import IntegrityError, StaleVersionError, StoreError, TransportError, WaitTimeout
from ..protocol import checksum as _checksum
from ..protocol.keys import COUNTER_JUMP_MAX, COUNTER_WINDOW
from . import delta as _delta
from .connect import failover
from .context import Held, PullContext, PullResult
from .ranges import Ranges, clip, part, subtract, union, widen
from .reads import check_stamps, read_sources, verify_sources
from .relay import RelayServer
from .session import Session, Source, SourcesFailed, connect_source

log = logging.getLogger("wbridge")

RELAY_TRANSPORTS = ("tcp", "local")  # what a relay serves by default (the subscriber's own transports)
RELAY_SHARE = 0.5  # of the time left: what reads from relays may take before publishers stand in
DISTRUST_S = 30.0  # a relay that was slow, frozen or served bad bytes is not read for this long
STALL_MIN_S = 1.0  # a reader waits at least this long without progress before going to publishers
OWN_CHUNKS = 4  # a relay announces its own range in this many chunks, as they arrive


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


class _Stamped:
    """What ``check_stamps`` compares a relay's stamp with: version ``v`` of ``epoch`` (slot 0)."""

    slot = 0

    def __init__(self, v: int, epoch: int) -> None:
        self.v, self.epoch = v, epoch


class ZoneReader:
    """A zone subscriber's reads of one version through the relays of its zone (and publishers).

    - ``ctx``: the subscriber's pull context (store, keys, transports, destination, name).
    - ``zone``: its zone.
    - ``relay``: its ``RelayServer`` if it relays, else None.
    - ``layout``: the hash of its layout; ``size``: its staging buffer's size (None: not staged).
    """

    def __init__(self, ctx: PullContext, zone: str, relay: RelayServer | None, layout: str, size: int | None) -> None:
        self.ctx, self.zone, self.relay, self.layout, self.size = ctx, zone, relay, layout, size
        self.announced = 0  # the zone's announcement counter, read before the records by scan()
        self.absent: dict[int, float] = {}  # record number -> when first found missing
        self.counted = 0  # the zone's relay counter as of the last scan
        self.skipped: list[tuple[int, int]] = []  # record numbers of forged jumps, not looked at
        self.peers: dict[str, tuple[tuple, Source]] = {}  # record key -> (endpoints, connection)
        self.plan: tuple[tuple, Plan] | None = None  # a foreign layout's plan over full relays, by relays
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="wbridge-zone")
        self.distrusted: dict[str, float] = {}  # relay record key -> until when it is not read
        self.sums: tuple[Any, dict] = (None, {})  # (version identity, publisher sums by rank) read
        self.clipped: tuple | None = None  # (session, own range, widened, clipped session): ``_delta_plan``

    # -- the zone's relays ---------------------------------------------------------------------
    def scan(self) -> list[Peer]:
        """The zone's live relays (itself aside); deletes the records of dead ones."""
        ctx = self.ctx
        store, keys = ctx.store, ctx.keys
        # the announcement counter before the records: every announcement up to it is in them
        counters = store.get_many([keys.zone_count(self.zone), keys.zone_announced(self.zone)])
        count, self.announced = (_int(x) for x in counters)
        now = time.monotonic()
        nums = [k for k in self._numbers(count) if now - self.absent.get(k, now) < 10.0]
        rkeys = [keys.zone_relay(self.zone, k) for k in nums]
        found = []
        for k, key, raw in zip(nums, rkeys, store.get_many(rkeys)):
            if raw is None:
                self.absent.setdefault(k, now)
                continue
            self.absent.pop(k, None)
            if self.relay is not None and key == self.relay.key:
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

    # -- one version ---------------------------------------------------------------------------
    def read(self, session: Any, rec: Any, held: Held | None, deadline: float) -> tuple[Any, PullResult]:
        """Fills the staging buffer with version ``rec``; ``held``: the version the buffer holds
        whole before (deltas apply onto it), if any. Returns the session (a new one after a
        publisher failover) and what was read (bytes from publishers, from relays, deltas). The
        caller checks the publishers' stamps afterwards as usual."""
        start = time.monotonic()
        if self.relay is not None:
            self.relay.begin(rec.identity)
        everyone = self.scan()
        peers = [p for p in everyone if p.layout == self.layout and int(p.record.get("size", -1)) == self.size]
        if self.relay is None and not peers:  # no relay with this layout: plan over full relays
            return self._planned(everyone, session, rec, held, deadline)
        whole = [(0, self.size)]
        missing: Ranges = whole if self.size else []
        from_pub = from_peers = 0
        full = [p for p in peers if p.identity == rec.identity and not subtract(whole, list(p.held))]
        own = None
        if self.relay is not None and not full and missing:
            group = sorted([self.relay.key, *(p.key for p in peers)], key=_number)
            mine = [part(self.size, group.index(self.relay.key), len(group))]
            # as deltas onto the version the buffer holds where it can: the range is widened to
            # whole checksum chunks, checked without reading any of them again over the link
            plan = self._delta_plan(session, rec, held, mine)
            mine = plan[0] if plan is not None else mine
            own = self.pool.submit(self._own, session, rec, mine, plan, held, deadline)
            missing = subtract(missing, mine)
        # A relay waits for its peers' ranges until they make no progress for twice the time its
        # own range took (a peer died or is stuck); a subscriber that relays nothing waits while
        # some relay works on the version. Neither waits past half the pull's timeout.
        give_up = start + (deadline - start) / 2
        try:
            missing, from_peers = self._complete(own, session, peers, rec, missing, give_up)
        finally:
            if own is not None:
                own.exception()  # never leave it writing into the buffer once this returns
        used: list[PullResult] = []
        if own is not None:
            session, n, _, done = own.result()
            from_pub += n
            used += [done] if done is not None else []
        rest = 0
        if missing:
            # what peers did not bring: as deltas too where they can be used (deltas hold the new
            # words, so bytes a peer brought already stay right; bytes a failed peer read left
            # wrong fail the check and are read again), else in full
            plan = self._delta_plan(session, rec, held, missing)
            done = self._own_deltas(plan[1], rec, held, deadline) if plan is not None else None
            if done is not None:
                from_pub += done.from_publishers
                used.append(done)
                self._hold(plan[0])
            else:
                session, rest = self._from_publishers(session, rec, missing, deadline)
                from_pub += rest
                self._hold(missing)
        # deltas: the caller checks nothing more, so bytes read in full from publishers are too
        unchecked = from_peers > 0 or bool(used and rest and self.ctx.verify)
        session, from_pub, from_peers = self._checked(session, rec, from_pub, from_peers, unchecked, deadline)
        ops = len(session.plan) + sum(u.ops for u in used)
        return session, PullResult(from_pub, from_peers, ops, sum(u.repaired for u in used), delta=bool(used))

    def _checked(
        self, session: Any, rec: Any, from_pub: int, from_peers: int, unchecked: bool, deadline: float
    ) -> tuple[Any, int, int]:
        """The whole buffer checked once it is in (the chunks at the ranges' edges included) where
        some of it is ``unchecked``; bytes that fail are read again from the publishers, every relay
        of this pull distrusted."""
        if not unchecked:
            return session, from_pub, from_peers
        try:
            self._verify(session, rec, None, deadline)
        except IntegrityError as e:
            log.warning("subscriber %s: zone %s relays served bad bytes (%s); publishers", self.ctx.name, self.zone, e)
            for key in list(self.peers):
                self._distrust(key)
            session, n = self._from_publishers(session, rec, None, deadline)
            from_pub, from_peers = from_pub + n, 0
        return session, from_pub, from_peers

    def _complete(
        self, own: Any, session: Any, peers: list[Peer], rec: Any, missing: Ranges, give_up: float
    ) -> tuple[Ranges, int]:
        """Reads what peers announce of ``missing`` until nothing is missing, the peers stall or
        ``give_up``; returns what is still missing and the bytes read from peers."""
        last, seen, stall = time.monotonic(), None, STALL_MIN_S
        failed: set[str] = set()
        from_peers = 0
        while missing and peers:
            if own is not None and own.done() and own.exception() is not None:
                break  # raised below
            got, gone = self._from_peers(session, peers, rec, missing, failed, give_up)
            failed |= gone
            if got:
                from_peers += sum(b - a for a, b in got)
                missing = subtract(missing, got)
                self._hold(got, wake=False)
                continue
            now = time.monotonic()
            state = {(p.key, p.v, p.held) for p in peers}
            if state != seen:
                last, seen = now, state
            if own is not None and not own.done():
                last = now  # the stall clock starts once its own range is in
            elif own is not None:
                stall = max(STALL_MIN_S, 2.0 * own.result()[2])
            busy = self.relay is None and any(p.identity == rec.identity for p in peers)
            if now > give_up or (now - last > stall and not busy):
                log.warning("subscriber %s: zone %s relays stalled; rest from publishers", self.ctx.name, self.zone)
                break
            due = give_up if busy or (own is not None and not own.done()) else min(give_up, last + stall)
            self.wait(min(max(0.001, due - now), STALL_MIN_S))
            peers = [p for p in self.scan() if p.key not in failed and p.layout == self.layout]
        return missing, from_peers

    def wait(self, timeout: float) -> None:
        """Blocks in the store (TCPStore wait, etcd watch) until the zone's announcement after the
        last ``scan`` (at once if made since; one deleted before the wait costs ``timeout``)."""
        ctx = self.ctx
        try:
            ctx.store.wait(ctx.keys.zone_announcement(self.zone, self.announced + 1), timeout)
        except WaitTimeout:
            pass

    def _own(
        self, session: Any, rec: Any, mine: Ranges, plan: tuple | None, held: Held | None, deadline: float
    ) -> tuple[Any, int, float, PullResult | None]:
        """A relay's own range ``mine``: as deltas onto ``held`` with ``plan`` (``_delta_plan``) where
        they can be used, announced once applied and checked; else (no plan, or the deltas turn
        out unusable) in full, chunk by chunk from the publishers, each announced once checked. A
        failure is announced too (it wakes ``_complete``). Returns the session, bytes read from
        publishers, seconds taken and the delta pull's result (None: read in full)."""
        t0, n = time.monotonic(), 0
        try:
            if plan is not None:
                done = self._own_deltas(plan[1], rec, held, deadline)
                if done is not None:
                    self._hold(mine, rec.identity)
                    return session, done.from_publishers, time.monotonic() - t0, done
                log.info("subscriber %s: zone %s: deltas of version %d unusable; range in full", *self._who(rec))
            # fetched in the background, announced chunk by chunk: peers read the first chunks
            # from here while the later ones still cross the link
            for chunk in (c for r in mine for c in _split(r, max(1, OWN_CHUNKS // len(mine)))):
                session, k = self._from_publishers(session, rec, [chunk], deadline)
                if self.ctx.verify:  # never serve bytes corrupted in flight (readers check them anyway)
                    self._verify(session, rec, [chunk], deadline)
                n += k
                self._hold([chunk], rec.identity)
        except BaseException:
            if self.relay is not None:
                quietly(self.relay.announce)
            raise
        return session, n, time.monotonic() - t0, None

    def _who(self, rec: Any) -> tuple[str, str, int]:
        return self.ctx.name, self.zone, rec.v

    def _own_deltas(self, clipped: Session, rec: Any, held: Held, deadline: float) -> PullResult | None:
        """The deltas since ``held`` of ``clipped``'s reads applied to the buffer and checked
        (``wbridge.pull.delta``), then the publishers' stamps; None before any write where the
        deltas cannot be used."""
        try:
            done = _delta.pull(self.ctx, clipped, rec, held.v, deadline)
        except TransportError as e:  # (a source died mid-pull: the full read fails over)
            log.warning("subscriber %s: zone %s: delta pull of version %d failed (%s)", *self._who(rec), e)
            return None
        if done is not None:
            check_stamps(self.ctx, clipped.sources, rec, deadline)
        return done

    def _delta_plan(self, session: Session, rec: Any, held: Held | None, mine: Ranges) -> tuple | None:
        """``(ranges, clipped session)``: ``mine`` widened to whole checksum chunks and the session's
        reads clipped to them, where ``rec`` can be pulled as deltas onto ``held``; else None.
        Kept while the session and ``mine`` are (its delta geometry is computed once)."""
        if held is None or (held.epoch, held.incs) != (rec.epoch, rec.incs) or not 0 < rec.v - held.v:
            return None
        kept = self.clipped
        if kept is None or kept[0] is not session or kept[1] != mine:
            self._release_clipped()
            wide = widen([s.batch for s in session.sources], mine, _checksum.CHUNK)
            sources = [replace(s, batch=clip(s.batch, wide), prepared={}) for s in session.sources]
            sources = [s for s in sources if len(s.batch)]  # a source none of whose bytes are here
            clipped = replace(session, sources=sources, delta=None, closers=[])
            self.clipped = kept = (session, mine, wide, clipped)
        if not kept[3].sources or not _delta.usable(self.ctx, kept[3], rec, held):
            return None
        return kept[2], kept[3]

    def _release_clipped(self) -> None:
        """Releases what the clipped session of ``_delta_plan`` holds (its delta scratch buffers)."""
        kept, self.clipped = self.clipped, None
        if kept is not None:
            for close in kept[3].closers:
                quietly(close)

    def _verify(self, session: Any, rec: Any, ranges: Ranges | None, deadline: float) -> None:
        """Checks the destination's bytes ``ranges`` (None: all) against the publishers' chunk sums
        (``IntegrityError``); ``read`` reads relays only where the publishers keep them."""
        parts = [s if ranges is None else replace(s, batch=clip(s.batch, ranges)) for s in session.sources]
        if self.sums[0] != rec.identity:  # each version's sums are read once, however many ranges
            self.sums = (rec.identity, {})
        # a range checks the chunks it holds whole; the chunks at its edges are checked once the
        # whole buffer is in (``_checked``): re-reading them from publishers would cross the link
        verify_sources(self.ctx, parts, rec, deadline, self.sums[1], partial=ranges is None)

    def _hold(self, ranges: Ranges, version: tuple[int, int, str] | None = None, wake: bool = True) -> None:
        if self.relay is not None and ranges:
            self.relay.hold(ranges, version, wake)

    def _planned(
        self, peers: list[Peer], session: Any, rec: Any, held: Held | None, deadline: float
    ) -> tuple[Any, PullResult]:
        """A subscriber whose layout no relay has: the planner's reads from the relays that hold
        version ``rec`` whole (any layouts: one more source each), else from the publishers (as
        deltas onto ``held`` where they can be used)."""
        full = [p for p in peers if p.identity == rec.identity]
        full = sorted((p for p in full if not subtract([(0, int(p.record["size"]))], list(p.held))), key=_number_of)
        if full:
            # a frozen relay must not take the pull's whole timeout: publishers get the rest
            share = time.monotonic() + max(0.0, deadline - time.monotonic()) * RELAY_SHARE
            try:
                n = self._from_full(full, rec, share)
                self._verify(session, rec, None, deadline)  # relays are peers: checked, every byte
                return session, PullResult(0, n, len(self.plan[1]) if self.plan else 0)
            except (TransportError, StaleVersionError, StoreError, PlanError, IntegrityError, WaitTimeout) as e:
                log.warning(
                    "subscriber %s: reading zone %s relays failed (%s); publishers", self.ctx.name, self.zone, e
                )
                for p in full:
                    self._distrust(p.key)
        elif _delta.usable(self.ctx, session, rec, held):  # nothing written yet: the buffer holds ``held``
            try:
                done = _delta.pull(self.ctx, session, rec, held.v, deadline)
            except TransportError as e:  # a source died mid-pull: the full read below fails over
                log.warning("subscriber %s: zone %s: delta pull of version %d failed (%s)", *self._who(rec), e)
                done = None
            if done is not None:
                return session, done
        session, n = self._from_publishers(session, rec, None, deadline)
        return session, PullResult(n, 0, len(session.plan))

    def _from_full(self, full: list[Peer], rec: Any, deadline: float) -> int:
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
            src = self._connect(full[s.src_rank], deadline)
            batch = ReadBatch(s.src_region, s.src_offset, s.dst_region, s.dst_offset, s.nbytes)
            jobs.append((src, self.pool.submit(self._read_peer, src, batch, deadline)))
        errors = [f.exception() for _, f in jobs]  # every read over (each bounded) before any error
        for e in errors:
            if e is not None:
                raise e
        for src, _ in jobs:
            check_stamps(ctx, [src], _Stamped(rec.v, rec.epoch), deadline, self.pool)
        return self.plan[1].total_bytes

    def _from_publishers(self, session: Any, rec: Any, ranges: Ranges | None, deadline: float) -> tuple[Any, int]:
        """Reads the destination bytes ``ranges`` (None: all) from the publishers (the session's
        plan clipped to them) and checks their stamps; fails over to replicas as a plain pull does."""
        ctx = self.ctx
        while True:
            parts = [
                replace(s, batch=s.batch if ranges is None else clip(s.batch, ranges), prepared={})
                for s in session.sources
            ]
            try:
                read_sources(ctx, parts, rec.slot, deadline)
                break
            except SourcesFailed as failed:
                session = failover(ctx, session, failed, deadline)
            finally:
                for s in parts:
                    for prep in s.prepared.values():
                        quietly(ctx.endpoints[s.transport].release, prep)
        check_stamps(ctx, session.sources, rec, deadline)
        return session, sum(s.batch.total_bytes for s in parts)

    def _connect(self, peer: Peer, deadline: float) -> Source:
        local = self.ctx.endpoints
        d = peer.record
        ends = tuple(sorted((n, x["endpoint"]) for n, x in d["transports"].items()))
        known = self.peers.get(peer.key)
        if known is not None and known[0] == ends:
            return known[1]
        if known is not None:
            self._drop(peer.key)
        options = candidates(local.preference, local.caps, d["caps"])
        src, _ = connect_source(-peer.id, d, ReadBatch.of([]), options, local.open, deadline, self.ctx.name)
        self.peers[peer.key] = (ends, src)
        return src

    def _from_peers(
        self, session: Any, peers: list[Peer], rec: Any, missing: Ranges, failed: set[str], deadline: float
    ) -> tuple[Ranges, set[str]]:
        """Reads what ``peers`` announce of ``missing``, spread evenly over the peers that hold each
        piece, within ``deadline`` (half the pull's: a frozen peer leaves time for publishers);
        returns the ranges read and checked, and the peers that failed."""
        holders = [p for p in peers if p.identity == rec.identity and p.key not in failed and p.held]
        if not holders:
            return [], set()
        cuts = sorted({x for p in holders for r in p.held for x in r} | {x for r in missing for x in r})
        load: dict[str, int] = {p.key: 0 for p in holders}
        work: dict[str, Ranges] = {p.key: [] for p in holders}
        for a, b in zip(cuts, cuts[1:]):
            if subtract([(a, b)], missing):
                continue  # not missing (cut points are the union of both sides' boundaries)
            cand = [p.key for p in holders if not subtract([(a, b)], list(p.held))]
            n = len(cand)
            for i in range(n):  # split each piece over its holders, the least loaded first
                lo, hi = part(b - a, i, n)
                k = min(cand, key=lambda c: load[c])
                cand.remove(k)
                if hi > lo:
                    load[k] += hi - lo
                    work[k].append((a + lo, a + hi))
        by_key = {p.key: p for p in holders}
        got: Ranges = []
        gone: set[str] = set()
        jobs = {}
        for k, w in work.items():
            if not w:
                continue
            try:  # connecting here, not in the pool: it may open this side's transport
                src = self._connect(by_key[k], deadline)
            except (TransportError, StoreError) as e:
                self._failed(k, e, gone)
                continue
            batch = ReadBatch.of([(0, a, 0, a, b - a) for a, b in union(w)])
            jobs[k] = (src, self.pool.submit(self._read_peer, src, batch, deadline))
        for k, (src, f) in jobs.items():
            try:
                f.result()
                # the stamp after the data: the peer still holds version v (it withdrew nothing)
                check_stamps(self.ctx, [src], _Stamped(rec.v, rec.epoch), deadline, self.pool)
                self._verify(session, rec, union(work[k]), deadline)  # relays are peers: always checked
                got += work[k]
            except (TransportError, StaleVersionError, IntegrityError) as e:
                self._failed(k, e, gone)
        return union(got), gone

    def _failed(self, key: str, e: Exception, gone: set[str]) -> None:
        log.warning("subscriber %s: relay %s failed (%s); its bytes come from elsewhere", self.ctx.name, key, e)
        self._distrust(key)
        gone.add(key)

    def _distrust(self, key: str) -> None:
        """Not read for ``DISTRUST_S`` (slow, frozen or wrong): its connection is dropped."""
        self.distrusted = {k: t for k, t in self.distrusted.items() if t > time.monotonic()}
        self.distrusted[key] = time.monotonic() + DISTRUST_S
        self._drop(key)

    def _read_peer(self, src: Source, batch: ReadBatch, deadline: float) -> None:
        """Posts ``batch`` from a relay's buffer (its stamp is checked next)."""
        ends = self.ctx.endpoints
        t = ends[src.transport]
        prep = t.prepare(src.peer, src.regions[0], ends.regions(src.transport), batch)
        try:
            t.read(prep, timeout=max(0.1, deadline - time.monotonic()))
        finally:
            quietly(t.release, prep)

    def _drop(self, key: str) -> None:
        known = self.peers.pop(key, None)
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
        self._release_clipped()
        for key in list(self.peers):
            self._drop(key)
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
        server = RelayServer(m.chan, zone, served, regions, size, layout, m.id, m.ttl, ctx.name)
        m.announce(m.layout, server.key)
    return ZoneReader(ctx, zone, server, layout, size)


def _int(raw: bytes | None) -> int:
    """A counter's value; a malformed one (any store client can write it) counts as 0."""
    try:
        return max(0, int(raw or 0))
    except ValueError:
        return 0


def _split(r: tuple[int, int], n: int) -> Ranges:
    """Range ``r`` in ``n`` near-equal pieces (boundaries ``ALIGN``ed from its start)."""
    lo, hi = r
    return [(lo + a, lo + b) for a, b in (part(hi - lo, j, n) for j in range(n)) if b > a]


def _number(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


def _number_of(peer: Peer) -> int:
    return _number(peer.key)


__all__ = ["RELAY_TRANSPORTS", "STALL_MIN_S", "Peer", "ZoneReader", "join_zone"]
