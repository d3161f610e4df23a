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
complete version) unless staged, where the live tensors keep the last complete version.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import transports as _transports
from planner.builder import build_plan
from planner.layout import Declaration, RankLayout
from planner.plan import Plan
from transports import select as _select
from transports.base import ReadBatch

from ._lifecycle import Closeable, quietly
from ._selection import candidates
from ._tensors import address, alloc_bytes, build_layout, byte_view
from ._tracker import state_bytes
from .errors import (
    AuthError,
    IntegrityError,
    StaleVersionError,
    StoreError,
    TransportError,
    UsageError,
    WaitTimeout,
    WBridgeError,
)
from .protocol import checksum as _checksum
from .protocol.keys import Keys
from .protocol.records import open_sealed, seal
from .protocol.stamps import STAMP_BYTES, STAMP_MAGIC, STAMP_STABLE
from .protocol.version import VersionRecord
from .store import DEFAULT_CONNECT_TIMEOUT, Store, open_store

log = logging.getLogger("wbridge")

# A pull waiting for a version blocks on its ``ready`` key in slices this long, re-reading the version
# record in between (a zero-copy version fenced off, or a key collected before the wait began: that
# takes slots + 2 commits within one round trip).
VERSION_WAIT_SLICE_S = 30.0


@dataclass
class PullStats:
    version: int
    seconds: float
    nbytes: int
    ops: int
    retries: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class SubscriberStats:
    transports: dict[int, tuple[str, str]] = field(default_factory=dict)  # src rank -> (name, reason)
    bytes_per_source: dict[int, int] = field(default_factory=dict)  # of the current plan
    pulls: list[PullStats] = field(default_factory=list)
    plans: int = 0

    @property
    def last(self) -> PullStats | None:
        return self.pulls[-1] if self.pulls else None


@dataclass
class _Source:
    rank: int
    transport: str
    endpoint: bytes
    regions: list[list[bytes]]  # slot -> region descriptors
    batch: ReadBatch
    peer: Any = None
    prepared: dict[int, Any] = field(default_factory=dict)  # slot -> prepared read
    stamp: Any = None  # where the slot's stamp is read to
    stamp_region: Any = None
    stamp_prepared: dict[int, Any] = field(default_factory=dict)  # slot -> prepared stamp read


@dataclass
class _Session:
    """Everything planned for one publisher epoch; replayed by every pull of that epoch."""

    epoch: int
    world_size: int
    plan: Plan
    sources: list[_Source]
    layouts: list[RankLayout]


class Subscriber(Closeable):
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
        transport_wrapper: Callable[[_transports.Transport], _transports.Transport] | None = None,
        nccl: bool = False,
    ) -> None:
        self.channel, self.staged, self.verify = channel, staged, verify
        self.preference, self.host, self.lease_ttl = transport, host, lease_ttl
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.token = token.encode() if isinstance(token, str) else token
        self.keys = Keys(channel)
        self.version: int | None = None
        self.stats = SubscriberStats()
        self._closed = False
        self._lock = threading.Lock()
        self._pull_lock = threading.Lock()
        self._transport_options = transport_options or {}
        self._wrapper = transport_wrapper  # fault injection and tracing (see wbridge.testing.faults)
        self._transports: dict[str, _transports.Transport] = {}
        self._local_regions: dict[str, list[Any]] = {}
        self._session: _Session | None = None
        self._layout: RankLayout | None = None
        self._live: dict[str, Any] = {}
        self._dest: list[Any] = []  # destination buffers (uint8 views), one per region
        self._commit: list[tuple[Any, Any]] = []  # staged: (live slice, private slice) views
        self._id: int | None = None
        self._lease = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._newest = 0  # the newest version number seen; records older than it are refused
        self._acked = 0  # the last version applied (what the state key says was acked)
        self._nslots = 1  # fences read along with the version record: slots 0 .. _nslots - 1
        self._caps = _select.capabilities(nccl=nccl)  # nccl: opt in to the two-sided fallback
        self._store = open_store(store, connect_timeout=connect_timeout)

    # ------------------------------------------------------------------------------------------
    @property
    def id(self) -> int | None:
        """This subscriber's id in the channel (assigned by ``register``)."""
        return self._id

    def register(self, tensors: Mapping[str, tuple[Any, Declaration]]) -> None:
        """Declares the tensors to fill; joins the channel as a live subscriber."""
        self._check_open()
        if not tensors:
            raise UsageError("subscriber register() needs at least one tensor")
        if self._id is None:
            self._id = self._store.add(self.keys.subs, 1)
        layout, live, device = build_layout(self._id, tensors, pack=self.staged, who=f"subscriber {self.name}")
        self._drop_session()
        self._deregister_local()
        self._layout, self._live = layout, live
        if self.staged:
            self._dest = [alloc_bytes(layout.region_sizes[0] if layout.region_sizes else 0, device)]
        else:
            self._dest = [byte_view(t) for t in live.values()]
        self._device = device
        self.version = None
        if self._lease is None:
            # the lease and state first: publishers only look at subscribers whose record exists,
            # and a record without a live lease would read as a dead subscriber
            self._lease = self._store.lease(self.keys.sub(self._id, "live"), self.lease_ttl)
            self._store.set(self.keys.sub(self._id, "state"), state_bytes(self._acked, 0))
            key = self.keys.sub(self._id)
            self._store.set(
                key,
                seal(
                    self.token,
                    key,
                    {"name": self.name, "ttl": self.lease_ttl, "host": socket.gethostname(), "pid": os.getpid()},
                ),
            )

    def latest(self) -> int | None:
        """The newest committed version in the store (``None`` before the first); never blocks."""
        self._check_open()
        rec = VersionRecord.read(self._store, self.keys, self.token)
        return rec.v if rec else None

    async def pull_async(self, min_version: int | None = None, timeout: float = 60.0) -> int:
        """``pull`` for asyncio loops: runs in a worker thread, the event loop stays free."""
        return await asyncio.to_thread(self.pull, min_version, timeout)

    def pull(self, min_version: int | None = None, timeout: float = 60.0) -> int:
        """Applies the newest committed version (at least ``min_version``) and returns it."""
        self._check_open()
        if self._layout is None:
            raise UsageError(f"subscriber {self.name}: pull() before register()")
        deadline = time.monotonic() + timeout
        with self._pull_lock, self._store.deadline(deadline):
            return self._pull(min_version, deadline, timeout)

    # ------------------------------------------------------------------------------------------
    def _pull(self, min_version: int | None, deadline: float, timeout: float) -> int:
        want = max(1, min_version or 1)
        retries = 0
        while True:
            rec, fence = self._wait_version(want, deadline, timeout)
            if rec.v == self.version:
                return rec.v
            t0 = time.perf_counter()
            try:
                nbytes, ops = self._apply(rec, fence, deadline)
            except StaleVersionError:
                retries += 1
                want = rec.v + 1
                if time.monotonic() >= deadline:
                    raise StaleVersionError(
                        f"subscriber {self.name}: version {rec.v} was overwritten while being read "
                        f"and no newer version arrived within {timeout:.1f}s"
                    ) from None
                continue
            self.stats.pulls.append(PullStats(rec.v, time.perf_counter() - t0, nbytes, ops, retries))
            return rec.v

    def _wait_version(self, want: int, deadline: float, timeout: float) -> tuple[VersionRecord, int]:
        """The newest version record (at least ``want``) and its slot's fence. Blocks on the
        ``ready`` key of the version it needs next (a TCPStore wait, an etcd watch), not polling."""
        # Never go back: a store replaying an older (genuinely signed) version record must not
        # roll this subscriber back to stale weights.
        want = max(want, self._newest)
        while True:
            rec, fence = VersionRecord.read_with_fence(self._store, self.keys, self.token, self._nslots)
            if rec is not None and rec.slot >= self._nslots:
                self._nslots = min(rec.slot + 1, 64)
            if rec is not None and rec.v >= want:
                # zero-copy versions are readable only while their publish() runs
                if rec.v == self.version or not rec.zero_copy or fence == rec.fence:
                    self._newest = max(self._newest, rec.v)
                    return rec, fence
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(
                    f"subscriber {self.name}: no version >= {want} on channel "
                    f"{self.channel!r} within {timeout:.1f}s (is a publisher running?)"
                )
            nxt = want if rec is None or rec.v < want else rec.v + 1
            try:
                self._store.wait(self.keys.ready(nxt), min(left, VERSION_WAIT_SLICE_S))
            except (WaitTimeout, StoreError):
                pass  # a store down for the slice: the next read retries it within its own timeout

    def _apply(self, rec: VersionRecord, fence: int, deadline: float) -> tuple[int, int]:
        """Reads ``rec`` (whose slot's fence read ``fence`` along with it). The state key says
        "reading v" from before the first read until the reads are checked: publishers do not
        overwrite the slot meanwhile (sync and one-step-off modes). The slot stamps, read after the
        data, are what proves the slot did not change (the store is untrusted, so its fence is only
        a hint)."""
        session = self._session
        if session is None or session.epoch != rec.epoch:
            session = self._setup(rec, deadline)
        state_key = self.keys.sub(self._id, "state")
        self._store.set(state_key, state_bytes(self._acked, rec.v))
        try:
            if fence != rec.fence:
                raise StaleVersionError(f"version {rec.v} was overwritten before the read began")
            if not self.staged:
                self.version = None  # the live tensors are about to hold a mix until we finish
            self._read_all(session, rec.slot, deadline)
            if self.verify and rec.checksums:
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
                quietly(self._store.set, state_key, state_bytes(self._acked, 0))
            raise
        for dst, src in self._commit:  # staged: every read succeeded, now commit
            if isinstance(dst, np.ndarray):
                np.copyto(dst, src)
            else:
                dst.copy_(src)
        self.version = self._acked = rec.v
        self._store.set(state_key, state_bytes(rec.v, 0))  # acked, and reading nothing
        return session.plan.total_bytes, len(session.plan)

    def _read_all(self, session: _Session, slot: int, deadline: float) -> None:
        def one(src: _Source) -> None:
            prep = src.prepared.get(slot)
            t = self._transports[src.transport]
            if prep is None:
                prep = t.prepare(src.peer, src.regions[slot], self._local_regions[src.transport], src.batch)
                src.prepared[slot] = prep
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"subscriber {self.name}: pull timed out before reading rank {src.rank}")
            t.read(prep, timeout=left)

        work = [s for s in session.sources if len(s.batch)]
        if len(work) == 1:
            one(work[0])
            return
        futures = [self._pool.submit(one, s) for s in work]
        errors = []
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - collect, then raise the first
                errors.append(e)
        if errors:
            raise errors[0]

    def _check_stamps(self, session: _Session, rec: VersionRecord, deadline: float) -> None:
        """Reads every source's slot stamp after the data: unless each still says "version v,
        stable", the slot changed under the reads (the seqlock check; the store's fence is only a
        hint, since the store is not trusted)."""
        want = (STAMP_MAGIC, rec.v, STAMP_STABLE, rec.epoch)

        def one(src: _Source) -> None:
            t = self._transports[src.transport]
            prep = src.stamp_prepared.get(rec.slot)
            if prep is None:
                stamp_index = len(src.regions[rec.slot]) - 1
                prep = t.prepare(
                    src.peer,
                    src.regions[rec.slot],
                    [src.stamp_region],
                    ReadBatch.of([(stamp_index, 0, 0, 0, STAMP_BYTES)]),
                )
                src.stamp_prepared[rec.slot] = prep
            t.read(prep, timeout=max(0.1, deadline - time.monotonic()))
            got = tuple(int(x) for x in src.stamp.numpy().view(np.uint64))
            if got != want:
                raise StaleVersionError(
                    f"publisher rank {src.rank}: slot {rec.slot} holds version "
                    f"{got[1]} (state {got[2]}), not version {rec.v}"
                )

        for f in [self._pool.submit(one, src) for src in session.sources]:
            f.result()

    # ------------------------------------------------------------------------------------------
    def _setup(self, rec: VersionRecord, deadline: float) -> _Session:
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
        layouts = [RankLayout.from_dict(d["layout"]) for d in records]
        plan = build_plan(layouts, self._layout)
        self.stats.plans += 1
        self.stats.bytes_per_source = plan.bytes_per_source()
        sources: list[_Source] = []
        try:
            for src_ops in plan.sources:
                d = records[src_ops.src_rank]
                batch = ReadBatch(
                    src_ops.src_region, src_ops.src_offset, src_ops.dst_region, src_ops.dst_offset, src_ops.nbytes
                )
                sources.append(self._connect(src_ops.src_rank, d, batch, deadline))
        except BaseException:
            for src in sources:
                quietly(self._transports[src.transport].disconnect, src.peer)
            raise
        if self._pool_size < len(sources):
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool_size = max(1, len(sources))
            self._pool = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="wbridge-pull")
        if self.staged:
            self._commit = _commit_pairs(plan, self._layout, self._live, self._dest[0], self._device)
        self._session = _Session(rec.epoch, rec.world_size, plan, sources, layouts)
        return self._session

    def _connect(self, rank: int, record: dict, batch: ReadBatch, deadline: float) -> _Source:
        """Connects to one publisher rank over the best transport that works; ``auto`` falls back
        to the next candidate (``local`` -> ``tcp``, say) when one cannot connect."""
        tried = []
        remote = record.get("caps")
        if not isinstance(remote, dict):
            raise StoreError(f"publisher rank {rank}: record lacks its capabilities")
        options = candidates(self.preference, self._caps, remote)
        for i, (name, reason) in enumerate(options):
            served = record["transports"][name]
            src = _Source(
                rank=rank,
                transport=name,
                endpoint=_unb64(served["endpoint"]),
                regions=[[_unb64(x) for x in slot] for slot in served["regions"]],
                batch=batch,
            )
            try:
                t = self._transport(name)
                src.peer = t.connect(src.endpoint, timeout=max(0.1, deadline - time.monotonic()))
                src.stamp = alloc_bytes(STAMP_BYTES, "cpu")
                src.stamp_region = t.register(address(src.stamp), STAMP_BYTES)
            except TransportError as e:
                if isinstance(e, AuthError) or i == len(options) - 1:
                    raise
                tried.append(f"{name}: {e}")
                log.warning(
                    "subscriber %s: %s to publisher rank %d failed (%s); trying %s",
                    self.name,
                    name,
                    rank,
                    e,
                    options[i + 1][0],
                )
                continue
            if tried:
                reason = f"{reason}; after {'; '.join(tried)}"
            self.stats.transports[rank] = (name, reason)
            log.info("subscriber %s reads publisher rank %d over %s (%s)", self.name, rank, name, reason)
            return src
        raise TransportError(f"publisher rank {rank}: no transport connected")  # unreachable

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

    def _verify(self, session: _Session, rec: VersionRecord, deadline: float) -> None:
        """Checks every chunk the plan read from each source against the publisher's sums."""
        keys = [self.keys.sums(rec.v, src.rank) for src in session.sources]
        for src, key, raw in zip(session.sources, keys, self._store.get_many(keys)):
            if raw is None:  # written before the commit: collected since, so the slot was reused
                raise StaleVersionError(f"checksums of version {rec.v} were collected (a newer version replaced it)")
            sums = open_sealed(self.token, key, raw)
            if sums.get("algo") != _checksum.ALGO:
                raise IntegrityError(
                    f"publisher rank {src.rank} uses checksum {sums.get('algo')}, this subscriber {_checksum.ALGO}"
                )
            _checksum.verify_reads(
                src.batch,
                sums,
                self._dest,
                self._fetch_chunk(src, rec.slot, deadline),
                where=f"publisher rank {src.rank}, version {rec.v}",
            )

    def _fetch_chunk(self, src: _Source, slot: int, deadline: float):
        t = self._transports[src.transport]

        def fetch(region: int, offset: int, n: int) -> np.ndarray:
            scratch = alloc_bytes(n, "cpu")
            local = t.register(address(scratch), n)
            try:
                prep = t.prepare(src.peer, src.regions[slot], [local], ReadBatch.of([(region, offset, 0, 0, n)]))
                try:
                    t.read(prep, timeout=max(0.1, deadline - time.monotonic()))
                finally:
                    t.release(prep)
            finally:
                t.deregister(local)
            return scratch.numpy()

        return fetch

    # ------------------------------------------------------------------------------------------
    def _drop_session(self) -> None:
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
        if self._lease is not None:
            self._lease.revoke()
            self._lease = None
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
            f"Subscriber({self.channel!r}, id={self._id}, version={self.version}, "
            f"staged={self.staged}, transports={sorted({n for n, _ in self.stats.transports.values()})}, {state})"
        )


def _commit_pairs(
    plan: Plan, layout: RankLayout, live: Mapping[str, Any], private: Any, device: str
) -> list[tuple[Any, Any]]:
    """Staged mode: (live slice, private slice) views of every mapped byte range, built once per plan."""
    if len(plan) == 0:
        return []
    offs = np.concatenate([s.dst_offset for s in plan.sources])
    lens = np.concatenate([s.nbytes for s in plan.sources])
    order = np.argsort(offs, kind="stable")
    offs, lens = offs[order], lens[order]
    ends = offs + lens
    # merge touching ranges
    starts_new = np.ones(len(offs), dtype=bool)
    starts_new[1:] = offs[1:] != ends[:-1]
    idx = np.flatnonzero(starts_new)
    m_off = offs[idx]
    m_end = np.maximum.reduceat(ends, idx)
    out = []
    tensors = sorted((lt.offset, lt.offset + lt.nbytes, lt.name) for lt in layout.tensors)
    bounds = np.array([t[0] for t in tensors])
    views = {name: byte_view(t) for name, t in live.items()}
    for a, b in zip(m_off.tolist(), m_end.tolist()):
        while a < b:
            k = int(np.searchsorted(bounds, a, side="right")) - 1
            lo, hi, name = tensors[k]
            n = min(b, hi) - a
            dst, src = views[name][a - lo : a - lo + n], private[a : a + n]
            out.append((dst.numpy(), src.numpy()) if device == "cpu" else (dst, src))
            a += n
    return out


def _unb64(s: str) -> bytes:
    try:
        return base64.b64decode(s, validate=True)
    except (ValueError, TypeError) as e:
        raise StoreError(f"malformed descriptor in publisher record: {e}") from None


__all__ = ["Subscriber", "SubscriberStats", "PullStats", "WBridgeError", "TransportError"]
