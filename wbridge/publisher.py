"""Publisher: a trainer rank's side of a channel.

Call protocol (every publisher rank of the channel, ``world_size`` of them)::

    pub = Publisher("policy", "tcp://127.0.0.1:29700", rank=r, world_size=n, host_store=(r == 0))
    pub.register({"layers.0.q": (tensor, Shard(...)), ...})   # once (again when the layout changes)
    for step in ...:
        train_step()
        v = pub.publish(timeout=60.0)      # every rank calls it; returns the same v on every rank
    pub.close()                            # idempotent; also a context manager

``publish()`` copies the live tensors into the next staging slot (the trainer's stall in the
asynchronous modes), waits as the sync mode says, and the last rank to finish commits ``v``. If it
finds the store lost (its host restarted, etcd wiped: a new store generation, see ``wbridge.protocol.generation``)
it first registers again there; versions then count from that store's newest (1) again. Every
store call of a publish is bounded by its ``timeout``.

``publish_async()`` runs that same work on the publisher's one background thread and returns a
``concurrent.futures.Future`` of ``v``, so the snapshot overlaps the next step's compute::

    fut = None
    for step in ...:
        loss = forward_backward()          # only READS the registered tensors: may overlap the copy
        if fut is not None:
            fut.result()                   # before any WRITE to a registered tensor
        optimizer.step()                   # writes the next version's values
        fut = pub.publish_async(timeout=60.0)

Until the future is done the caller may read the registered tensors but must not write them: a
write during the copy would publish a torn version that nothing downstream can detect (the slot
stamps guard the staging slot against reuse, not the live tensors against the trainer). At most one
publish is in flight: ``publish()``, ``publish_async()``, ``register()`` and ``close()`` first wait
for it (``close()`` for a bounded time, after telling it to stop waiting on subscribers). One thread
drives a publisher; ``wait_acked()``, ``subscribers()`` and ``close()`` may come from others.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import transports as _transports
from planner.layout import Declaration, RankLayout

from . import _validate
from ._lifecycle import Closeable, log, quietly
from ._selection import RDMA_FIRST, memory_kinds, publisher_placement, rdma_present
from ._stats import PublisherStats, PublishStats
from ._tensors import FLOATING, build_layout, dtype_name
from .errors import StoreError, UsageError, WaitTimeout, WBridgeError
from .options import Async, Staging, ZeroCopy, mode_of
from .protocol import generation as _generation
from .protocol import meta as _meta
from .protocol.channel import ChannelStore
from .protocol.keys import Keys
from .protocol.version import VersionRecord
from .publish import commit as _commit
from .publish import transforms as _transforms
from .publish.delta import build_ring
from .publish.packing import SlotPacker
from .publish.staging import Registration, build_registration, casts, release_regions, served_record, staging_buffer
from .publish.tracker import SubscriberTracker
from .store import DEFAULT_CONNECT_TIMEOUT, Store, open_store

CLOSE_WAIT_S = 10.0  # how long close() waits for a publish in flight before it tears down anyway


def served_transports(transport: str | Sequence[str]) -> list[str]:
    """Transports a publisher serves. ``auto``: tcp and local, plus the RDMA engines (nixl,
    mooncake) where RDMA devices exist, since only there would a subscriber choose them. The
    two-sided nccl is served only when named."""
    if isinstance(transport, str):
        if transport != "auto":
            return [transport]
        wanted = {"tcp", "local"} | (set(RDMA_FIRST) if rdma_present() else set())
        return [t for t in _transports.available() if t in wanted]
    return list(transport)


class Publisher(Closeable):
    """A trainer rank's side of a channel; see the module docstring for the call protocol.

    - ``channel``: the channel name (1 to 128 characters, no ``/``); publishers and subscribers meet by it.
    - ``store``: the metadata store URL (``tcp://host:port`` or ``etcd://host:port[,...]``) or a ``Store``.
    - ``rank``, ``world_size``: this rank among the channel's publisher ranks (``0 <= rank < world_size``).
    - ``host_store``: this rank hosts the ``tcp://`` store (exactly one rank, usually 0).
    - ``token``: shared secret; signs store records and authenticates transport peers (None: neither).
    - ``transport``: what to serve: ``"auto"`` (tcp, local, and RDMA engines where devices exist) or names.
      CUDA tensors are staged in pinned host memory where a served transport reaches host memory
      only (tcp, local, mooncake); ``auto`` serves them from the device through the transports that
      reach it where any is served (nixl), and only through those (``wbridge._selection``).
    - ``mode``: ``"sync"`` (publish waits for every subscriber's ack), ``"one_step_off"`` (waits for
      the acks of the version before), or ``Async(max_staleness=k)`` (``wbridge.options``).
    - ``staging``: ``Staging(slots=2, checksums=True, delta=None)`` (copies into rotating slots;
      ``delta=Delta(history=k)`` also publishes deltas) or ``ZeroCopy()`` (serves the live tensors).
    - ``host``: the address transports bind and advertise (loopback by default); never a wildcard
      (``""``, ``0.0.0.0``, ``::``): to listen on every interface, ``transport_options={"tcp": {"bind_all": True}}``.
    - ``connect_timeout``: seconds to wait for the store when opening it.
    - ``transport_options``: per-transport constructor keywords, ``{"tcp": {...}}``, checked against each
      transport's constructor (``Transport.check_options``); only for transports it serves.
    - ``zone``: the zone (cluster) it runs in, recorded for tools; subscribers read publishers
      whatever the zones (a zone selects only which relays a subscriber reads, ``wbridge.pull.zone``).

    A subscriber that dies is waited for until its lease lapses; ``evict(name_or_id)`` stops
    counting one known to be dead (its worker was killed or restarted) at once, on every rank.
    """

    def __init__(
        self,
        channel: str,
        store: str | Store = "tcp://127.0.0.1:29700",
        *,
        rank: int = 0,
        world_size: int = 1,
        host_store: bool = False,
        token: str | bytes | None = None,
        transport: str | Sequence[str] = "auto",
        mode: str | Async = "one_step_off",
        staging: Staging | ZeroCopy = Staging(),
        host: str = "127.0.0.1",
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        transport_options: Mapping[str, Mapping[str, Any]] | None = None,
        zone: str | None = None,
    ) -> None:
        self.zone = _validate.zone(zone, f"publisher rank {rank}")
        mode, max_staleness = mode_of(mode)
        if not isinstance(staging, (Staging, ZeroCopy)):
            raise UsageError(f"staging takes Staging(...) or ZeroCopy(...), got {staging!r}")
        _validate.boolean(host_store, "host_store")
        rank = _validate.integer(rank, "rank")
        world_size = _validate.integer(world_size, "world_size", minimum=1)
        if rank >= world_size:
            raise UsageError(f"rank {rank} outside world_size {world_size}")
        connect_timeout = _validate.timeout(connect_timeout, "connect_timeout", positive=True)
        token = _validate.token(token)
        host = _validate.host(host, f"publisher rank {rank}")
        transport = _validate.transport_names(transport, "transport")
        names = served_transports(transport)
        classes = {name: _transports.get(name) for name in names}  # a missing extra: refused now
        opts = _validate.transport_options(
            transport_options, "transport_options", None if transport == "auto" else names, token
        )
        self.channel, self.rank, self.world_size = channel, rank, world_size
        self.mode, self.max_staleness, self.staging = mode, max_staleness, staging
        self.slots, self.zero_copy = staging.slots, isinstance(staging, ZeroCopy)
        self.host, self.checksums = host, staging.checksums
        self.delta = staging.delta  # a Delta, or None
        self.token = token
        self.keys = Keys(channel)
        self._gen: str | None = None  # the store generation registered in (see _generation)
        self._pending_epoch: tuple[str, int] | None = None  # counted by a register() that failed later
        self._closed = False
        self._lock = threading.Lock()
        self._reg: Registration | None = None
        self._old_epochs: list[tuple[int, int]] = []  # (epoch, packing generations) of replaced registrations
        self.stats = PublisherStats()
        self._connect_timeout = connect_timeout
        # publish_async(): one worker thread, at most one publish in flight, and a stop signal
        # that close() gives so a publish waiting on subscribers gives up at once.
        self._start_lock = threading.Lock()  # held while a publish is started (and by close)
        self._snap_lock = threading.Lock()  # held while the staging slots are written
        self._stop = threading.Event()
        self._worker: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._inflight_deadline = 0.0
        self._worker_ident: int | None = None
        self._store = open_store(store, host_store=host_store, connect_timeout=connect_timeout)
        self._base = self._chan = ChannelStore(self._store, self.keys, token)  # (of a generation once registered)
        # rank 0 aggregates subscriber progress for every rank (see publish.tracker)
        self._tracker = SubscriberTracker(self._chan, aggregator=rank == 0, others=world_size > 1)
        self._next_version = 0
        self._auto = transport == "auto"  # device tensors: served by what reaches them, where any does
        self._transports: dict[str, _transports.Transport] = {}
        try:
            for name, cls in classes.items():
                self._transports[name] = cls(token=self.token, host=host, **opts.get(name, {}))
        except BaseException:
            self.close()
            raise
        if not self._transports:
            self.close()
            raise UsageError(f"publisher rank {rank}: no transport to serve (asked for {transport!r})")

    # ------------------------------------------------------------------------------------------
    @property
    def store_url(self) -> str:
        return self._store.url

    @property
    def version(self) -> int:
        """The last version this rank published (0 before the first)."""
        return self._next_version - 1 if self._next_version else 0

    def register(
        self,
        tensors: Mapping[str, tuple[Any, Declaration]],
        dtype: Any = None,
        transforms: Any = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> int:
        """Registers this rank's live tensors with their declarations; returns the epoch.

        ``dtype`` (``torch.bfloat16``, ``torch.float16``...): publish the floating tensors in this
        dtype; the snapshot casts them (one vectorised copy per tensor, on their device), so an fp32
        trainer serves bf16 rollouts from its own memory. Needs a staging copy (``Staging``, not ``ZeroCopy``).

        ``transforms``: ``{local name: "fp8_block128"}`` publishes a 2-D floating ``Shard(name, ...)``
        as ``name`` in ``float8_e4m3fn`` plus ``name + "_scale_inv"`` (float32, one inverse scale per
        128x128 block: DeepSeek-V3's format, defined in ``wbridge.publish.transforms``); staged modes only.

        ``metadata``: a small JSON object (at most 64 KiB encoded) that subscribers read with
        ``Subscriber.metadata()``, even before a first version, e.g. a LoRA adapter's config
        (``wbridge.integrations.lora``); rank 0's is the channel's, signed like every record
        (``wbridge.protocol.meta``).

        Collective: every rank registers before any rank's ``publish()`` can commit, and all ranks
        register again together (a new epoch) when a layout changes or a rank was restarted.
        """
        self._check_open()
        _validate.tensors(tensors, f"publisher rank {self.rank}")
        transforms = _transforms.check(transforms, tensors, f"publisher rank {self.rank}", self.zero_copy)
        meta = _meta.check(metadata, f"publisher rank {self.rank}")
        cast = None if dtype is None else dtype_name(dtype)
        if cast is not None:
            if cast not in FLOATING:
                raise UsageError(f"publisher rank {self.rank}: dtype must be one of {FLOATING}, got {dtype!r}")
            if self.zero_copy:
                raise UsageError(
                    f"publisher rank {self.rank}: register(dtype={cast}) casts at snapshot time, "
                    "but staging=ZeroCopy() "
                    "serves the live tensors as they are; use staging=Staging() to cast"
                )
        with self._start_lock:
            self._settle(self._inflight_deadline + self._connect_timeout, "register()")
            return self._register(tensors, cast, transforms, meta)

    def _register(
        self, tensors: Mapping[str, tuple[Any, Declaration]], cast: str | None, transforms: Any, meta: dict | None
    ) -> int:
        """Builds the new registration whole (buffers, regions, store records) before it replaces
        the old one, which stays intact if anything fails; buffers of the same size are reused."""
        who, pack = f"publisher rank {self.rank}", not self.zero_copy
        layout, live, device = build_layout(self.rank, tensors, pack=pack, who=who, cast=cast, transforms=transforms)
        old = self._reg
        reg = self._build(layout, live, dict(tensors), device, old, transforms)
        reg.cast, reg.meta = cast, meta
        try:
            gen = _generation.join(self._base)
            chan = self._base.at(gen)
            # packs slots for the readers of this generation; the packed copy moves bytes as they
            # are, so a registration that casts (register(dtype=, transforms=)) keeps the plain layout
            if not self.zero_copy and not casts(layout, live):
                reg.packer = SlotPacker(chan, layout, int(reg.slots[0][0].numel()))
            if self._pending_epoch is not None and self._pending_epoch[0] == gen:
                reg.epoch = self._pending_epoch[1]  # a retry: this rank was already counted
            else:
                count = self._store.add(chan.keys.reg, 1)
                reg.epoch = (count - 1) // self.world_size + 1
                self._pending_epoch = (gen, reg.epoch)
            latest = VersionRecord.read(chan)
            chan.write(chan.keys.rank(reg.epoch, self.rank), self._record(reg))
            if self.rank == 0:
                _meta.write(chan, reg.epoch, meta)
        except BaseException:
            self._release_regions(reg)
            raise
        self._pending_epoch = None
        if gen != self._gen:
            if self._gen is not None:
                log.warning("publisher rank %d: the store was lost; joined its new generation", self.rank)
            self._gen, self._chan, self.keys = gen, chan, chan.keys
            self._tracker = SubscriberTracker(chan, aggregator=self.rank == 0, others=self.world_size > 1)
            self._committer = _commit.Committer(
                chan, self.rank, self.world_size, self.slots, self.checksums, self.zero_copy, self.mode
            )
        self._next_version = (latest.v if latest else 0) + 1
        with self._snap_lock:
            self._reg = reg
        if old is not None:
            self._release_regions(old)
            self._collect_epochs(old, reg.epoch)
        return reg.epoch

    def _collect_epochs(self, old: Registration, epoch: int) -> None:
        """Deletes this rank's records of the epochs two and more before ``epoch`` (its record and
        packed slot layouts): subscribers plan against the epoch of the version they read, at
        worst the one before. Best effort: a later registration tries again."""
        if old.epoch != epoch:
            self._old_epochs.append((old.epoch, old.packer.gen if old.packer is not None else 0))
        due = [(e, g) for e, g in self._old_epochs if e <= epoch - 2]
        if not due:
            return
        keys = [self.keys.rank(e, self.rank) for e, _ in due]
        keys += [self.keys.packed(e, self.rank, k) for e, g in due for k in range(1, g + 1)]
        try:
            self._store.delete_many(keys)
        except WBridgeError:
            return
        self._old_epochs = [x for x in self._old_epochs if x not in due]

    def _build(
        self, layout: RankLayout, live: dict, decls: Mapping, device: str, old: Registration | None, transforms: dict
    ) -> Registration:
        who = f"publisher rank {self.rank}"
        kinds = memory_kinds(list(self._transports))
        where = publisher_placement(device, kinds, auto=self._auto, zero_copy=self.zero_copy, who=who)
        served = {name: self._transports[name] for name in where.served}
        reg = build_registration(
            served, layout, live, decls, device, old, transforms, self.slots, self.zero_copy, where.device
        )
        if self.delta is not None:
            try:
                size = int(reg.slots[0][0].numel()) if layout.region_sizes else 0
                reg.delta = build_ring(served, size, self.delta.history, old and old.delta, staging_buffer)
            except BaseException:
                self._release_regions(reg)
                raise
        return reg

    def _record(self, reg: Registration) -> dict:
        served = {name: self._transports[name] for name in reg.served}
        return {**served_record(reg, served, self.rank, self.world_size, self.slots), "zone": self.zone}

    # ------------------------------------------------------------------------------------------
    def publish(self, timeout: float = 60.0) -> int:
        """Snapshots the live tensors as the next version; see the class docstring for who waits.

        Waits first for a ``publish_async()`` still in flight; ``timeout`` bounds both."""
        deadline = time.monotonic() + _validate.timeout(timeout, "publish() timeout")
        with self._start_lock:
            ready = self._begin(deadline, "publish()")
        return self._publish(deadline, ready, background=False)

    def publish_async(self, timeout: float = 60.0) -> Future[int]:
        """Starts ``publish(timeout)``'s work on the publisher's background thread and returns a
        ``Future`` of the version (or of the error ``publish()`` would raise: ``WaitTimeout``,
        ``StoreError``...; ``UsageError`` if the publisher closes meanwhile).

        Contract: until the future is done the caller may go on READING the registered tensors
        (the next step's forward and backward) but must not WRITE them; call ``.result()`` right
        before the optimizer step. A write during the copy publishes a torn version that no
        check downstream catches. Waits first for the publish already in flight, if any (at most
        one runs); calling it on a closed or unregistered publisher raises ``UsageError`` at once.
        On CUDA the copy waits for the work queued so far on the caller's current stream and runs
        on a stream of its own.
        """
        deadline = time.monotonic() + _validate.timeout(timeout, "publish_async() timeout")
        with self._start_lock:
            ready = self._begin(deadline, "publish_async()")
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"wbridge-publish-{self.channel}-{self.rank}")
            fut = self._worker.submit(self._publish, deadline, ready, True)
            self._inflight, self._inflight_deadline = fut, deadline
        return fut

    def _begin(self, deadline: float, what: str) -> Any:
        """Under ``_start_lock``: checks the call, waits out the publish in flight, and marks where
        the caller's writes end (a CUDA event on its current stream; None on the host)."""
        self._check_open()
        if self._reg is None:
            raise UsageError(f"publisher rank {self.rank}: {what} before register()")
        self._settle(deadline, what)
        self._check_open()  # close() may have begun while we waited
        device = self._reg.device
        if device == "cpu":
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def _settle(self, deadline: float, what: str) -> None:
        """Waits until the publish in flight (if any) is done; its outcome is its future's."""
        fut = self._inflight
        if fut is None:
            return
        done, _ = wait_futures([fut], timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise WaitTimeout(
                f"publisher rank {self.rank}: {what} timed out waiting for the publish of "
                f"version {self._next_version} still in flight"
            )
        self._inflight = None

    def _publish(self, deadline: float, ready: Any, background: bool) -> int:
        """The work of one publish, inline (``publish()``) or on the worker (``publish_async()``)."""
        if background:
            self._worker_ident = threading.get_ident()
        with self._store.deadline(deadline):  # every store call of this publish, not just its waits
            return self._publish_bounded(deadline, ready, background)

    def _publish_bounded(self, deadline: float, ready: Any, background: bool) -> int:
        reg = self._reg
        if reg is None:
            raise UsageError(f"publisher rank {self.rank} of channel {self.channel!r} closed while publishing")
        if _generation.current(self._base) != self._gen:
            # The store was lost (its host restarted, etcd wiped): what it counted is gone, so
            # register again in its new generation; versions count from its newest again.
            self._register(reg.decls, reg.cast, reg.transforms, reg.meta)
            reg = self._reg
        t0 = time.perf_counter()
        v = self._next_version
        self._wait_before_snapshot(v, v % self.slots, deadline)
        packing = (0, None)
        if reg.packer is not None:  # pack for the readers known now; later ones from the next version
            packing = reg.packer.choose(reg.epoch, self.rank, list(self._tracker.reader_layouts()))
        t1 = time.perf_counter()
        snap = _commit.snapshot(self._committer, reg, v, ready, packing, self._snap_lock, self._check_stopped)
        self._next_version = v + 1  # v is spent even where its commit fails: every rank moves on to v + 1
        _commit.commit(self._committer, snap)
        t2 = time.perf_counter()
        if self.mode == "sync" or self.zero_copy:
            self._wait_acked(v, deadline, f"publisher rank {self.rank}: acks of version {v}")
        if self.zero_copy:
            _commit.fence_off(self._committer, reg, snap.slot)
        t3 = time.perf_counter()
        nbytes = 0 if self.zero_copy else reg.layout.nbytes
        wait_s = (t1 - t0) + (t3 - t2)
        self.stats.add(PublishStats(v, snap.copy_s, wait_s, t3 - t0, nbytes, background, snap.seal_s, snap.encode_s))
        return v

    def wait_acked(self, version: int, timeout: float = 60.0) -> None:
        """Blocks until every live subscriber acked ``version`` or later."""
        self._check_open()
        version = _validate.integer(version, "wait_acked() version")
        deadline = time.monotonic() + _validate.timeout(timeout, "wait_acked() timeout")
        with self._store.deadline(deadline):
            self._wait_acked(version, deadline, f"acks of version {version}")

    def live_subscribers(self) -> int:
        return len(self._tracker.live())

    def wait_for_subscribers(self, n: int, timeout: float = 60.0) -> int:
        """Blocks until at least ``n`` subscribers are live; returns how many are."""
        self._check_open()
        if type(n) is not int or n < 0:  # noqa: E721 - bool is no count
            raise UsageError(f"publisher rank {self.rank}: wait_for_subscribers(n) needs an int >= 0, got {n!r}")
        timeout = _validate.timeout(timeout, "wait_for_subscribers() timeout")
        seen = [0]

        def probe():
            self._check_stopped()
            try:
                seen[0] = len(self._tracker.live())
            except StoreError:  # the store down for a while: polled again until the deadline
                return None
            return seen[0] if seen[0] >= n else None

        try:
            # every store call of the wait (reconnects included) ends by the caller's deadline
            with self._store.deadline(time.monotonic() + timeout):
                return Store.wait_until(probe, timeout, f"{n} live subscribers", poll=0.005, max_poll=0.1)
        except WaitTimeout:
            raise WaitTimeout(
                f"publisher rank {self.rank} of channel {self.channel!r}: {seen[0]} of {n} subscribers "
                f"live after {timeout:.1f}s"
            ) from None

    def subscribers(self) -> list[dict]:
        """The live subscribers: id, name, last acked version, version being read (0: none)."""
        self._check_open()
        return [{"id": s.id, "name": s.name, "acked": s.acked, "reading": s.reading} for s in self._tracker.live()]

    def evict(self, who: int | str) -> int:
        """Stops counting the live subscribers with id (an int) or name (a str) ``who`` now, as if
        their leases had lapsed, on every publisher rank; returns how many there were. For one known
        to be dead (its process was killed, its Ray actor restarted) that publishes would otherwise
        wait for until its lease lapses. One evicted while alive is not harmed: a read it is doing
        may fail stale (its slot is no longer held for it, never a torn read) and its next pull
        joins again under a new id, counted as before."""
        self._check_open()
        return len(self._tracker.evict(who))

    def _wait_acked(self, version: int, deadline: float, what: str) -> None:
        self._wait_subscribers(self.keys.acked(version), lambda s: s.acked >= version, deadline, what)

    def _wait_subscribers(self, key: str, pred, deadline: float, what: str) -> None:
        """Waits until ``pred`` holds for every live subscriber (``key`` says so once it does, see
        ``wbridge.publish.tracker``); close() cuts the wait short."""
        self._check_stopped()
        _left(deadline, what)
        try:
            self._tracker.wait(key, pred, deadline, what, self._check_stopped)
        except WaitTimeout as e:  # also the store's, when the deadline passed inside a call
            raise WaitTimeout(f"timed out waiting for {what}") from e

    def _check_stopped(self, v: int | None = None) -> None:
        if self._stop.is_set():
            during = f" while publishing version {v}" if v is not None else ""
            raise UsageError(f"publisher rank {self.rank} of channel {self.channel!r} closed{during}")

    def _wait_before_snapshot(self, v: int, slot: int, deadline: float) -> None:
        if self.mode == "one_step_off" and v > 1:
            what = f"publisher rank {self.rank}: acks of version {v - 1} before publishing {v}"
            self._wait_acked(v - 1, deadline, what)
        elif self.mode == "async" and v - self.max_staleness > 0:
            what = f"publisher rank {self.rank}: subscribers within {self.max_staleness} versions of {v}"
            self._wait_acked(v - self.max_staleness, deadline, what)
        if self.mode != "async" and not self.zero_copy:
            # Do not pull a slot from under a reader; async readers get StaleVersionError instead.
            def free(s) -> bool:
                r = s.reading
                return r <= 0 or r % self.slots != slot or r >= v

            what = f"publisher rank {self.rank}: readers of slot {slot}"
            self._wait_subscribers(self.keys.free(v), free, deadline, what)

    # ------------------------------------------------------------------------------------------
    def _release_registration(self) -> None:
        reg, self._reg = self._reg, None
        if reg is not None:
            self._release_regions(reg)

    def _release_regions(self, reg: Registration) -> None:
        release_regions(reg, self._transports)

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"publisher rank {self.rank} of channel {self.channel!r} is closed")

    def close(self) -> None:
        """Stops serving and releases memory registrations; idempotent. A publish in flight is told
        to stop waiting on subscribers (its future raises ``UsageError``) and gets ``CLOSE_WAIT_S``
        to finish; the staging slots are released only between snapshot copies."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        started = self._start_lock.acquire(timeout=CLOSE_WAIT_S)  # no publish starts from here on
        try:
            fut = self._inflight
            if fut is not None and not wait_futures([fut], timeout=CLOSE_WAIT_S).done:
                log.warning("publisher rank %d: closing with a publish still in flight", self.rank)
            worker, self._worker = self._worker, None
            if worker is not None:
                # not from the worker itself (a finalizer may run there): it cannot join itself
                own = threading.get_ident() == self._worker_ident
                worker.shutdown(wait=(fut is None or fut.done()) and not own)
        finally:
            if started:
                self._start_lock.release()
        with self._snap_lock:
            self._release_registration()
        for t in getattr(self, "_transports", {}).values():
            quietly(t.close)
        store = getattr(self, "_store", None)
        if store is not None:
            store.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("registered" if self._reg else "new")
        fut = getattr(self, "_inflight", None)
        if fut is not None and not fut.done():
            state += f", publishing {self._next_version}"
        return (
            f"Publisher({self.channel!r}, rank={self.rank}/{self.world_size}, mode={self.mode}, "
            f"version={self.version}, transports={list(getattr(self, '_transports', {}))}, {state})"
        )


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise WaitTimeout(f"timed out waiting for {what}")
    return left


__all__ = ["PublishStats", "Publisher", "PublisherStats"]
