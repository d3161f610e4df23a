"""Delta updates, subscriber side: a pull that reads only the changes since the version held,
where that is cheaper than a full read on the link.

A subscriber whose destination holds version ``a`` of the same publisher epoch, pulling ``v`` with
``v - a <= k`` (the publisher's ring of deltas, ``wbridge.publish.delta``), first asks the cost
choice (``wbridge.pull.delta_cost``) whether a delta pull is worth trying on its link. Where its
reads cover every chunk of each source's slot and the version record says each delta's bytes, it
asks again on those exact sizes and reads each source's deltas ``a + 1 .. v`` whole, with the slot
stamps, in one batched read: each delta's digest says whether the read saw it as its publisher
wrote it (one read). Otherwise it reads per source rank the headers and tables of the deltas
(one batched read), asks again on their exact sizes, then reads the stream bytes of just the chunks
its own reads cover, and the headers again with the stamps while it decodes (three). A delta
buffer rewritten meanwhile makes the pull go full (a digest that does not match while the headers
read again are the same: ``malformed``, bad bytes); a slot reused, ``StaleVersionError``
(``wbridge.pull.delta_reads``). The checksum
records come from the store while the deltas are on the wire. Deltas are in ``v``'s slot byte order,
which the session plans against, whatever packing ``a`` was read in; every delta since ``a`` must be
in that order. It adds the byte differences (on the host one compiled call per delta over every
read, on a device a scatter per destination region and delta), and then always verifies every byte
it covers against the publisher's chunk checksums (cut at the slot's cells: a reader packed for
re-reads nothing to check): a chunk that does not match (its
memory was changed by someone else, bad bytes, a bit flip) is read in full from the slot and written
back (``repaired`` in the stats). Anything that makes the deltas unusable or dearer before the first
byte is written makes the caller pull in full; ``PullStats.delta_reason`` says why
(``DELTA_REASONS``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transports.errors import TransportError

from .._deadline import Deadline
from .._lifecycle import quietly
from ..protocol import checksum as _checksum
from ..protocol.stamps import STAMP_BYTES
from . import delta_reads as _reads
from .context import Held, PullContext, PullResult
from .delta_cost import DELTA_REASONS, DeltaPull, Guess, LinkCost, Timed, after_tables, before_tables, link
from .session import Session, Source, fetch_chunk


def why_not(ctx: PullContext, session: Session, rec: Any, held: Held | None) -> str | None:
    """Why ``rec`` cannot be pulled as deltas onto the version ``held`` (a ``DELTA_REASONS`` value),
    None where it can be tried. The packing generations may differ: a delta is encoded in the byte
    order of its own version's slot, which the session plans against."""
    if held is None or not 0 < rec.v - held.v:
        return "no-base"
    if (held.epoch, held.incs) != (rec.epoch, rec.incs):
        return "new-epoch"
    geo = _reads.prepare(ctx, session)
    if not session.sources:
        return "publisher-no-delta"
    for s in session.sources:
        g = geo.get(s.rank)
        if isinstance(g, str):
            return g
    if any(rec.v - held.v > len(geo[s.rank].descs) for s in session.sources):
        return "too-far-behind"
    return None


def usable(ctx: PullContext, session: Session, rec: Any, held: Held | None) -> bool:
    """Whether ``rec`` can be pulled as deltas onto the version ``held``."""
    return why_not(ctx, session, rec, held) is None


@dataclass(frozen=True)
class Choice:
    """What ``choose`` did: the delta pull's result (None: the caller pulls in full), why
    (``DELTA_REASONS``), and the bytes and reads it spent before declining (headers, tables)."""

    result: PullResult | None
    reason: str
    nbytes: int = 0
    ops: int = 0


def choose(ctx: PullContext, session: Session, rec: Any, held: Held | None, deadline: Deadline) -> Choice:
    """A delta pull of ``rec`` onto ``held`` where it is possible and estimated cheaper than a
    full read on this link; else, before any write, why not (the caller pulls in full)."""
    reason = why_not(ctx, session, rec, held)
    if reason is not None:
        return Choice(None, reason)
    cost = ctx.costs.setdefault(link(session), LinkCost())
    full_bytes = sum(session.delta[s.rank].full for s in session.sources)
    guess = before_tables(cost, rec.v - held.v, full_bytes, ctx.verify)
    if guess.declined:
        return Choice(None, "cost")
    return _pull(ctx, session, rec, held.v, deadline, cost, guess, stamp=True)


def pull(ctx: PullContext, session: Session, rec: Any, base: int, deadline: Deadline) -> PullResult | None:
    """Pulls ``rec`` as the deltas since ``base`` into ``dest`` and verifies it (repairing what
    does not match), whatever it costs; None before any write if the deltas cannot be used (the
    caller pulls in full)."""
    if not 0 < rec.v - base or any(isinstance(g, str) for g in _reads.prepare(ctx, session).values()):
        return None
    if not session.sources or any(rec.v - base > len(session.delta[s.rank].descs) for s in session.sources):
        return None
    return _pull(ctx, session, rec, base, deadline, None, None).result


def _setup_seconds(session: Session) -> float:
    return sum(x.spent for g in session.delta.values() if not isinstance(g, str) for x in g.scratches)


def _pull(
    ctx: PullContext,
    session: Session,
    rec: Any,
    base: int,
    deadline: Deadline,
    cost: LinkCost | None,
    guess: Guess | None,
    stamp: bool = False,
) -> Choice:
    """The delta pull proper: the choice on the deltas' exact sizes (``cost`` and ``guess``; None:
    whatever it costs; a reader of whole slots on the version record's, before it reads the deltas
    whole, any other on their tables', before it reads their streams), the digests checked or the
    headers read again (the checksums read from the store meanwhile), decode, apply,
    verify-and-repair. ``stamp``: the slot stamps come with the last delta reads (a reader of whole
    deltas: with its one read), and the result says so where nothing was read from the slots after
    them (``PullResult.stamped``)."""
    t0 = time.perf_counter()
    spent = _setup_seconds(session)
    geo = [session.delta[s.rank] for s in session.sources]
    got: dict[int, _reads.Fetched] = {}
    read: dict[int, _reads.HeadsRead] = {}
    hs: dict[int, _reads.Heads] = {}
    stable: Callable[[], bool] | None = None

    def declined(reason: str) -> Choice:  # (with the bytes and reads spent so far)
        if stable is not None:  # (its read lands in a scratch buffer the next pull reuses)
            quietly(stable)
        nbytes = sum(got[r].nbytes if r in got else h.nbytes for r, h in read.items())
        ops = sum(got[r].ops if r in got else len(h.us) * (1 + (stable is not None)) for r, h in read.items())
        return Choice(None, reason, nbytes, ops)

    m, full_bytes, partial = rec.v - base, sum(g.full for g in geo), sum(g.partial for g in geo)
    us = np.arange(base + 1, rec.v + 1, dtype=np.int64)
    sizes = {s.rank: _reads.whole_deltas(session.delta[s.rank], rec, s.rank, us) for s in session.sources}
    whole = all(x is not None for x in sizes.values())
    if whole:  # the version record says each delta's bytes: the choice on them, before any read
        guessed = round(cost.pairs * m) if cost is not None and cost.pairs is not None else 0
        reason = after_tables(cost, guess, guessed, sum(int(x.sum()) for x in sizes.values()), partial, m, full_bytes)
        if reason is not None:
            return Choice(None, reason)
    sums = _sums_ahead(ctx, session.sources, rec, deadline)  # (from the store, while the headers are read)
    at_once = rec.stamp if stamp and whole else None  # (the stamps in the one read of whole deltas)
    try:
        for src in session.sources:
            t = ctx.endpoints[src.transport]
            read[src.rank] = _reads.read_heads(t, src, session, rec, base, deadline, sizes[src.rank], at_once)
        for src in session.sources:
            h = _reads.heads(src, session, rec, read[src.rank])
            if h == "torn":  # the headers read again tell a rewrite under the read from bad bytes
                t = ctx.endpoints[src.transport]
                h = "malformed" if _reads.recheck(t, src, session, read[src.rank], deadline) else "header-changed"
            if isinstance(h, str):
                return declined(h)
            hs[src.rank] = h
        pairs, nbytes = sum(h.pairs for h in hs.values()), sum(h.stream_bytes for h in hs.values())
        reason = None if whole else after_tables(cost, guess, pairs, nbytes, partial, m, full_bytes)
        if reason is not None:
            return declined(reason)
        for src in session.sources:
            got[src.rank] = _reads.fetch(ctx.endpoints[src.transport], src, session, hs[src.rank], deadline)
        if not all(h.intact for h in hs.values()):  # (read in parts, or no digest to check)
            stable = _recheck_behind(ctx, session, read, rec.stamp if stamp else None, deadline)
    except TransportError:
        return declined("source-failed")  # the full pull reads around a dead source (failover) or reports it
    tr = time.perf_counter()
    decoded = [_reads.decode(src, session, hs[src.rank], got[src.rank]) for src in session.sources]
    check, stable = stable, None  # (waited for here, whatever it says)
    try:
        if check is not None and not check():
            return declined("header-changed")
    except TransportError:
        return declined("source-failed")
    if any(d is None for d in decoded):
        return declined("malformed")  # before any write
    for src, d in zip(session.sources, decoded):
        _reads.apply(ctx.dest.buffers, src, session, d, ctx.pool)
    t1 = time.perf_counter()
    repair = verify_repair(ctx, session.sources, rec, deadline, sums())
    read_bytes = sum(r.nbytes for r in got.values())
    if cost is not None:  # (the time spent setting up scratch buffers is not a delta's cost)
        setup = _setup_seconds(session) - spent
        reads = Timed(read_bytes, tr - t0 - setup)
        verified = Timed(full_bytes, time.perf_counter() - t1)
        cost.delta_pull(DeltaPull(pairs, nbytes, rec.v - base, reads, Timed(pairs, t1 - tr), verified))
    read_bytes += repair.nbytes + STAMP_BYTES * len(session.sources)  # the stamps (read with the headers, or after)
    ops = sum(r.ops for r in got.values()) + repair.ops + len(session.sources)
    done = PullResult(read_bytes, 0, ops, repair.chunks, delta=True, reason="delta", stamped=stamp and not repair.ops)
    return Choice(done, "delta")


def _recheck_behind(
    ctx: PullContext, session: Session, hs: dict[int, _reads.HeadsRead], stamp: Any, deadline: Deadline
) -> Callable[[], bool]:
    """Starts reading every source's delta headers again (``delta_reads.recheck``: with ``stamp``,
    and the slot stamps) on the pull's threads, while this one parses and decodes the streams (it
    writes nothing), and returns what waits for them: whether no delta was rewritten under the reads."""

    def again() -> bool:
        return all(
            _reads.recheck(ctx.endpoints[src.transport], src, session, hs[src.rank], deadline, stamp)
            for src in session.sources
        )

    return _started(ctx, again)


def _sums_ahead(ctx: PullContext, sources: Sequence[Source], rec: Any, deadline: Deadline) -> Callable[[], dict]:
    """Starts reading the checksum records of ``rec`` of ``sources`` from the store on the pull's
    threads (while the delta reads are on the wire) and returns what waits for them."""
    ranks = [src.rank for src in sources]

    def read() -> dict:
        with ctx.chan.store.deadline(deadline.at):  # (the pull's deadline: it is per thread)
            return _checksum.read_sums(ctx.chan, rec, ranks)

    return _started(ctx, read)


def _started(ctx: PullContext, work: Callable[[], Any]) -> Callable[[], Any]:
    """``work`` started on the pull's threads, and what waits for its result (without a pool, the
    waiting call runs it)."""
    return work if ctx.pool is None else ctx.pool.submit(work).result


@dataclass(frozen=True)
class Repair:
    """What verification repaired: chunks read again in full and written back, and the bytes and
    reads that took (re-reads of chunks covered in part included)."""

    chunks: int
    nbytes: int
    ops: int


def verify_repair(
    ctx: PullContext, sources: Sequence[Source], rec: Any, deadline: Deadline, known: dict | None = None
) -> Repair:
    """Verifies every byte the sources' reads cover against the publisher's chunk sums (``known``:
    their checksum records, read already; else read here); a chunk that does not match is read in
    full from the slot and written into ``dest``."""
    import torch

    if known is None:
        known = _checksum.read_sums(ctx.chan, rec, [src.rank for src in sources])
    dest = ctx.dest.buffers
    repaired = nbytes = ops = 0
    for src in sources:
        sums = known[src.rank]
        fetch = fetch_chunk(ctx.endpoints[src.transport], src, rec.slot, deadline)
        count = [0, 0]

        def counted(region: int, offset: int, n: int, fetch: Any = fetch, count: list = count) -> np.ndarray:
            count[0] += n
            count[1] += 1
            return fetch(region, offset, n)

        def write(dreg: int, doff: int, data: np.ndarray) -> None:
            dest[dreg][doff : doff + len(data)].copy_(torch.from_numpy(np.ascontiguousarray(data)))

        where = f"publisher rank {src.rank}, version {rec.v}"
        repaired += _checksum.verify_reads(
            src.batch, sums, dest, counted, where=where, repair=write, cache=src.checks, pool=ctx.pool
        )
        nbytes, ops = nbytes + count[0], ops + count[1]
    return Repair(repaired, nbytes, ops)


__all__ = [
    "DELTA_REASONS",
    "Choice",
    "LinkCost",
    "Repair",
    "choose",
    "link",
    "pull",
    "usable",
    "verify_repair",
    "why_not",
]
