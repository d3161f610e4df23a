"""What publishers and subscribers record about each publish and pull (``pub.stats``, ``sub.stats``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PublishStats:
    version: int
    stall_s: float  # snapshot copy: the time the trainer's own memory was busy
    wait_s: float  # time blocked on subscribers (mode semantics and slot leases)
    total_s: float
    nbytes: int
    background: bool = False  # run by publish_async(): stall_s overlapped the caller's compute
    delta_s: float = 0.0  # Publisher(delta=True): the delta and checksums of the staged copy (not in stall_s)


@dataclass
class PullStats:
    version: int
    seconds: float
    nbytes: int
    ops: int
    retries: int
    nbytes_from_publishers: int = 0  # of nbytes: read from publisher ranks
    nbytes_from_peers: int = 0  # of nbytes: read from relaying subscribers of the zone
    repaired: int = 0  # delta pulls: chunks whose bytes failed the checksum and were read in full
    delta: bool = False  # True when this pull applied deltas, False for a full pull

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
