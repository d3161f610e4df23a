"""A subscriber's reads of one version: post every source's prepared batch (all sources in
parallel), read the slot stamps back after the data (the seqlock check), and verify what was read
against the publishers' chunk checksums. Sources come from the session (``wbridge.pull.session``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from transports.base import ReadBatch

from ..errors import StaleVersionError, TransportError, WaitTimeout
from ..protocol.stamps import STAMP_BYTES, STAMP_MAGIC, STAMP_STABLE
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


def read_sources(ctx: PullContext, sources: Sequence[Source], slot: int, deadline: float) -> None:
    """Posts each source's batch for ``slot`` (prepared once per slot, then replayed); raises
    ``SourcesFailed`` where sources stopped answering (replicas may stand in)."""

    def one(src: Source) -> None:
        prep = src.prepared.get(slot)
        t = ctx.endpoints[src.transport]
        if prep is None:
            prep = t.prepare(src.peer, src.regions[slot], ctx.endpoints.regions(src.transport), src.batch)
            src.prepared[slot] = prep
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"subscriber {ctx.name}: pull timed out before reading rank {src.rank}")
        t.read(prep, timeout=left)

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
    rec: Any,
    deadline: float,
    pool: ThreadPoolExecutor | None = None,
    failover: bool = False,
) -> None:
    """Reads every source's slot stamp after the data: unless each still says "version v,
    stable", the slot changed under the reads (the seqlock check; the store's fence is only a
    hint, since the store is not trusted). ``pool``: the threads to read them on (the context's).
    ``failover=True``: sources that stopped answering raise ``SourcesFailed`` (what they sent is
    unconfirmed; their replicas may stand in), not the first one's ``TransportError``."""
    want = (STAMP_MAGIC, rec.v, STAMP_STABLE, rec.epoch)

    def one(src: Source) -> None:
        t = ctx.endpoints[src.transport]
        prep = src.stamp_prepared.get(rec.slot)
        if prep is None:
            stamp_index = len(src.regions[rec.slot]) - 1
            prep = t.prepare(
                src.peer,
                src.regions[rec.slot],
                [src.stamp_region],
                ReadBatch.of([(stamp_index, 0, 0, 0, STAMP_BYTES)]),
            )
            src.stamp_prepared[rec.slot] = prep
        t.read(prep, timeout=max(0.1, deadline - time.monotonic()))
        got = tuple(int(x) for x in src.stamp.numpy().view(np.uint64))
        if got != want:
            raise StaleVersionError(
                f"publisher rank {src.rank}: slot {rec.slot} holds version "
                f"{got[1]} (state {got[2]}), not version {rec.v}"
            )

    errors = _each(pool or ctx.pool, sources, one)
    if errors:
        raise failed_sources(errors) if failover else errors[0][1]


def verify_sources(
    ctx: PullContext,
    sources: Sequence[Source],
    rec: Any,
    deadline: float,
    known: dict | None = None,
    partial: bool = True,
) -> None:
    """Checks every chunk the plan read from each source against the publisher's sums. ``known``:
    sums read already, by rank (of this very version); those read here are added to it.
    ``partial=False``: chunks the reads cover only in part are left to a later check of the whole
    destination instead of being read again from the publisher."""
    known = {} if known is None else known
    todo = [src for src in sources if src.rank not in known]
    sum_keys = [ctx.keys.sums(rec.v, src.rank) for src in todo]
    for src, key, raw in zip(todo, sum_keys, ctx.store.get_many(sum_keys) if todo else []):
        if raw is None:  # written before the commit: collected since, so the slot was reused
            raise StaleVersionError(f"checksums of version {rec.v} were collected (a newer version replaced it)")
        known[src.rank] = ctx.chan.open(key, raw)
    for src in sources:
        t = ctx.endpoints[src.transport]
        fetch = fetch_chunk(t, src, rec.slot, deadline) if partial else None
        verify_source(src, rec, known[src.rank], ctx.dest.buffers, fetch)


__all__ = ["check_stamps", "prepare_sources", "read_sources", "verify_sources"]
