"""What a subscriber plans once per publisher epoch and replays every pull: the plan, and per
source rank the connection and prepared reads. Also which ranks it gave up on (failover)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planner.builder import build_plan
from planner.errors import PlanError
from planner.layout import RankLayout
from planner.plan import Plan
from transports.base import ReadBatch
from transports.errors import AuthError, TransportError


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
    stamp_region: Any = None
    stamp_prepared: dict[int, Any] = field(default_factory=dict)  # slot -> prepared stamp read


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
    gens: tuple[int, ...] = ()  # packing generation of each rank's slot (wbridge._packing)


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
