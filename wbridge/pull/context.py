"""What the pull pipeline's stages share: one typed context per subscriber, one value per attempt.

``Subscriber`` owns a ``PullContext`` and hands it to every stage (``version``, ``connect``,
``reads``, ``delta``, ``zone``, ``apply``); no stage sees the subscriber itself. The context holds
the subscriber's store connection and membership (keys, id, lease), the transports it opened
(``Endpoints``), where pulls land (``Destination``), the session planned for the current publisher
epoch, and what the subscriber knows of the channel's versions (``newest``, ``held``).

An ``Attempt`` is one try at applying one version: its record, the session it reads through, the
version the destination held before and the pull's deadline. ``apply`` makes it once the session
is set up and hands it to the reads; a failover that connects a new session replaces it
(``dataclasses.replace(attempt, session=...)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import transports as _transports
from planner.layout import RankLayout
from transports import select as _select

from .._deadline import Deadline
from .._lifecycle import quietly
from .._selection import memory_kind, memory_kinds, reaching
from .._stats import PullStats, SubscriberStats
from .._tensors import address
from ..protocol.channel import ChannelStore
from ..protocol.keys import Keys
from ..protocol.version import VersionRecord
from ..store import Store
from .membership import Membership
from .session import Session

log = logging.getLogger("wbridge")


@dataclass(frozen=True)
class Held:
    """A version the destination holds whole: its number, publisher epoch, packing generations and
    the publishers' incarnations (a delta is applied only onto a version of the same incarnations:
    a trainer restarted at the same epoch number keeps other deltas)."""

    v: int
    epoch: int
    gens: tuple[int, ...]
    incs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Attempt:
    """One try at applying a version.

    - ``rec``: the version record being read.
    - ``session``: the session it reads through (a new one after a failover: ``replace`` it).
    - ``held``: what the destination held whole before (deltas apply onto it); None: nothing whole.
    - ``deadline``: the pull's.
    """

    rec: VersionRecord
    session: Session
    held: Held | None
    deadline: Deadline


@dataclass(frozen=True)
class PullResult:
    """What one application of a version read: bytes from publishers and from relays of the zone,
    reads posted, chunks repaired by verification, whether it applied deltas, and whether it read
    the slot stamps after its last read already (the seqlock check needs no read of its own)."""

    from_publishers: int
    from_peers: int
    ops: int
    repaired: int = 0
    delta: bool = False
    reason: str = ""  # why it was a delta or a full pull (``wbridge.pull.delta.DELTA_REASONS``)
    stamped: bool = False  # the slot stamps were read after every read of it (a delta pull reads them early)

    @property
    def nbytes(self) -> int:
        return self.from_publishers + self.from_peers

    def stats(self, version: int, seconds: float, retries: int) -> PullStats:
        """The pull's record for ``Subscriber.stats``: this result of version ``version``, pulled in
        ``seconds`` after ``retries`` retries."""
        return PullStats(
            version, seconds, self.nbytes, self.ops, retries, self.from_publishers, self.from_peers,
            self.repaired, self.delta, self.reason,
        )  # fmt: skip


@dataclass
class Destination:
    """Where pulls land, one per ``register()``.

    - ``layout``: the subscriber's ``RankLayout``.
    - ``live``: the registered tensors by name.
    - ``buffers``: uint8 views the reads write into, one per region (staged: the private buffer).
    - ``device``: where they live (``"cpu"``, ``"cuda:0"``...): ``"cpu"`` for a private buffer in
      host memory in front of device tensors (host staging, ``wbridge._selection``).
    - ``staged``: reads land in a private buffer, copied into ``live`` once every read succeeded.
    """

    layout: RankLayout
    live: dict[str, Any]
    buffers: list[Any]
    device: str
    staged: bool
    commit: list[tuple[Any, Any]] = field(default_factory=list)  # staged: (live, private) views of the plan


class Endpoints:
    """The transports a subscriber opened, each with the destination buffers registered.

    - ``token``: the channel's shared secret (authenticates to publishers and relays).
    - ``host``: the address the transports bind and advertise.
    - ``options``: per-transport constructor keywords, ``{"tcp": {...}}``.
    - ``preference``: ``"auto"`` or the one transport name to use.
    """

    def __init__(
        self, token: bytes | None, host: str, options: Mapping[str, Mapping[str, Any]], preference: str
    ) -> None:
        self.token, self.host, self.options, self.preference = token, host, options, preference
        # nccl joins process groups, so auto picks it only where the publisher opted in by serving
        # it (Publisher(transport=[..., "nccl"])); this side accepts it wherever it is installed
        self.installed = self.caps = _select.capabilities(nccl=True)  # caps: narrowed by ``bind``
        self._open: dict[str, _transports.Transport] = {}
        self._regions: dict[str, list[Any]] = {}
        self._buffers: list[Any] = []
        self._device = "cpu"
        self._wrap: Callable[[_transports.Transport], _transports.Transport] | None = None

    def wrap(self, fn: Callable[[_transports.Transport], _transports.Transport]) -> None:
        """Opens every transport from now on through ``fn(transport)`` (fault injection:
        ``wbridge.testing.faults.inject``)."""
        self._wrap = fn

    def bind(self, buffers: list[Any], device: str) -> None:
        """Closes what is open; transports opened from now on register ``buffers``, which live on
        ``device``: ``caps`` lists only the transports that reach that memory from now on."""
        self.close()
        self._buffers, self._device = buffers, device
        kind = memory_kind(device)
        if kind == "cpu":  # every transport reaches host memory
            self.caps = self.installed
        else:
            reach = reaching(memory_kinds(self.installed["transports"]), device)
            self.caps = {**self.installed, "transports": reach, "memory": kind}

    def open(self, name: str) -> _transports.Transport:
        """Transport ``name``, opened (and the destination registered with it) on first use."""
        t = self._open.get(name)
        if t is None:
            cls = _transports.get(name)
            t = cls(token=self.token, host=self.host, **dict(self.options.get(name, {})))
            if self._wrap is not None:
                t = self._wrap(t)
            self._open[name] = t
            self._regions[name] = [t.register(address(b), int(b.numel()), device=self._device) for b in self._buffers]
        return t

    def __getitem__(self, name: str) -> _transports.Transport:
        return self._open[name]

    def get(self, name: str) -> _transports.Transport | None:
        return self._open.get(name)

    def regions(self, name: str) -> list[Any]:
        """The destination buffers' registrations with transport ``name`` (opened already)."""
        return self._regions[name]

    def names(self) -> list[str]:
        return list(self._open)

    def close(self) -> None:
        """Deregisters the destination and closes every transport; idempotent."""
        for name, regions in self._regions.items():
            for r in regions:
                quietly(self._open[name].deregister, r)
        for t in self._open.values():
            quietly(t.close)
        self._open, self._regions = {}, {}


@dataclass
class PullContext:
    """A subscriber's pull-side state, shared by the stages of ``wbridge.pull``.

    - ``store``: the subscriber's store connection.
    - ``name``: the subscriber's name (in logs and errors).
    - ``channel``: the channel name.
    - ``member``: its membership (store generation, keys, id, lease).
    - ``endpoints``: the transports it opened.
    - ``verify``: check full pulls against the publishers' chunk checksums.
    - ``stats``: where plans and pulls are recorded (``Subscriber.stats``).
    """

    store: Store
    name: str
    channel: str
    member: Membership
    endpoints: Endpoints
    verify: bool
    stats: SubscriberStats
    dest: Destination | None = None
    session: Session | None = None  # planned for the current publisher epoch
    version: int | None = None  # the version the live tensors hold whole (None: none, or a mix)
    identity: tuple | None = None  # that version's ``VersionRecord.identity``
    record: VersionRecord | None = None  # that version's record (what ``Subscriber.verify()`` checks against)
    held: Held | None = None  # the version the destination buffers hold whole
    newest: int = 0  # the newest version number seen; records older than it are refused
    newest_epoch: int = 0  # that version's publisher epoch (epochs never go back in one history)
    newest_incs: tuple[str, ...] = ()  # its publishers' incarnations (fixed within one epoch)
    losses: int = 0  # how often the store was found to have lost its history (``forget``)
    forgotten: int = 0  # the newest version number of the histories forgotten (their floors are void)
    nslots: int = 1  # fences read along with the version record: slots 0 .. nslots - 1
    costs: dict[str, Any] = field(default_factory=dict)  # link -> what its pulls cost (``pull.delta.LinkCost``)
    _pool: ThreadPoolExecutor | None = None
    _pool_size: int = 0

    @property
    def chan(self) -> ChannelStore:
        """The channel's store, keys and token in the generation joined (reads sealed records)."""
        return self.member.chan

    @property
    def keys(self) -> Keys:
        """The channel's store keys in the generation joined."""
        return self.member.keys

    @property
    def pool(self) -> ThreadPoolExecutor | None:
        """Threads for reading sources in parallel (sized by ``size_pool``)."""
        return self._pool

    def size_pool(self, n: int) -> None:
        """At least ``n`` threads in ``pool`` (one per source read in parallel)."""
        if self._pool_size < n:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool_size = max(1, n)
            self._pool = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="wbridge-pull")

    def drop_session(self) -> None:
        """Releases the session's prepared reads and connections; the next pull plans again."""
        session, self.session = self.session, None
        if session is None:
            return
        for close in session.closers:
            quietly(close)
        for src in session.sources:
            t = self.endpoints.get(src.transport)
            if t is None:
                continue
            for prep in [*src.prepared.values(), *src.stamp_prepared.values()]:
                quietly(t.release, prep)
            if src.stamp_region is not None:
                quietly(t.deregister, src.stamp_region)
            if src.peer is not None:
                quietly(t.disconnect, src.peer)

    def holds(self, rec: VersionRecord) -> bool:
        """Whether the live tensors hold version record ``rec`` whole: the same number, publisher
        epoch and nonce (``VersionRecord.identity``), never the number alone."""
        return self.version is not None and self.identity == rec.identity

    def hold(self, rec: VersionRecord | None) -> None:
        """The live tensors now hold ``rec`` whole (None: no whole version)."""
        self.version = None if rec is None else rec.v
        self.identity = None if rec is None else rec.identity
        self.record = rec

    def see(self, rec: VersionRecord) -> None:
        """Version record ``rec`` was read: the newest seen, if it is (``pull.version.lost_history``)."""
        if rec.v >= self.newest:
            self.newest, self.newest_epoch, self.newest_incs = rec.v, rec.epoch, rec.incs

    def forget(self) -> None:
        """The store lost its history (a new generation, or an old one put back): nothing known of
        it holds (counted in ``losses``)."""
        self.drop_session()
        self.hold(None)
        self.forgotten = max(self.forgotten, self.newest)
        self.newest, self.newest_epoch, self.newest_incs, self.held = 0, 0, (), None
        self.losses += 1

    def floor(self, after: int) -> int:
        """``after``, a version number a caller waits past, or 0 where it counted a history the store
        lost: above every version seen since, at most the newest of the histories forgotten."""
        return 0 if self.losses and self.newest < after <= self.forgotten else after

    def close(self) -> None:
        self.drop_session()
        self.endpoints.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool, self._pool_size = None, 0


__all__ = ["Attempt", "Destination", "Endpoints", "Held", "PullContext", "PullResult"]
