"""What publishers and subscribers record about each publish and pull (``pub.stats``, ``sub.stats``).

Both ``pub.stats`` (a :class:`PublisherStats`) and ``sub.stats`` (a :class:`SubscriberStats`) have the
same shape: ``last`` (the newest record, or None), ``history`` (the newest :data:`HISTORY` records,
oldest first) and running totals over every record since construction: ``count``, ``nbytes`` and
``seconds``, plus the totals that only one side has.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

HISTORY = 1024  # records kept in ``stats.history``; the totals count every record

_T = TypeVar("_T")


@dataclass
class PublishStats:
    """One ``publish()``: its version, where its time went and the bytes it staged."""

    version: int
    stall_s: float  # snapshot copy: the time the trainer's own memory was busy
    wait_s: float  # time blocked on subscribers (mode semantics and slot leases)
    seconds: float  # the whole publish, wait and stall included
    nbytes: int  # bytes copied into the staging slot (0 with zero_copy=True)
    background: bool = False  # run by publish_async(): stall_s overlapped the caller's compute
    delta_s: float = 0.0  # Publisher(delta=True): the delta and checksums of the staged copy (not in stall_s)
    encode_s: float = 0.0  # the delta's scan and coding: CPU seconds of the publishing thread (0: no delta)


@dataclass
class PullStats:
    """One successful ``pull()``: its version, time, bytes read and how."""

    version: int
    seconds: float
    nbytes: int
    ops: int
    retries: int
    nbytes_from_publishers: int = 0  # of nbytes: read from publisher ranks
    nbytes_from_peers: int = 0  # of nbytes: read from relaying subscribers of the zone
    repaired: int = 0  # delta pulls: chunks whose bytes failed the checksum and were read in full
    delta: bool = False  # True when this pull applied deltas, False for a full pull
    delta_reason: str = ""  # why: "delta", or why not ("cost", "no-base"...: ``wbridge.pull.delta.DELTA_REASONS``)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Stats(Generic[_T]):
    """The shape both sides share: ``last``, ``history`` and totals (``count``, ``nbytes``, ``seconds``)."""

    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def last(self) -> _T | None:
        return self.history[-1] if self.history else None

    def add(self, record: _T) -> None:
        self.history.append(record)
        self.count += 1
        self.nbytes += record.nbytes
        self.seconds += record.seconds


@dataclass
class PublisherStats(_Stats[PublishStats]):
    """``pub.stats``: ``last``, ``history`` (of :class:`PublishStats`) and totals over every publish:
    ``count``, ``nbytes``, ``seconds``, ``stall_s``, ``wait_s``."""

    stall_s: float = 0.0
    wait_s: float = 0.0

    def add(self, record: PublishStats) -> None:
        super().add(record)
        self.stall_s += record.stall_s
        self.wait_s += record.wait_s


@dataclass
class SubscriberStats(_Stats[PullStats]):
    """``sub.stats``: ``last``, ``history`` (of :class:`PullStats`) and totals over every pull: ``count``,
    ``nbytes``, ``seconds``, ``retries``, ``deltas`` (pulls that applied deltas); plus the current plan's
    ``transports`` (publisher rank -> (transport, why)), ``bytes_per_source`` and ``plans`` made."""

    retries: int = 0
    deltas: int = 0
    transports: dict[int, tuple[str, str]] = field(default_factory=dict)  # src rank -> (name, reason)
    bytes_per_source: dict[int, int] = field(default_factory=dict)  # of the current plan
    plans: int = 0

    def add(self, record: PullStats) -> None:
        super().add(record)
        self.retries += record.retries
        self.deltas += record.delta
