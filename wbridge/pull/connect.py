"""Planning and connecting, once per publisher epoch: the session every pull of that epoch replays.

``setup`` reads the epoch's publisher records (one batched read), builds the plan against their
layouts (packed ones where the version record names a packing generation), and ``connect_all``
picks a transport per publisher rank (``transports.select``) and connects. ``failover`` plans
again over the ranks still alive when sources die mid-read (their DP replicas hold the same bytes).
"""

from __future__ import annotations

import logging

from planner.builder import build_plan
from planner.layout import RankLayout
from transports.base import ReadBatch

from .._deadline import Deadline
from .._lifecycle import quietly
from .._selection import candidates
from .._tensors import commit_pairs
from ..errors import IntegrityError, StaleVersionError, StoreError, TransportError, WaitTimeout
from ..options import MAX_SLOTS
from ..protocol import generation as _generation
from ..protocol.packing import layout_hash, packed_layout
from ..protocol.version import VersionRecord
from .context import PullContext
from .session import Session, Source, SourcesFailed, connect_source, failed_sources, replan

log = logging.getLogger("wbridge")

RECORD_WAIT_SLICE_S = 1.0  # a rank record is waited for in slices this long, the store's generation checked between


def setup(ctx: PullContext, rec: VersionRecord, gens: tuple[int, ...], deadline: Deadline) -> Session:
    """Fetches the epoch's publisher records, plans, chooses transports and connects."""
    ctx.drop_session()
    keys = [ctx.keys.rank(rec.epoch, r) for r in range(rec.world_size)]
    records = []
    for r, (key, raw) in enumerate(zip(keys, ctx.store.get_many(keys))):
        if raw is None:  # committed before this rank's record was visible? wait for it
            raw = _wait_record(ctx, rec, r, key, deadline)
        records.append(ctx.member.chan.open(key, raw))
    ctx.nslots = min(MAX_SLOTS, max(int(d.get("slots", 1)) for d in records))
    layouts = [
        packed_layout(ctx.member.chan, rec.epoch, r, g) if g else RankLayout.from_dict(d["layout"])
        for r, (d, g) in enumerate(zip(records, gens))
    ]
    _check_sealed(rec, records, layouts, keys)
    plan = build_plan(layouts, ctx.dest.layout)
    session = Session(rec.epoch, rec.world_size, plan, [], layouts, records, gens=gens, incs=rec.incs)
    return connect_all(ctx, session, deadline)


def _wait_record(ctx: PullContext, rec: VersionRecord, rank: int, key: str, deadline: Deadline) -> bytes:
    """Publisher rank ``rank``'s record of ``rec``'s epoch, waited for in slices: a store that lost
    its history meanwhile (a new generation) will never show it, and that ends the wait at once
    (``StaleVersionError``: the pull reads the new history), not at the pull's deadline."""
    while True:
        try:
            return ctx.store.wait(key, min(deadline.left(), RECORD_WAIT_SLICE_S))
        except WaitTimeout:
            if deadline.expired:
                raise WaitTimeout(
                    f"subscriber {ctx.name}: publisher rank {rank} of epoch {rec.epoch} never registered"
                ) from None
        if _generation.current(ctx.member.base) != ctx.member.gen:
            raise StaleVersionError(f"version {rec.v}: the store lost its history while it was being planned")


def _check_sealed(rec: VersionRecord, records: list[dict], layouts: list[RankLayout], keys: list[str]) -> None:
    """What a plan is made from must be what the version record sealed: each rank record of the
    incarnation that published ``rec`` (``StoreError``: a record of a lost history, or of a trainer
    restarted at the same epoch number), each slot layout of the hash ``rec`` names
    (``IntegrityError``: a plan against another packing would scatter the slot's bytes)."""
    for r, (d, lay, key) in enumerate(zip(records, layouts, keys)):
        if rec.incs and d.get("inc") != rec.incs[r]:
            raise StoreError(
                f"publisher rank {r}: its record at {key!r} is of another incarnation than the one that "
                f"published version {rec.v} (a store that lost its history, or a record put back?)"
            )
        if rec.layouts and layout_hash(lay) != rec.layouts[r]:
            raise IntegrityError(
                f"publisher rank {r}: the slot layout of packing generation {rec.packing[r] if rec.packing else 0} "
                f"read from the store is not the one version {rec.v} was copied with"
            )


def failover(ctx: PullContext, session: Session, failed: SourcesFailed, deadline: Deadline) -> Session:
    """Plans again over the ranks still alive (replicas hold the same bytes) and connects;
    ``failed.error`` if some byte has no replica left."""
    plan, dead = replan(session, ctx.dest.layout, failed)
    log.warning("subscriber %s: publisher ranks %s failed; reading from replicas", ctx.name, sorted(dead))
    ctx.drop_session()
    new = Session(
        session.epoch, session.world_size, plan, [], session.layouts, session.records, dead, session.gens, session.incs
    )
    return connect_all(ctx, new, deadline)


def connect_all(ctx: PullContext, session: Session, deadline: Deadline) -> Session:
    """Connects to every source of ``session.plan`` (planning around ranks that cannot be
    reached); the session becomes the context's current one."""
    plan = session.plan
    ctx.stats.plans += 1
    ctx.stats.bytes_per_source = plan.bytes_per_source()
    sources = session.sources
    try:
        for src_ops in plan.sources:
            d = session.records[src_ops.src_rank]
            batch = ReadBatch(
                src_ops.src_region, src_ops.src_offset, src_ops.dst_region, src_ops.dst_offset, src_ops.nbytes
            )
            try:
                sources.append(_connect(ctx, src_ops.src_rank, d, batch, deadline))
            except TransportError as e:  # unreachable (dead?): its replicas may stand in
                err = failed_sources([(src_ops.src_rank, e)])
                if err is e:
                    raise
                raise err from e
    except BaseException as e:
        for src in sources:
            quietly(ctx.endpoints[src.transport].disconnect, src.peer)
        if isinstance(e, SourcesFailed):
            return failover(ctx, session, e, deadline)
        raise
    ctx.size_pool(max(2, len(sources)))  # (2 at least: a delta pull's checksums and headers read again)
    dest = ctx.dest
    if dest.staged:
        dest.commit = commit_pairs(plan, dest.layout, dest.live, dest.buffers[0])
    ctx.session = session
    return session


def _connect(ctx: PullContext, rank: int, record: dict, batch: ReadBatch, deadline: Deadline) -> Source:
    """Connects to one publisher rank over the best transport that works; ``auto`` falls back
    to the next candidate (``local`` -> ``tcp``, say) when one cannot connect."""
    remote = record.get("caps")
    if not isinstance(remote, dict):
        raise StoreError(f"publisher rank {rank}: record lacks its capabilities")
    ends = ctx.endpoints
    options = candidates(ends.preference, ends.caps, remote)
    src, reason = connect_source(rank, record, batch, options, ends.open, deadline, ctx.name)
    ctx.stats.transports[rank] = (src.transport, reason)
    log.info("subscriber %s reads publisher rank %d over %s (%s)", ctx.name, rank, src.transport, reason)
    return src


__all__ = ["connect_all", "failover", "setup"]
