"""Subscriber: a rollout worker's side of a channel.

Call protocol::

    sub = Subscriber("policy", store="tcp://127.0.0.1:29700", token="secret")
    sub.register({"qkv": (buf, Fused(0, [...])), ...})   # joins the channel; counts as live from here
    v = sub.pull(timeout=60.0)          # newest committed version, applied to the registered tensors
    v = await sub.pull_async()          # the same from an asyncio loop
    sub.verify()                        # re-checks what the tensors hold against the publishers' checksums
    sub.close()                         # idempotent; also a context manager

A pull runs the stages of ``wbridge.pull`` (see its package docstring) over one ``PullContext``:
it plans once per publisher epoch (layouts change only when publishers re-register) and then
replays the plan: one batch of one-sided reads per publisher rank, all ranks in parallel. Reads land
straight in the registered tensors, or with ``staged=True`` in a private buffer that is copied in
only after every read succeeded. A failed pull leaves ``version`` as ``None`` (live tensors hold no
complete version) unless staged, where the live tensors keep the last complete version. A source
rank that dies is read around (its DP replicas hold the same bytes). A pull that finds the store
lost (a new store generation) or its own lease lapsed first joins the channel again, under a new id.
Where publishers encode deltas (``Staging(delta=Delta())``) and the destination holds a recent
version whole, a pull reads only what changed since where that costs less than a full read on its
link, and always verifies it against the publishers' checksums, repairing what does not match
(``wbridge.pull.delta``; ``stats.last.delta``, and why not: ``stats.last.delta_reason``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from planner.layout import Declaration

from . import _validate
from ._deadline import Deadline
from ._lifecycle import Closeable, quietly
from ._selection import memory_kinds, rdma_present, subscriber_placement
from ._stats import PullStats, SubscriberStats
from ._tensors import alloc_bytes, build_layout, byte_view
from .errors import StaleVersionError, StoreError, UsageError, WaitTimeout
from .options import Zone
from .protocol import generation as _generation
from .protocol import meta as _meta
from .protocol.channel import ChannelStore
from .protocol.keys import Keys
from .protocol.packing import layout_hash
from .protocol.version import VersionRecord
from .pull.apply import apply, check_options
from .pull.context import Destination, Endpoints, PullContext
from .pull.membership import NEW_GENERATION, STILL, Membership
from .pull.reads import verify_held
from .pull.version import GenerationChanged, lost_history, next_version
from .pull.zone import RELAY_TRANSPORTS, ZoneReader, join_zone
from .store import DEFAULT_CONNECT_TIMEOUT, Store, check_url, open_store

DEFAULT_STORE = "tcp://127.0.0.1:29700"

log = logging.getLogger("wbridge")

# ``wait_version`` blocks on the next version's ``ready`` key in slices this long, following the
# store in between (a store that lost its history has no such key to wake it)
FOLLOW_SLICE_S = 5.0


class Subscriber(Closeable):
    """A rollout worker's side of a channel; see the module docstring for the call protocol.

    - ``channel``: the channel name (1 to 128 characters, no ``/``), as the publishers named it.
    - ``store``: the metadata store URL (``tcp://host:port`` or ``etcd://host:port[,...]``) or a ``Store``.
    - ``token``: the channel's shared secret (checks store records, authenticates to publishers).
    - ``transport``: ``"auto"`` (best common transport per publisher rank, see ``transports.select``) or a name.
    - ``staged``: read into a private buffer and copy in only after every read succeeded. CUDA tensors
      that the transport cannot reach (tcp, local; ``auto`` without RDMA and nixl) are always read
      that way, through a pinned host buffer; with a named such transport ``staged=False`` is a
      ``UsageError`` (``wbridge._selection``).
    - ``verify``: check each pull against the publishers' chunk checksums (where they publish them;
      delta pulls always check them).
    - ``connect_timeout``: seconds to wait for the store when opening it.
    - ``lease_ttl``: seconds without a lease refresh after which publishers stop waiting for it.
    - ``name``: shown to publishers and in errors, matched by ``Publisher.evict`` (1 to 256 characters;
      default ``<hostname>:<pid>``).
    - ``host``: the address transports bind and advertise (loopback by default); never a wildcard
      (``""``, ``0.0.0.0``, ``::``): a relay listens on every interface with ``{"tcp": {"bind_all": True}}``.
    - ``transport_options``: per-transport constructor keywords, ``{"tcp": {...}}``, checked against each
      transport's constructor (``Transport.check_options``); with a named ``transport``, for that one only.
    - ``zone``: a ``Zone`` (``wbridge.options``): read from the zone's relays first and from
      publishers what they lack; ``Zone(name, relay=True)`` also serves the zone (and stages).
      None (default): every byte from publishers.
    """

    def __init__(
        self,
        channel: str,
        store: str | Store = DEFAULT_STORE,
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
        zone: Zone | None = None,
    ) -> None:
        a = self.check_arguments(
            channel,
            store,
            token=token,
            transport=transport,
            staged=staged,
            verify=verify,
            connect_timeout=connect_timeout,
            lease_ttl=lease_ttl,
            name=name,
            host=host,
            transport_options=transport_options,
            zone=zone,
        )
        # (``verifies``: the flag; ``verify()`` checks what the tensors hold on demand)
        self.name, self.zone, self.verifies, self.token = a["name"], a["zone"], a["verify"], a["token"]
        self.staged = a["staged"] or (zone is not None and zone.relay)  # a relay serves its staging buffer
        self.channel, self.preference, self.host, self.lease_ttl = channel, a["transport"], a["host"], a["lease_ttl"]
        keys = Keys(channel)
        self.stats = SubscriberStats()
        self._closed = False
        self._lock = threading.Lock()
        self._pull_lock = threading.Lock()
        self._zone: ZoneReader | None = None
        self._watched: str | None = None  # a watcher's store generation (``_follow``)
        self._refused = False  # left the channel after its options were refused (``pull.apply.check_options``)
        self._store = open_store(store, connect_timeout=a["connect_timeout"])
        member = Membership(ChannelStore(self._store, keys, self.token), self.name, self.lease_ttl)
        endpoints = Endpoints(self.token, self.host, a["transport_options"], self.preference)
        self._ctx = PullContext(self._store, self.name, channel, member, endpoints, self.verifies, self.stats)

    @classmethod
    def check_arguments(cls, channel: str, store: str | Store = DEFAULT_STORE, **keywords: Any) -> dict[str, Any]:
        """The constructor's arguments checked as the constructor checks them, before it opens
        anything, and returned by name with defaults filled in and values normalised (``token`` as
        bytes, ``transport_options`` checked against each transport). ``UsageError`` names the first
        bad one. Integrations whose subscriber is built later, in an engine's process, call it
        where their options are written."""
        try:
            bound = inspect.signature(cls).bind(channel, store, **keywords)
        except TypeError as e:
            raise UsageError(f"Subscriber: {e}") from None
        bound.apply_defaults()
        a = dict(bound.arguments)
        name = _validate.name(f"{socket.gethostname()}:{os.getpid()}" if a["name"] is None else a["name"], "name")
        zone = a["zone"]
        if zone is not None and not isinstance(zone, Zone):
            raise UsageError(
                f"subscriber {name}: zone takes a Zone: write zone=Zone({zone!r}) "
                "(Zone(name, relay=True) to serve the zone too)"
            )
        transport = _validate.transport_name(a["transport"], "transport")
        token = _validate.token(a["token"])
        a.update(
            name=name,
            staged=_validate.boolean(a["staged"], "staged"),
            verify=_validate.boolean(a["verify"], "verify"),
            lease_ttl=_validate.timeout(a["lease_ttl"], "lease_ttl", positive=True),
            connect_timeout=_validate.timeout(a["connect_timeout"], "connect_timeout", positive=True),
            transport=transport,
            host=_validate.host(a["host"], f"subscriber {name}"),
            transport_options=_validate.transport_options(
                a["transport_options"], "transport_options", None if transport == "auto" else [transport], token
            ),
            token=token,
        )
        Keys(channel)  # the channel's name
        if not isinstance(store, Store):
            check_url(store)
        return a

    # ------------------------------------------------------------------------------------------
    @property
    def id(self) -> int | None:
        """This subscriber's id in the channel (assigned by ``register``; a new one when it joins
        again after the store was lost or its lease lapsed)."""
        return self._ctx.member.id

    @property
    def keys(self) -> Keys:
        """The channel's store keys in the store generation joined."""
        return self._ctx.member.keys

    @property
    def version(self) -> int | None:
        """The version the registered tensors hold whole (None: none yet, or a pull failed midway)."""
        return self._ctx.version

    @property
    def transports(self) -> Endpoints:
        """The transports this subscriber opened (``wrap()`` them for fault injection)."""
        return self._ctx.endpoints

    def register(self, tensors: Mapping[str, tuple[Any, Declaration]]) -> None:
        """Declares the tensors to fill; joins the channel as a live subscriber."""
        self._check_open()
        _validate.tensors(tensors, f"subscriber {self.name}")
        ctx = self._ctx
        if ctx.member.gen is None:
            ctx.member.join(record=False)  # the record, with the layout, follows
        who = f"subscriber {self.name}"
        layout, live, device = build_layout(ctx.member.id, tensors, pack=self.staged, who=who)
        # where reads land: host memory in front of device tensors that the transport cannot reach
        kinds = memory_kinds(ctx.endpoints.installed["transports"])
        relay = self.zone is not None and self.zone.relay
        serves = (RELAY_TRANSPORTS if self.preference == "auto" else [self.preference]) if relay else []
        where = subscriber_placement(device, self.preference, self.staged, kinds, rdma_present(), who, serves)
        if where.staged and not self.staged:  # staged through host memory: one packed region
            layout, live, device = build_layout(ctx.member.id, tensors, pack=True, who=who)
        ctx.drop_session()
        if where.staged:
            size = layout.region_sizes[0] if layout.region_sizes else 0
            buffers = [alloc_bytes(size, where.device, pinned=where.device != device)]
        else:
            buffers = [byte_view(t) for t in live.values()]
        ctx.endpoints.bind(buffers, where.device)
        ctx.dest = Destination(layout, live, buffers, where.device, where.staged)
        ctx.member.announce(layout)  # publishers pack their slots for the layouts they are told
        ctx.hold(None)
        ctx.held = None
        if self.zone is not None:
            self._join_zone()

    def _join_zone(self) -> None:
        """Reads through the zone's relays from now on; a relay serves its buffer to them."""
        if self._zone is not None:
            quietly(self._zone.close)
        self._zone = None  # (if joining fails, no closed reader is left behind)
        self._zone = join_zone(self._ctx, self.zone.name, self.zone.relay, layout_hash(self._ctx.dest.layout))

    def _check_membership(self) -> list | None:
        """If the membership stands, the values of ``VersionRecord.keys_with_fence`` (read with it
        in one batch), else None. A store found in a new generation (it was lost and came back
        empty) voids what was known: the tensors keep their bytes but ``version`` is None until a
        pull. A lapsed lease is joined again, the version held acked under the new id."""
        ctx = self._ctx
        found, values = ctx.member.check(VersionRecord.keys_with_fence(ctx.keys, ctx.nslots))
        if found == NEW_GENERATION:
            ctx.forget()
        if found != STILL and self._zone is not None:
            self._join_zone()  # a new id (or generation): a new relay record
        return values if found == STILL else None

    def latest(self) -> int | None:
        """The newest committed version in the store (``None`` before the first); never blocks.
        Follows the store as ``pull()`` does: after a store loss, the newest of its new history."""
        self._check_open()
        rec = self._follow()[1]
        return rec.v if rec else None

    def _follow(self) -> tuple[Keys | None, VersionRecord | None]:
        """The keys and version record of the store's current history. A registered subscriber
        checks its membership as a pull does (a store found in a new generation is joined, a
        lapsed lease joined again) unless a pull is running (which checks it itself); a watcher
        (never registered) reads the store's current generation. Either forgets what it knew of a
        history the store lost (``pull.version.lost_history``), so callers' floors of that history
        are void (``PullContext.floor``)."""
        ctx, member = self._ctx, self._ctx.member
        if member.gen is None:  # a watcher: whatever generation the store is in now
            gen = _generation.current(member.base)
            if gen is None:
                return None, None
            if self._watched not in (None, gen):
                ctx.forget()  # the store was lost and came back: versions count from 1 again
            self._watched = gen
            chan = member.base.at(gen)
            rec = VersionRecord.read(chan)
        elif self._pull_lock.acquire(blocking=False):
            try:
                values = self._check_membership()
                if values is None:  # joined the store's new generation (or again, under a new id)
                    values = self._store.get_many([ctx.keys.version])
                chan = member.chan
                rec = VersionRecord.parse(chan, values[0])
            finally:
                self._pull_lock.release()
        else:
            chan = member.chan
            rec = VersionRecord.read(chan)
        why = lost_history(ctx, rec)
        if why:
            log.warning("subscriber %s: channel %r %s: the store lost its history", self.name, self.channel, why)
            ctx.forget()
        if rec is not None:
            ctx.see(rec)
        return chan.keys, rec

    def _channel(self) -> ChannelStore | None:
        """The channel's store in the generation joined, or for a watcher the store's current one
        (None: the store has none yet)."""
        member = self._ctx.member
        if member.gen is not None:
            return member.chan
        gen = _generation.current(member.base)
        return None if gen is None else member.base.at(gen)

    def metadata(self, timeout: float = 60.0) -> dict:
        """The channel's metadata: what publisher rank 0 registered with ``metadata=`` last
        (``{}``: none), waiting at most ``timeout`` for a first registration. Needs no
        ``register()``: an engine learns from it what to allocate and pull (a LoRA adapter's
        config, ``wbridge.integrations.lora``), even before a first version is published."""
        self._check_open()
        deadline = Deadline.after(_validate.timeout(timeout, "metadata() timeout"))
        try:
            with self._store.deadline(deadline.at):
                while True:
                    chan = self._channel()
                    raw = None if chan is None else self._store.get(chan.keys.meta)
                    if raw is not None:
                        return _meta.parse(chan, raw)[1]
                    left = deadline.check("no metadata")
                    if chan is None:  # no generation in the store yet: nothing to block on
                        time.sleep(min(left, 0.05))
                        continue
                    try:
                        self._store.wait(chan.keys.meta, min(left, FOLLOW_SLICE_S))
                    except StoreError:
                        pass  # a store hiccup: read again
                    except WaitTimeout:
                        pass  # (re-checked above)
        except WaitTimeout:
            raise WaitTimeout(
                f"subscriber {self.name}: no publisher registered on channel {self.channel!r} "
                f"within {deadline.seconds:.1f}s"
            ) from None

    def wait_version(self, after: int | None = None, timeout: float = 60.0) -> int:
        """Blocks until a version newer than ``after`` is committed and returns it; pulls nothing.
        ``after=None``: newer than what this subscriber holds (0: none). Needs no ``register()``:
        a watcher that only wants to know when to act (e.g. to tell an engine to update) uses it.
        Follows the store as ``pull()`` does: where it finds that the store lost the history
        ``after`` counted (a new generation, or epochs that went back), it returns the newest
        version of the new history."""
        self._check_open()
        floor = (self.version or 0) if after is None else after
        if type(floor) is not int or floor < 0:  # noqa: E721 - bool is no version
            raise UsageError(f"subscriber {self.name}: wait_version(after=) needs an int >= 0, got {after!r}")

        deadline = Deadline.after(_validate.timeout(timeout, "wait_version() timeout"))
        with self._store.deadline(deadline.at):
            while True:
                keys, rec = self._follow()
                floor = self._ctx.floor(floor)
                if rec is not None and rec.v > floor:
                    return rec.v
                left = deadline.check(
                    f"subscriber {self.name}: no version > {floor} on channel {self.channel!r} "
                    f"within {deadline.seconds:.1f}s"
                )
                if keys is None:  # no generation in the store yet: nothing to block on
                    time.sleep(min(left, 0.05))
                    continue
                # block on the commit of the next version, as pulls do, instead of polling; in
                # slices, so a store that lost its history is noticed within one
                try:
                    self._store.wait(keys.ready(floor + 1), min(left, FOLLOW_SLICE_S))
                except (WaitTimeout, StoreError):
                    pass  # timed out (re-checked above) or a store hiccup: read again

    async def versions(self, after: int | None = None, give_up: float = 60.0) -> AsyncIterator[int]:
        """Yields each newly committed version: ``async for v in sub.versions(): ...``. Starts after
        ``after`` (default: the version committed now, or what this subscriber holds if newer); a
        version committed while the loop body runs is not lost, several may be coalesced into the
        newest. Needs no ``register()``. Follows the store as ``wait_version`` does (after a store
        loss, the new history's versions); a store that stays unreachable for ``give_up`` seconds
        raises its ``StoreError`` (shorter outages are waited out, with backoff)."""
        give_up = _validate.timeout(give_up, "versions() give_up")
        last = after if after is not None else max(self.latest() or 0, self.version or 0)
        failing_since: float | None = None
        while True:
            try:
                last = await asyncio.to_thread(self.wait_version, last, 1.0)
                failing_since = None
            except WaitTimeout:
                continue
            except StoreError:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= give_up:
                    raise
                await asyncio.sleep(min(2.0, 0.1 + (now - failing_since) / 4))
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
        """Applies the newest committed version (at least ``min_version``) and returns it. A pull
        that finds the store lost (versions count from 1 again) reads the newest version there:
        ``min_version`` counted versions of the history that was lost."""
        self._check_open()
        timeout = self._check_args(min_version, timeout)
        if self._ctx.dest is None:
            raise UsageError(f"subscriber {self.name}: pull() before register()")
        deadline = Deadline.after(timeout)
        with self._pull_lock, self._store.deadline(deadline.at):
            return self._pull(min_version, deadline)

    # ------------------------------------------------------------------------------------------
    def _pull(self, min_version: int | None, deadline: Deadline) -> int:
        want = max(1, min_version or 1)
        retries = 0
        lost = self._ctx.losses
        if self._refused:  # it left after a refusal: counted again from this pull on
            self._ctx.member.join(self._ctx.member.gen, self._ctx.member.acked)
            self._refused = False
            if self.zone is not None:
                self._join_zone()
        known = self._check_membership()  # with the version record: one batched read
        while True:
            if self._ctx.losses != lost:
                # the store was lost: ``min_version`` counted versions of its lost history, and
                # waiting for that number in the new one would hold publishers back on this
                # subscriber's ack (it holds nothing there) until the deadline: the newest is read
                lost, want = self._ctx.losses, 1
            first, known = known, None
            try:
                rec, fence = next_version(self._ctx, want, deadline, first, self._check_membership)
            except GenerationChanged:
                continue
            if self._ctx.holds(rec):  # the same version (number, epoch, nonce): nothing to read
                return rec.v
            try:
                check_options(self._ctx, rec, self._zone)
            except UsageError:
                self._leave()  # no publisher waits on a subscriber that cannot pull their versions
                raise
            t0 = time.perf_counter()
            try:
                done = apply(self._ctx, rec, fence, deadline, self._zone)
            except StaleVersionError:
                retries += 1
                want = rec.v + 1
                if deadline.expired:
                    raise StaleVersionError(
                        f"subscriber {self.name}: version {rec.v} was overwritten while being read "
                        f"and no newer version arrived within {deadline.seconds:.1f}s"
                    ) from None
                continue
            self.stats.add(done.stats(rec.v, time.perf_counter() - t0, retries))
            return rec.v

    def verify(self, timeout: float = 60.0) -> int:
        """Checks the bytes the registered tensors hold against the publishers' checksums of the
        version they hold, and returns that version (chunks the tensors hold only in part are read
        again from the publishers to check them). ``IntegrityError`` names the tensor and the chunk
        that differ; ``UsageError`` where no whole version is held or the publishers keep no
        checksums (``Staging(checksums=False)``); ``StaleVersionError`` where that version's
        checksums were collected since (``slots + 2`` newer versions replaced it: pull again)."""
        self._check_open()
        deadline = Deadline.after(_validate.timeout(timeout, "verify() timeout"))
        with self._pull_lock, self._store.deadline(deadline.at):
            return verify_held(self._ctx, deadline)

    def _leave(self) -> None:
        """Leaves the channel's membership (and the zone's relays) until the next pull."""
        if self._zone is not None:
            quietly(self._zone.close)
            self._zone = None
        self._ctx.member.leave()
        self._refused = True

    # ------------------------------------------------------------------------------------------
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
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.member.leave()
            ctx.close()
        store = getattr(self, "_store", None)
        if store is not None:
            quietly(store.close)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("registered" if self._ctx.dest else "new")
        return (
            f"Subscriber({self.channel!r}, id={self.id}, version={self.version}, "
            f"staged={self.staged}, transports={sorted({n for n, _ in self.stats.transports.values()})}, {state})"
        )


__all__ = ["PullStats", "Subscriber", "SubscriberStats"]
