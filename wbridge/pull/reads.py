"""A subscriber's reads of one version: post every source's prepared batch (all sources in
parallel), read the slot stamps back after the data (the seqlock check), and verify what was read
against the publishers' chunk checksums. Sources come from the session (``wbridge.pull.session``)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from transports.base import ReadBatch

from .._deadline import Deadline
from ..errors import IntegrityError, StaleVersionError, TransportError, UsageError
from ..protocol.checksum import read_sums, tensor_at
from ..protocol.stamps import STAMP_BYTES, Stamp
from ..protocol.version import VersionRecord
from .context import PullContext
from .session import Source, failed_sources, fetch_chunk, verify_source


def prepare_sources(ctx: PullContext, sources: Sequence[Source], slot: int) -> None:
    """Prepares each source's batch for ``slot`` where not done yet (once per slot and session);
    a source that fails to is left to ``read_sources`` (which reports it as it does a failed read)."""
    for src in sources:
        if slot not in src.prepared:
            t = ctx.endpoints[src.transport]
            try:
                src.prepared[slot] = t.prepare(
                    src.peer, src.regions[slot], ctx.endpoints.regions(src.transport), src.batch
                )
            except TransportError:
                continue


def read_sources(ctx: PullContext, sources: Sequence[Source], slot: int, deadline: Deadline) -> None:
    """Posts each source's batch for ``slot`` (prepared once per slot, then replayed); raises
    ``SourcesFailed`` where sources stopped answering (replicas may stand in)."""

    def one(src: Source) -> None:
        prep = src.prepared.get(slot)
        t = ctx.endpoints[src.transport]
        if prep is None:
            prep = t.prepare(src.peer, src.regions[slot], ctx.endpoints.regions(src.transport), src.batch)
            src.prepared[slot] = prep
        t.read(prep, timeout=deadline.check(f"subscriber {ctx.name}: pull timed out before reading rank {src.rank}"))

    errors = _each(ctx.pool, [s for s in sources if len(s.batch)], one)
    if errors:
        err = failed_sources(errors)
        if err is errors[0][1]:
            raise err
        raise err from errors[0][1]


def _each(pool: ThreadPoolExecutor, sources: Sequence[Source], one: Any) -> list[tuple[int, BaseException]]:
    """Runs ``one(src)`` for every source, in parallel on ``pool`` where there are several (one
    source runs in the calling thread: a thread hop costs more than a memory read) and returns
    ``(rank, error)`` of those that raised, once every call is over."""
    if len(sources) == 1:
        try:
            one(sources[0])
        except BaseException as e:  # noqa: BLE001 - collected, then raised by the caller
            return [(sources[0].rank, e)]
        return []
    futures = [(src.rank, pool.submit(one, src)) for src in sources]
    errors = [(rank, f.exception()) for rank, f in futures]  # every call over before any error
    return [(rank, e) for rank, e in errors if e is not None]


def check_stamps(
    ctx: PullContext,
    sources: Sequence[Source],
    want: Stamp,
    deadline: Deadline,
    pool: ThreadPoolExecutor | None = None,
    failover: bool = False,
) -> None:
    """Reads every source's stamp of slot ``want.slot`` after the data: unless each still says
    ``want`` ("version v of epoch e, stable"), the slot changed under the reads (the seqlock check;
    the store's fence is only a hint, since the store is not trusted). ``pool``: the threads to
    read them on (the context's).
    ``failover=True``: sources that stopped answering raise ``SourcesFailed`` (what they sent is
    unconfirmed; their replicas may stand in), not the first one's ``TransportError``."""
    slot = want.slot

    def one(src: Source) -> None:
        t = ctx.endpoints[src.transport]
        prep = src.stamp_prepared.get(slot)
        if prep is None:
            stamp_index = len(src.regions[slot]) - 1
            prep = t.prepare(
                src.peer,
                src.regions[slot],
                [src.stamp_region],
                ReadBatch.of([(stamp_index, 0, 0, 0, STAMP_BYTES)]),
            )
            src.stamp_prepared[slot] = prep
        t.read(prep, timeout=deadline.left(0.1))
        stamp_read(src, want)

    errors = _each(pool or ctx.pool, sources, one)
    if errors:
        raise failed_sources(errors) if failover else errors[0][1]


def stamp_read(src: Source, want: Stamp) -> None:
    """Checks the stamp just read into ``src.stamp``: ``StaleVersionError`` unless it says ``want``."""
    got = tuple(src.stamp_words.tolist())
    if got != want.words:
        raise StaleVersionError(
            f"publisher rank {src.rank}: slot {want.slot} holds version {got[1]} (state {got[2]}), not version {want.v}"
        )


def verify_sources(
    ctx: PullContext,
    sources: Sequence[Source],
    rec: VersionRecord,
    deadline: Deadline,
    known: dict | None = None,
    partial: bool = True,
) -> None:
    """Checks every chunk the plan read from each source against the publisher's sums. ``known``:
    sums read already, by rank (of this very version); those read here are added to it.
    ``partial=False``: chunks the reads cover only in part are left to a later check of the whole
    destination instead of being read again from the publisher."""
    known = read_sums(ctx.chan, rec, [src.rank for src in sources], known)
    name_at = tensor_at(ctx.dest.layout)
    for src in sources:
        t = ctx.endpoints[src.transport]
        fetch = fetch_chunk(t, src, rec.slot, deadline) if partial else None
        verify_source(src, rec, known[src.rank], ctx.dest.buffers, fetch, name_at)


def verify_held(ctx: PullContext, deadline: Deadline) -> int:
    """Checks the bytes the destination holds (the live tensors; staged: the private buffer they
    were committed from, and that they still equal it) against the publishers' checksums of the
    version it holds, chunks the plan covers in part read again from the publishers; returns that
    version. ``UsageError`` where it holds none, or the publishers keep no checksums;
    ``StaleVersionError`` where that version's checksums were collected (newer versions replaced it);
    ``IntegrityError`` naming the tensor and the chunk that differ."""
    rec, session = ctx.record, ctx.session
    if rec is None:
        raise UsageError(f"subscriber {ctx.name}: verify() before a whole version is held (pull() first)")
    if not rec.checksums:
        raise UsageError(
            f"subscriber {ctx.name}: verify(): the publishers of channel {ctx.channel!r} keep no checksums "
            "(Staging(checksums=False)); drop checksums=False to make versions checkable"
        )
    gens = rec.packing or (0,) * rec.world_size
    if session is None or (session.epoch, session.gens, session.incs) != (rec.epoch, gens, rec.incs):
        raise UsageError(f"subscriber {ctx.name}: verify(): version {rec.v} is no longer planned for: pull() again")
    verify_sources(ctx, session.sources, rec, deadline)
    for live, private in ctx.dest.commit if ctx.dest.staged else []:
        if not _equal(live, private):
            raise IntegrityError(
                f"subscriber {ctx.name}: a registered tensor differs from version {rec.v} as it was committed "
                "(written to since the pull?)"
            )
    return rec.v


def _equal(a: Any, b: Any) -> bool:
    return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else bool(a.equal(b))


__all__ = ["check_stamps", "prepare_sources", "read_sources", "stamp_read", "verify_held", "verify_sources"]
