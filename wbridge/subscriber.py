"""Subscriber: a rollout worker's side of a channel.

Call protocol::

    sub = Subscriber("policy", store="tcp://127.0.0.1:29700", token="secret")
    sub.register({"qkv": (buf, Fused(0, [...])), ...})   # joins the channel; counts as live from here
    v = sub.pull(timeout=60.0)          # newest committed version, applied to the registered tensors
    v = await sub.pull_async()          # the same from an asyncio loop
    sub.close()                         # idempotent; also a context manager

A pull plans once per publisher epoch (layouts change only when publishers re-register) and then
replays the plan: one batch of one-sided reads per publisher rank, all ranks in parallel. Reads land
straight in the registered tensors, or with ``staged=True`` in a private buffer that is copied in
only after every read succeeded. A failed pull leaves ``version`` as ``None`` (live tensors hold no
complete version) unless staged, where the live tensors keep the last complete version. A source
rank that dies is read around (its DP replicas hold the same bytes). A pull that finds the store
lost (a new store generation) or its own lease lapsed first joins the channel again, under a new id.
Where publishers encode deltas (``Publisher(delta=True)``) and the destination holds a recent
version whole, a pull reads only what changed since, and always verifies it against the
publishers' checksums, repairing what does not match (``wbridge._delta_pull``; ``stats.last.delta``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import transports as _transports
from planner.builder import build_plan
from planner.layout import Declaration, RankLayout
from transports import select as _select
from transports.base import ReadBatch

from . import _generation, _validate
from ._delta_pull import DeltaReader
from ._lifecycle import Closeable, quietly
from ._membership import NEW_GENERATION, STILL, Membership
from ._packing import layout_hash, packed_layout
from ._reads import check_stamps, read_sources, verify_sources
from ._relay import ZoneReader, join_zone
from ._selection import candidates
from ._session import Session, Source, SourcesFailed, connect_source, failed_sources, replan
from ._stats import PullStats, SubscriberStats
from ._tensors import address, alloc_bytes, build_layout, byte_view, commit_pairs
from ._tracker import state_bytes
from .errors import (
    IntegrityError,
    StaleVersionError,
    StoreError,
    TransportError,
    UsageError,
    WaitTimeout,
)
from .protocol.keys import Keys
from .protocol.records import open_sealed
from .protocol.version import VersionRecord
from .store import DEFAULT_CONNECT_TIMEOUT, Store, open_store

log = logging.getLogger("wbridge")

# A pull waiting for a version blocks on its ``ready`` key in slices this long, re-reading the version
# record in between (a zero-copy version fenced off, or a key collected before the wait began: that
# takes slots + 2 commits within one round trip).
VERSION_WAIT_SLICE_S = 30.0


class Subscriber(Closeable):
    """A rollout worker's side of a channel; see the module docstring for the call protocol.

    - ``channel``: the channel name (non-empty, no ``/``), as the publishers named it.
    - ``store``: the metadata store URL (``tcp://host:port`` or ``etcd://host:port[,...]``) or a ``Store``.
    - ``token``: the channel's shared secret (checks store records, authenticates to publishers).
    - ``transport``: ``"auto"`` (best common transport per publisher rank, see ``transports.select``) or a name.
    - ``staged``: read into a private buffer and copy in only after every read succeeded.
    - ``verify``: check each pull against the publishers' chunk checksums (where they publish them;
      delta pulls always check them).
    - ``connect_timeout``: seconds to wait for the store when opening it.
    - ``lease_ttl``: seconds without a lease refresh after which publishers stop waiting for it.
    - ``name``: shown to publishers and in errors, matched by ``Publisher.evict`` (default ``<hostname>:<pid>``).
    - ``host``: the address transports bind and advertise (loopback by default).
    - ``transport_options``: per-transport constructor keywords, ``{"tcp": {...}}``.
    - ``zone``: the zone (cluster) it runs in; it reads from its zone's relays first and from
      publishers what they lack (``wbridge._relay``). None (default): every byte from publishers.
    - ``relay``: serve the version it holds to its zone (implies ``staged=True``; needs ``zone``).
    """

    def __init__(
        self,
        channel: str,
        store: str | Store = "tcp://127.0.0.1:29700",
        *,
        token: str | bytes | None = None,
        transport: str = "auto",
        staged: bool = False,
        verify: bool = False,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        lease_ttl: float = 10.0,
        name: str | None = None,
        host: str = "127.0.0.1",
        transport_options: Mapping[str, Mapping[str, Any]] | None = None,
        zone: str | None = None,
        relay: bool = False,
    ) -> None:
        self.zone, self.relay = _validate.zone(zone, f"subscriber {name}"), bool(relay)
        if self.relay and self.zone is None:
            raise UsageError(f"subscriber {name}: relay=True needs a zone (zone='...')")
        staged = staged or self.relay  # a relay serves its staging buffer
        lease_ttl = _validate.timeout(lease_ttl, "lease_ttl", positive=True)
        connect_timeout = _validate.timeout(connect_timeout, "connect_timeout", positive=True)
        self.channel, self.staged, self.verify = channel, staged, verify
        self.preference, self.host, self.lease_ttl = transport, host, lease_ttl
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.token = _validate.token(token)
        keys = Keys(channel)
        self.version: int | None = None
        self.stats = SubscriberStats()
        self._closed = False
        self._lock = threading.Lock()
        self._pull_lock = threading.Lock()
        self._transport_options = transport_options or {}
        # wraps each transport this subscriber opens; set only by wbridge.testing.faults.inject
        self._wrapper: Callable[[_transports.Transport], _transports.Transport] | None = None
        self._transports: dict[str, _transports.Transport] = {}
        self._local_regions: dict[str, list[Any]] = {}
        self._session: Session | None = None
        self._zone: ZoneReader | None = None
        self._deltas = DeltaReader()  # delta pulls (publishers with delta=True), see wbridge._delta_pull
        self._held: tuple | None = None  # (version, epoch, packing gens) the destination holds whole
        self._layout: RankLayout | None = None
        self._live: dict[str, Any] = {}
        self._dest: list[Any] = []  # destination buffers (uint8 views), one per region
        self._commit: list[tuple[Any, Any]] = []  # staged: (live slice, private slice) views
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._newest = 0  # the newest version number seen; records older than it are refused
        self._nslots = 1  # fences read along with the version record: slots 0 .. _nslots - 1
        # nccl joins process groups, so auto picks it only where the publisher opted in by serving
        # it (Publisher(transport=[..., "nccl"])); this side accepts it wherever it is installed
        self._caps = _select.capabilities(nccl=True)
        self._store = open_store(store, connect_timeout=connect_timeout)
        self._member = Membership(self._store, keys, self.token, self.name, lease_ttl)

    # ------------------------------------------------------------------------------------------
    @property
    def id(self) -> int | None:
        """This subscriber's id in the channel (assigned by ``register``; a new one when it joins
        again after the store was lost or its lease lapsed)."""
        return self._member.id

    @property
    def keys(self) -> Keys:
        """The channel's store keys in the store generation joined."""
        return self._member.keys

    def register(self, tensors: Mapping[str, tuple[Any, Declaration]]) -> None:
        """Declares the tensors to fill; joins the channel as a live subscriber."""
        self._check_open()
        _validate.tensors(tensors, f"subscriber {self.name}")
        if self._member.gen is None:
            self._member.join(record=False)  # the record, with the layout, follows
        layout, live, device = build_layout(self._member.id, tensors, pack=self.staged, who=f"subscriber {self.name}")
        self._drop_session()
        self._deregister_local()
        self._layout, self._live = layout, live
        self._member.announce(layout)  # publishers pack their slots for the layouts they are told
        if self.staged:
            self._dest = [alloc_bytes(layout.region_sizes[0] if layout.region_sizes else 0, device)]
        else:
            self._dest = [byte_view(t) for t in live.values()]
        self._device = device
        self.version = self._held = None
        if self.zone is not None:
            self._join_zone()

    def _join_zone(self) -> None:
        """Reads through the zone's relays from now on; a relay serves its buffer to them."""
        if self._zone is not None:
            quietly(self._zone.close)
        self._zone = None  # (if joining fails, no closed reader is left behind)
        self._zone = join_zone(self, self._dest[0] if self.staged else None, layout_hash(self._layout))

    def _check_membership(self) -> list | None:
        """If the membership stands, the values of ``VersionRecord.keys_with_fence`` (read with it
        in one batch), else None. A store found in a new generation (it was lost and came back
        empty) voids what was known: the tensors keep their bytes but ``version`` is None until a
        pull. A lapsed lease is joined again, the version held acked under the new id."""
        found, values = self._member.check(VersionRecord.keys_with_fence(self.keys, self._nslots))
        if found == NEW_GENERATION:
            self._drop_session()
            self.version, self._newest, self._held = None, 0, None
        if found != STILL and self._zone is not None:
            self._join_zone()  # a new id (or generation): a new relay record
        return values if found == STILL else None

    def latest(self) -> int | None:
        """The newest committed version in the store (``None`` before the first); never blocks."""
        self._check_open()
        rec = self._read_version()[1]
        return rec.v if rec else None

    def _read_version(self) -> tuple[Keys | None, VersionRecord | None]:
        """The keys and version record of the generation joined, or for a watcher (never
        registered) of the store's current generation (``(None, None)``: the store has none)."""
        keys = self.keys
        if self._member.gen is None:
            base = self._member.base
            gen = _generation.current(self._store, base, self.token)
            if gen is None:
                return None, None
            keys = base.at(gen)
        return keys, VersionRecord.read(self._store, keys, self.token)

    def wait_version(self, after: int | None = None, timeout: float = 60.0) -> int:
        """Blocks until a version newer than ``after`` is committed and returns it; pulls nothing.
        ``after=None``: newer than what this subscriber holds (0: none). Needs no ``register()``:
        a watcher that only wants to know when to act (e.g. to tell an engine to update) uses it."""
        self._check_open()
        floor = (self.version or 0) if after is None else after
        if type(floor) is not int or floor < 0:  # noqa: E721 - bool is no version
            raise UsageError(f"subscriber {self.name}: wait_version(after=) needs an int >= 0, got {after!r}")

        deadline = time.monotonic() + timeout
        with self._store.deadline(deadline):
            while True:
                keys, rec = self._read_version()
                if rec is not None and rec.v > floor:
                    return rec.v
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(
                        f"subscriber {self.name}: no version > {floor} on channel {self.channel!r} "
                        f"within {timeout:.1f}s"
                    )
                if keys is None:  # no generation in the store yet: nothing to block on
                    time.sleep(min(left, 0.05))
                    continue
                # block on the commit of the next version, as pulls do, instead of polling
                try:
                    self._store.wait(keys.ready(floor + 1), min(left, VERSION_WAIT_SLICE_S))
                except (WaitTimeout, StoreError):
                    pass  # timed out (re-checked above) or a store hiccup: read again

    async def versions(self, after: int | None = None) -> AsyncIterator[int]:
        """Yields each newly committed version: ``async for v in sub.versions(): ...``. Starts after
        ``after`` (default: the version committed now, or what this subscriber holds if newer); a
        version committed while the loop body runs is not lost, several may be coalesced into the
        newest. Needs no ``register()``."""
        last = after if after is not None else max(self.latest() or 0, self.version or 0)
        while True:
            try:
                last = await asyncio.to_thread(self.wait_version, last, 1.0)
            except WaitTimeout:
                continue
            yield last

    async def pull_async(self, min_version: int | None = None, timeout: float = 60.0) -> int:
        """``pull`` for asyncio loops: runs in a worker thread, the event loop stays free."""
        self._check_args(min_version, timeout)  # bad arguments raise here, not in the thread
        return await asyncio.to_thread(self.pull, min_version, timeout)

    @staticmethod
    def _check_args(min_version: int | None, timeout: float) -> float:
        if min_version is not None:
            _validate.integer(min_version, "pull() min_version")
        return _validate.timeout(timeout, "pull() timeout")

    def pull(self, min_version: int | None = None, timeout: float = 60.0) -> int:
        """Applies the newest committed version (at least ``min_version``) and returns it."""
        self._check_open()
        timeout = self._check_args(min_version, timeout)
        if self._layout is None:
            raise UsageError(f"subscriber {self.name}: pull() before register()")
        deadline = time.monotonic() + timeout
        with self._pull_lock, self._store.deadline(deadline):
            return self._pull(min_version, deadline, timeout)

    # ------------------------------------------------------------------------------------------
    def _pull(self, min_version: int | None, deadline: float, timeout: float) -> int:
        want = max(1, min_version or 1)
        retries = 0
        known = self._check_membership()  # with the version record: one batched read
        while True:
            first, known = known, None
            try:
                rec, fence = self._wait_version(want, deadline, timeout, first)
            except _GenerationChanged:
                continue
            if rec.v == self.version:
                return rec.v
            t0 = time.perf_counter()
            try:
                (pub, peers), ops, repaired, delta = self._apply(rec, fence, deadline)
            except StaleVersionError:
                retries += 1
                want = rec.v + 1
                if time.monotonic() >= deadline:
                    raise StaleVersionError(
                        f"subscriber {self.name}: version {rec.v} was overwritten while being read "
                        f"and no newer version arrived within {timeout:.1f}s"
                    ) from None
                continue
            self.stats.add(
                PullStats(
                    rec.v,
                    time.perf_counter() - t0,
                    pub + peers,
                    ops,
                    retries,
                    nbytes_from_publishers=pub,
                    nbytes_from_peers=peers,
                    repaired=repaired,
                    delta=delta,
                )
            )
            return rec.v

    def _wait_version(
        self, want: int, deadline: float, timeout: float, known: list | None
    ) -> tuple[VersionRecord, int]:
        """The newest version record (at least ``want``) and its slot's fence (``known``: those read
        already). Blocks on the ``ready`` key of the version it needs next (a TCPStore wait, an etcd
        watch), not polling; that key holds the version's record: no further read after a wait."""
        # Never go back: a store replaying an older (genuinely signed) version record must not
        # roll this subscriber back to stale weights.
        want = max(want, self._newest)
        ready: VersionRecord | None = None  # the record in the ready key a wait returned
        while True:
            if ready is not None and not ready.zero_copy:  # (zero-copy: readable only while its publish() runs)
                rec, fence = ready, ready.fence
            else:
                rec, fence = VersionRecord.read_with_fence(self._store, self.keys, self.token, self._nslots, known)
            known = ready = None
            if rec is None and self._check_membership() is None:
                raise _GenerationChanged
            if rec is not None and rec.slot >= self._nslots:
                self._nslots = min(rec.slot + 1, 64)
            if rec is not None and rec.v >= want:
                # zero-copy versions are readable only while their publish() runs
                if rec.v == self.version or not rec.zero_copy or fence == rec.fence:
                    self._newest = max(self._newest, rec.v)
                    return rec, fence
            elif rec is not None and rec.mode == "sync" and rec.v != self.version and self._member.lease is not None:
                raise UsageError(
                    f"subscriber {self.name}: channel {self.channel!r} is in sync mode and version {rec.v} "
                    f"waits for this subscriber's ack, so version {want} cannot come until it pulls "
                    f"{rec.v}: call pull() without min_version (or min_version={rec.v}) first"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(
                    f"subscriber {self.name}: no version >= {want} on channel "
                    f"{self.channel!r} within {timeout:.1f}s (is a publisher running?)"
                )
            nxt = want if rec is None or rec.v < want else rec.v + 1
            try:
                raw = self._store.wait(self.keys.ready(nxt), min(left, VERSION_WAIT_SLICE_S))
            except (WaitTimeout, StoreError):
                continue  # a store down for the slice: the next read retries it within its own timeout
            ready = VersionRecord.parse_ready(self.keys, self.token, nxt, raw)

    def _apply(self, rec: VersionRecord, fence: int, deadline: float) -> tuple[tuple[int, int], int, int, bool]:
        """Reads ``rec`` (whose slot's fence read ``fence`` along with it): as deltas onto the version
        held where it can (``wbridge._delta_pull``), else in full. The state key says
        "reading v" from before the first read until the reads are checked: publishers do not
        overwrite the slot meanwhile (sync and one-step-off modes). The slot stamps, read after the
        data, are what proves the slot did not change (the store is untrusted, so its fence is only
        a hint). Returns the bytes read (from publishers, from relays), reads, chunks repaired, and
        whether it applied deltas."""
        session = self._session
        gens = rec.packing or (0,) * rec.world_size  # which packed layout each rank's slot holds
        if session is None or session.epoch != rec.epoch or session.gens != gens:
            session = self._setup(rec, deadline, gens)
        state_key = self.keys.sub(self._member.id, "state")
        self._store.set(state_key, state_bytes(self._member.acked, rec.v))
        held, self._held = self._held, None  # the destination holds no whole version until we finish
        try:
            if fence != rec.fence:
                raise StaleVersionError(f"version {rec.v} was overwritten before the read began")
            if not self.staged:
                self.version = None  # the live tensors are about to hold a mix until we finish
            nbytes = (session.plan.total_bytes, 0)  # from publishers, from relays
            done = None  # deltas: (bytes, reads, chunks repaired); a zone's readers read whole versions
            if self._zone is None and self._deltas.usable(self._transports, session, rec, held, gens):
                try:
                    args = (self._store, self.keys, self.token, deadline)
                    done = self._deltas.pull(self._transports, session, rec, held[0], self._dest, *args)
                except IntegrityError:
                    self._check_stamps(session, rec, deadline)  # a slot reused under us is staleness
                    raise
                if done is not None:
                    nbytes = (done[0], 0)
            while done is None and self._zone is None:
                try:
                    self._read_all(session, rec.slot, deadline)
                    break
                except SourcesFailed as failed:  # a source died: its replicas stand in, if any
                    session = self._failover(session, failed, deadline)
            if self._zone is not None:  # relays of the zone first, publishers for the rest
                session, from_pub, from_peers = self._zone.read(session, rec, deadline)
                nbytes = (from_pub, from_peers)
            if done is None and self.verify and rec.checksums:
                try:
                    self._verify(session, rec, deadline)
                except IntegrityError:
                    self._check_stamps(session, rec, deadline)  # a slot reused under us is staleness
                    raise
            self._check_stamps(session, rec, deadline)
        except BaseException:
            # best effort, briefly even past the pull's deadline: keep the original error, and do
            # not leave a reading mark that would make publishers wait for this slot
            with self._store.deadline(time.monotonic() + 1.0):
                quietly(self._store.set, state_key, state_bytes(self._member.acked, 0))
            raise
        for dst, src in self._commit:  # staged: every read succeeded, now commit
            if isinstance(dst, np.ndarray):
                np.copyto(dst, src)
            else:
                dst.copy_(src)
        self.version = self._member.acked = rec.v
        self._held = (rec.v, rec.epoch, gens)
        self._store.set(state_key, state_bytes(rec.v, 0))  # acked, and reading nothing
        if done is not None:
            return nbytes, done[1], done[2], True
        return nbytes, len(session.plan), 0, False

    def _read_all(self, session: Session, slot: int, deadline: float) -> None:
        read_sources(self._transports, self._local_regions, self._pool, session.sources, slot, deadline, self.name)

    def _check_stamps(self, session: Session, rec: VersionRecord, deadline: float) -> None:
        check_stamps(self._transports, self._pool, session.sources, rec, deadline)

    # ------------------------------------------------------------------------------------------
    def _setup(self, rec: VersionRecord, deadline: float, gens: tuple[int, ...]) -> Session:
        """Fetches the epoch's publisher records, plans, chooses transports and connects."""
        self._drop_session()
        keys = [self.keys.rank(rec.epoch, r) for r in range(rec.world_size)]
        records = []
        for r, (key, raw) in enumerate(zip(keys, self._store.get_many(keys))):
            if raw is None:  # committed before this rank's record was visible? wait for it
                try:
                    raw = self._store.wait(key, max(0.0, deadline - time.monotonic()))
                except WaitTimeout:
                    raise WaitTimeout(
                        f"subscriber {self.name}: publisher rank {r} of epoch {rec.epoch} never registered"
                    ) from None
            records.append(open_sealed(self.token, key, raw))
        self._nslots = min(64, max(int(d.get("slots", 1)) for d in records))
        layouts = [
            packed_layout(self._store, self.keys, self.token, rec.epoch, r, g)
            if g
            else RankLayout.from_dict(d["layout"])
            for r, (d, g) in enumerate(zip(records, gens))
        ]
        plan = build_plan(layouts, self._layout)
        session = Session(rec.epoch, rec.world_size, plan, [], layouts, records, gens=gens)
        return self._connect_all(session, deadline)

    def _failover(self, session: Session, failed: SourcesFailed, deadline: float) -> Session:
        """Plans again over the ranks still alive (replicas hold the same bytes) and connects;
        ``failed.error`` if some byte has no replica left."""
        plan, dead = replan(session, self._layout, failed)
        log.warning("subscriber %s: publisher ranks %s failed; reading from replicas", self.name, sorted(dead))
        self._drop_session()
        new = Session(session.epoch, session.world_size, plan, [], session.layouts, session.records, dead, session.gens)
        return self._connect_all(new, deadline)

    def _connect_all(self, session: Session, deadline: float) -> Session:
        """Connects to every source of ``session.plan`` (planning around ranks that cannot be
        reached); the session becomes the current one."""
        plan = session.plan
        self.stats.plans += 1
        self.stats.bytes_per_source = plan.bytes_per_source()
        sources = session.sources
        try:
            for src_ops in plan.sources:
                d = session.records[src_ops.src_rank]
                batch = ReadBatch(
                    src_ops.src_region, src_ops.src_offset, src_ops.dst_region, src_ops.dst_offset, src_ops.nbytes
                )
                try:
                    sources.append(self._connect(src_ops.src_rank, d, batch, deadline))
                except TransportError as e:  # unreachable (dead?): its replicas may stand in
                    err = failed_sources([(src_ops.src_rank, e)])
                    if err is e:
                        raise
                    raise err from e
        except BaseException as e:
            for src in sources:
                quietly(self._transports[src.transport].disconnect, src.peer)
            if isinstance(e, SourcesFailed):
                return self._failover(session, e, deadline)
            raise
        if self._pool_size < len(sources):
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool_size = max(1, len(sources))
            self._pool = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="wbridge-pull")
        if self.staged:
            self._commit = commit_pairs(plan, self._layout, self._live, self._dest[0], self._device)
        self._session = session
        return session

    def _connect(self, rank: int, record: dict, batch: ReadBatch, deadline: float) -> Source:
        """Connects to one publisher rank over the best transport that works; ``auto`` falls back
        to the next candidate (``local`` -> ``tcp``, say) when one cannot connect."""
        remote = record.get("caps")
        if not isinstance(remote, dict):
            raise StoreError(f"publisher rank {rank}: record lacks its capabilities")
        options = candidates(self.preference, self._caps, remote)
        src, reason = connect_source(rank, record, batch, options, self._transport, deadline, self.name)
        self.stats.transports[rank] = (src.transport, reason)
        log.info("subscriber %s reads publisher rank %d over %s (%s)", self.name, rank, src.transport, reason)
        return src

    def _transport(self, name: str) -> _transports.Transport:
        t = self._transports.get(name)
        if t is None:
            cls = _transports.get(name)
            t = cls(token=self.token, host=self.host, **dict(self._transport_options.get(name, {})))
            if self._wrapper is not None:
                t = self._wrapper(t)
            self._transports[name] = t
            self._local_regions[name] = [
                t.register(address(b), int(b.numel()), device=self._device) for b in self._dest
            ]
        return t

    def _verify(self, session: Session, rec: VersionRecord, deadline: float) -> None:
        verify_sources(self._store, self.keys, self.token, self._transports, session.sources, rec, self._dest, deadline)

    # ------------------------------------------------------------------------------------------
    def _drop_session(self) -> None:
        self._deltas.reset()
        session, self._session = self._session, None
        if session is None:
            return
        for src in session.sources:
            t = self._transports.get(src.transport)
            if t is None:
                continue
            for prep in [*src.prepared.values(), *src.stamp_prepared.values()]:
                quietly(t.release, prep)
            if src.stamp_region is not None:
                quietly(t.deregister, src.stamp_region)
            if src.peer is not None:
                quietly(t.disconnect, src.peer)

    def _deregister_local(self) -> None:
        for name, regions in self._local_regions.items():
            for r in regions:
                quietly(self._transports[name].deregister, r)
        self._local_regions = {}
        for t in self._transports.values():
            quietly(t.close)
        self._transports = {}

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"subscriber {self.name} of channel {self.channel!r} is closed")

    def close(self) -> None:
        """Leaves the channel (publishers stop waiting for it) and releases everything; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._zone is not None:
            quietly(self._zone.close)  # its relay record first: readers stop choosing it
        self._member.leave()
        self._drop_session()
        self._deregister_local()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool, self._pool_size = None, 0
        store = getattr(self, "_store", None)
        if store is not None:
            quietly(store.close)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("registered" if self._layout else "new")
        return (
            f"Subscriber({self.channel!r}, id={self._member.id}, version={self.version}, "
            f"staged={self.staged}, transports={sorted({n for n, _ in self.stats.transports.values()})}, {state})"
        )


class _GenerationChanged(Exception):
    """Internal: the store was found in a new generation while waiting; wait again there."""


__all__ = ["PullStats", "Subscriber", "SubscriberStats"]
