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
from concurrent.futures import Future
from typing import Any

import transports as _transports
from planner.layout import Declaration

from . import _validate
from ._deadline import Deadline
from ._lifecycle import Closeable, log, quietly
from ._selection import RDMA_FIRST, rdma_present
from ._stats import PublisherStats, PublishStats
from .errors import UsageError
from .options import Async, Staging, ZeroCopy, mode_of
from .protocol import generation as _generation
from .protocol.channel import ChannelStore
from .protocol.keys import Keys
from .publish import commit as _commit
from .publish import register as _registering
from .publish.inflight import InFlight
from .publish.staging import Registration, release_regions, writes_end
from .publish.tracker import SubscriberTracker
from .publish.waits import SyncWaits
from .store import DEFAULT_CONNECT_TIMEOUT, Store, open_store


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
        rank, world_size = _validate.rank(rank, world_size)
        connect_timeout = _validate.timeout(connect_timeout, "connect_timeout", positive=True)
        token = _validate.token(token)
        host = _validate.host(host, f"publisher rank {rank}")
        transport = _validate.transport_names(transport, "transport")
        names = served_transports(transport)
        classes = {name: _transports.get(name) for name in names}  # a missing extra: refused now
        opts = _validate.transport_options(
            transport_options, "transport_options", None if transport == "auto" else names, token
        )
        self.channel, self.rank, self.world_size, self.host, self.token = channel, rank, world_size, host, token
        self.mode, self.max_staleness, self.staging, self.slots = mode, max_staleness, staging, staging.slots
        self.zero_copy, self.checksums, self.delta = isinstance(staging, ZeroCopy), staging.checksums, staging.delta
        self._gen: str | None = None  # the store generation registered in (see _generation)
        self._epochs = _registering.Epochs(rank, world_size)
        self._closed = False
        self._lock = threading.Lock()
        self._reg: Registration | None = None
        self.stats = PublisherStats()
        self._connect_timeout = connect_timeout
        self._flight = InFlight(rank, channel)  # publish_async(): at most one publish in flight
        self._snap_lock = threading.Lock()  # held while the staging slots are written
        self._store = open_store(store, host_store=host_store, connect_timeout=connect_timeout)
        self._base = ChannelStore(self._store, Keys(channel), token)
        self._join(self._base)  # (of a generation once registered)
        self._next_version = 0
        self._transports: dict[str, _transports.Transport] = {}
        try:
            self._transports = _registering.serve(classes, opts, token, host, f"publisher rank {rank}", transport)
        except BaseException:
            self.close()
            raise
        self._registrar = _registering.Registrar(
            rank, world_size, self.zone, self._transports, transport == "auto", self.zero_copy, self.slots, self.delta
        )

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
        cast, transforms, meta = _registering.check(self._registrar, tensors, dtype, transforms, metadata)
        with self._flight.lock:
            deadline = Deadline(self._flight.deadline.at + self._connect_timeout)  # the publish's, and the store's
            self._flight.settle(deadline, "register()", self._next_version)
            return self._register(tensors, cast, transforms, meta)

    def _register(
        self, tensors: Mapping[str, tuple[Any, Declaration]], cast: str | None, transforms: dict, meta: dict | None
    ) -> int:
        """Builds the new registration whole (buffers, regions, store records: ``publish.register``)
        before it replaces the old one, which stays intact if anything fails."""
        old = self._reg
        reg = _registering.build(self._registrar, tensors, cast, transforms, meta, old)
        gen, chan, latest = _registering.announce(self._registrar, self._base, reg, self._epochs)
        if gen != self._gen:
            if self._gen is not None:
                log.warning("publisher rank %d: the store was lost; joined its new generation", self.rank)
            self._gen = gen
            self._join(chan)
        self._next_version = (latest.v if latest else 0) + 1
        with self._snap_lock:
            self._reg = reg
        if old is not None:
            release_regions(old, self._transports)
            self._epochs.collect(chan, old, reg.epoch)
        return reg.epoch

    def _join(self, chan: ChannelStore) -> None:
        """Works in ``chan``'s store generation from here on: its keys, and the subscriber tracker
        (rank 0 aggregates subscriber progress for every rank, ``wbridge.publish.tracker``), waits and
        committer over it."""
        self.keys = chan.keys
        self._tracker = SubscriberTracker(chan, aggregator=self.rank == 0, others=self.world_size > 1)
        who, stopped = f"publisher rank {self.rank}", self._flight.check_stopped
        self._waits = SyncWaits(self._tracker, who, self.mode, self.max_staleness, self.slots, self.zero_copy, stopped)
        self._committer = _commit.Committer(
            chan, self.rank, self.world_size, self.slots, self.checksums, self.zero_copy, self.mode
        )

    # ------------------------------------------------------------------------------------------
    def publish(self, timeout: float = 60.0) -> int:
        """Snapshots the live tensors as the next version; see the class docstring for who waits.

        Waits first for a ``publish_async()`` still in flight; ``timeout`` bounds both."""
        deadline = Deadline.after(_validate.timeout(timeout, "publish() timeout"))
        with self._flight.lock:
            ready = self._begin(deadline, "publish()")
        return self._publish(deadline, ready)

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
        deadline = Deadline.after(_validate.timeout(timeout, "publish_async() timeout"))
        with self._flight.lock:
            ready = self._begin(deadline, "publish_async()")
            return self._flight.submit(deadline, self._publish, deadline, ready, True)

    def _begin(self, deadline: Deadline, what: str) -> Any:
        """Under the start lock: checks the call, waits out the publish in flight, and marks where
        the caller's writes end (a CUDA event on its current stream; None on the host)."""
        self._check_open()
        if self._reg is None:
            raise UsageError(f"publisher rank {self.rank}: {what} before register()")
        self._flight.settle(deadline, what, self._next_version)
        self._check_open()  # close() may have begun while we waited
        return writes_end(self._reg.device)

    def _publish(self, deadline: Deadline, ready: Any, background: bool = False) -> int:
        """The work of one publish, inline (``publish()``) or on the worker (``publish_async()``):
        the sync mode's waits (``publish.waits``) around the commit sequence (``publish.commit``)."""
        with self._store.deadline(deadline.at):  # every store call of this publish, not just its waits
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
            self._waits.before_snapshot(v, deadline)
            packing = (0, None)
            if reg.packer is not None:  # pack for the readers known now; later ones from the next version
                packing = reg.packer.choose(reg.epoch, self.rank, list(self._tracker.reader_layouts()))
            t1 = time.perf_counter()
            stopped = self._flight.check_stopped
            snap = _commit.snapshot(self._committer, reg, v, ready, packing, self._snap_lock, stopped)
            self._next_version = v + 1  # v is spent even where its commit fails: every rank moves on to v + 1
            _commit.commit(self._committer, snap)
            t2 = time.perf_counter()
            self._waits.after_commit(v, deadline)
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
        deadline = Deadline.after(_validate.timeout(timeout, "wait_acked() timeout"))
        with self._store.deadline(deadline.at):
            self._waits.acked(version, deadline, f"acks of version {version}")

    def live_subscribers(self) -> int:
        return len(self._tracker.live())

    def wait_for_subscribers(self, n: int, timeout: float = 60.0) -> int:
        """Blocks until at least ``n`` subscribers are live; returns how many are."""
        self._check_open()
        return self._waits.live(n, timeout)

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

    # ------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"publisher rank {self.rank} of channel {self.channel!r} is closed")

    def close(self) -> None:
        """Stops serving and releases memory registrations; idempotent. A publish in flight is told
        to stop waiting on subscribers (its future raises ``UsageError``) and gets
        ``wbridge.publish.inflight.CLOSE_WAIT_S`` to finish; the staging slots are released only
        between snapshot copies."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._flight.close()  # no publish starts from here on
        with self._snap_lock:
            reg, self._reg = self._reg, None
            if reg is not None:
                release_regions(reg, self._transports)
        for t in getattr(self, "_transports", {}).values():
            quietly(t.close)
        store = getattr(self, "_store", None)
        if store is not None:
            store.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("registered" if self._reg else "new")
        flight = getattr(self, "_flight", None)
        if flight is not None and flight.busy:
            state += f", publishing {self._next_version}"
        return (
            f"Publisher({self.channel!r}, rank={self.rank}/{self.world_size}, mode={self.mode}, "
            f"version={self.version}, transports={list(getattr(self, '_transports', {}))}, {state})"
        )


__all__ = ["PublishStats", "Publisher", "PublisherStats"]
