"""What a subscriber plans once per publisher epoch and replays every pull: the plan, and per
source rank the connection and prepared reads. Also which ranks it gave up on (failover)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.builder import build_plan
from planner.errors import PlanError
from planner.layout import RankLayout
from planner.plan import Plan
from transports.base import ReadBatch
from transports.errors import AuthError, TransportError

from .._deadline import Deadline
from .._tensors import address, alloc_bytes
from ..protocol import checksum as _checksum
from ..protocol.records import unb64
from ..protocol.stamps import STAMP_BYTES
from ..protocol.version import VersionRecord

log = logging.getLogger("wbridge")


@dataclass
class Source:
    rank: int
    transport: str
    endpoint: bytes
    regions: list[list[bytes]]  # slot -> region descriptors
    batch: ReadBatch
    peer: Any = None
    prepared: dict[int, Any] = field(default_factory=dict)  # slot -> prepared read
    stamp: Any = None  # where the slot's stamp is read to
    stamp_words: Any = None  # ``stamp`` as numpy uint64 words (``reads.stamp_read``)
    stamp_region: Any = None
    stamp_prepared: dict[int, Any] = field(default_factory=dict)  # slot -> prepared stamp read
    checks: dict = field(default_factory=dict)  # what ``batch`` covers of the checksum chunks (``verify_reads``)


@dataclass
class Session:
    """Everything planned for one publisher epoch; replayed by every pull of that epoch."""

    epoch: int
    world_size: int
    plan: Plan
    sources: list[Source]
    layouts: list[RankLayout]
    records: list[dict]  # the publisher ranks' records, by rank
    dead: frozenset[int] = frozenset()  # ranks that failed mid-read: planned around
    gens: tuple[int, ...] = ()  # packing generation of each rank's slot (``protocol.packing``)
    incs: tuple[str, ...] = ()  # each rank's incarnation (``protocol.version.RankPart``)
    delta: dict[int, Any] | None = None  # each source's delta geometry (``pull.delta``), once computed
    closers: list[Callable[[], None]] = field(default_factory=list)  # run when the session is dropped


class SourcesFailed(Exception):
    """Internal: reads from ``ranks`` failed at the transport (the ranks died, say); ``error`` is
    the first such failure, raised as is if no replica can stand in for them."""

    def __init__(self, ranks: set[int], error: TransportError) -> None:
        super().__init__(str(error))
        self.ranks, self.error = ranks, error


def failed_sources(errors: list[tuple[int, BaseException]]) -> BaseException:
    """What a batch of failed source reads raises: ``SourcesFailed`` if every failure is a source
    that stopped answering (a replica may stand in), else the first error."""
    if all(isinstance(e, TransportError) and not isinstance(e, AuthError) for _, e in errors):
        return SourcesFailed({r for r, _ in errors}, errors[0][1])
    return errors[0][1]


def replan(session: Session, dest: RankLayout, failed: SourcesFailed) -> tuple[Plan, frozenset[int]]:
    """A plan over the ranks still alive; the original transport error if some byte has no replica."""
    dead = session.dead | failed.ranks
    try:
        plan = build_plan([lay for lay in session.layouts if lay.rank not in dead], dest)
    except PlanError:
        raise failed.error from None
    return plan, dead


__all__ = ["Session", "Source", "SourcesFailed", "failed_sources", "replan"]


def fetch_chunk(t: Any, src: Source, slot: int, deadline: Deadline) -> Any:
    """A ``fetch(region, offset, n)`` that reads ``n`` bytes of ``src``'s slot into fresh memory
    (for re-reading one chunk when verifying a pull) by ``deadline``."""

    def fetch(region: int, offset: int, n: int) -> np.ndarray:
        scratch = alloc_bytes(n, "cpu")
        local = t.register(address(scratch), n)
        try:
            prep = t.prepare(src.peer, src.regions[slot], [local], ReadBatch.of([(region, offset, 0, 0, n)]))
            try:
                t.read(prep, timeout=deadline.left(0.1))
            finally:
                t.release(prep)
        finally:
            t.deregister(local)
        return scratch.numpy()

    return fetch


def verify_source(
    src: Source, rec: VersionRecord, sums: dict, dest: list[Any], fetch: Any, name_at: Any = None
) -> None:
    """Checks every chunk the plan read from ``src`` against its publisher rank's ``sums``
    (``protocol.checksum.read_sums``: of this very version, incarnation and slot layout);
    ``name_at`` names the destination tensor in errors (``protocol.checksum.tensor_at``)."""
    where = f"publisher rank {src.rank}, version {rec.v}"
    _checksum.verify_reads(src.batch, sums, dest, fetch, where=where, name_at=name_at, cache=src.checks)


def connect_source(
    rank: int, record: dict, batch: ReadBatch, options: list, transport: Any, deadline: Deadline, who: str
) -> tuple[Source, str]:
    """Connects to publisher rank ``rank`` over the first of ``options`` (``(name, reason)``, best
    first) that connects; ``transport(name)`` opens the local side. Returns the source and why
    that transport (with the ones that failed first)."""
    tried = []
    for i, (name, reason) in enumerate(options):
        served = record["transports"][name]
        src = Source(
            rank=rank,
            transport=name,
            endpoint=unb64(served["endpoint"]),
            regions=[[unb64(x) for x in slot] for slot in served["regions"]],
            batch=batch,
        )
        try:
            t = transport(name)
            src.peer = t.connect(src.endpoint, timeout=deadline.left(0.1))
            src.stamp = alloc_bytes(STAMP_BYTES, "cpu")
            src.stamp_words = src.stamp.numpy().view(np.uint64)
            src.stamp_region = t.register(address(src.stamp), STAMP_BYTES)
        except TransportError as e:
            if isinstance(e, AuthError) or i == len(options) - 1:
                raise
            tried.append(f"{name}: {e}")
            log.warning(
                "subscriber %s: %s to publisher rank %d failed (%s); trying %s", who, name, rank, e, options[i + 1][0]
            )
            continue
        return src, (f"{reason}; after {'; '.join(tried)}" if tried else reason)
    raise TransportError(f"publisher rank {rank}: no transport to try")
