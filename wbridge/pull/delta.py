"""Delta updates, subscriber side: a pull that reads only the changes since the version held,
where that is cheaper than a full read on the link.

A subscriber whose destination holds version ``a`` of the same publisher epoch, pulling ``v`` with
``v - a <= k`` (the publisher's ring of deltas, ``wbridge.publish.delta``), first estimates what a
delta pull and a full read would cost on its link (``LinkCost``: running costs measured as it
pulls; ``choose``). Where the delta is cheaper it reads per source rank the headers and offset
tables of the deltas ``a + 1 .. v`` (one batched read), decides again on their exact entry count,
then reads the entries of just the chunks its own reads cover (one batched read: one row per run
of adjacent chunks per delta), then the headers again (a delta buffer rewritten meanwhile: the pull
goes full). Deltas are in ``v``'s slot byte order, which the session plans against, whatever packing
``a`` was read in; every delta since ``a`` must be in that order. It applies the deltas in order
with one vectorised scatter per destination region and then always verifies every byte it covers
against the publisher's chunk checksums (cut at the slot's cells: a reader packed for re-reads
nothing to check): a chunk that does not match (its memory was changed by someone else, bad bytes,
a bit flip) is read in full from the slot and written back (``repaired`` in the stats). Anything
that makes the deltas unusable or dearer before the first byte is written makes the caller pull in
full; ``PullStats.delta_reason`` says why (``DELTA_REASONS``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transports.base import ReadBatch
from transports.errors import TransportError

from .._lifecycle import quietly
from .._tensors import address, alloc_bytes
from ..protocol import checksum as _checksum
from ..protocol.delta import (
    CHUNK_BYTES,
    CHUNK_WORDS,
    DELTA_MAGIC,
    DELTA_NONE,
    DELTA_STABLE,
    HEADER_BYTES,
    geometry,
    table_bytes,
)
from ..protocol.records import unb64
from ..protocol.stamps import STAMP_BYTES
from .context import Held, PullContext, PullResult
from .session import Session, Source, fetch_chunk


@dataclass
class _Scratch:
    """A host buffer registered with one transport (grown on demand)."""

    buf: Any = None
    region: Any = None
    spent: float = 0.0  # seconds spent allocating and registering (not a delta's cost: done once)

    def ensure(self, t: Any, n: int) -> None:
        if self.buf is not None and int(self.buf.numel()) >= n:
            return
        t0 = time.perf_counter()
        self.release(t)
        self.buf = alloc_bytes(max(n, 4096), "cpu")
        self.region = t.register(address(self.buf), int(self.buf.numel()))
        self.spent += time.perf_counter() - t0

    def release(self, t: Any) -> None:
        if self.region is not None:
            quietly(t.deregister, self.region)
        self.buf = self.region = None


@dataclass
class _Geometry:
    """What one source's plan batch covers, computed once per session: its reads sorted by source
    offset, and the runs of adjacent delta chunks they touch (inclusive chunk indices)."""

    soff: np.ndarray
    end: np.ndarray
    dreg: np.ndarray
    doff: np.ndarray
    run_lo: np.ndarray
    run_hi: np.ndarray
    chunks: np.ndarray  # every chunk of the runs, ascending
    unit: int  # 2: every read starts, ends and lands on even bytes (scatter words), else 1 (bytes)
    perm: np.ndarray  # reads ordered by destination region (stable), so one scatter per region
    groups: np.ndarray  # in ``perm`` order: the index of each region's first read, and len(perm)
    partial: int  # bytes of the checksum chunks these reads cover only in part (re-read to verify)
    full: int  # bytes of a full read
    nchunks: int
    descs: list[bytes]
    head: _Scratch
    check: _Scratch
    entries: _Scratch


def _geometry(src: Source, slot_bytes: int, descs: list[bytes], sum_starts: np.ndarray) -> _Geometry | None:
    b = src.batch
    geo = geometry(slot_bytes)
    if geo is None or (len(b) and np.any(b.src_region != 0)):
        return None
    order = np.argsort(b.src_offset, kind="stable")
    soff, n = b.src_offset[order], b.nbytes[order]
    end = soff + n
    if len(soff) > 1 and np.any(soff[1:] < end[:-1]):
        return None  # overlapping reads of one source: one slot byte, two destinations
    keep = n > 0
    # (the odd last byte of a slot is in no word, nor chunk: deltas never change it)
    c0, c1 = soff[keep] // CHUNK_BYTES, np.minimum((end[keep] - 1) // CHUNK_BYTES, geo[0] - 1)
    # merge [c0, c1] ranges that overlap or touch into runs
    reach = np.maximum.accumulate(c1) if len(c1) else c1
    starts = np.ones(len(c0), dtype=bool)
    starts[1:] = c0[1:] > reach[:-1] + 1
    first = np.flatnonzero(starts)
    last = np.append(first[1:] - 1, len(c0) - 1).astype(np.int64) if len(first) else first
    run_lo, run_hi = c0[first], reach[last] if len(last) else last
    size = run_hi - run_lo + 1
    chunks = np.arange(int(size.sum()), dtype=np.int64) - np.repeat(np.cumsum(size) - size - run_lo, size)
    doff, dreg = b.dst_offset[order], b.dst_region[order]
    unit = 2 if not (np.any(soff % 2) or np.any(end % 2) or np.any(doff % 2)) else 1
    perm = np.argsort(dreg, kind="stable")
    groups = np.append(np.flatnonzero(np.diff(dreg[perm], prepend=-1)), len(perm))
    # bytes covered below x: cum[i] + (x - soff[i]) clipped, for the last read starting below x
    cum = np.concatenate(([0], np.cumsum(n)))
    edges = np.append(sum_starts, slot_bytes)  # the checksum chunks (``checksum.slot_edges``)
    i = np.searchsorted(soff, edges, side="right") - 1
    below = np.where(i >= 0, cum[np.maximum(i, 0)] + np.clip(edges - soff[np.maximum(i, 0)], 0, n[np.maximum(i, 0)]), 0)
    covered, length = np.diff(below), np.diff(edges)
    partial = int(length[(covered > 0) & (covered < length)].sum())
    return _Geometry(
        soff // unit,
        end // unit,
        dreg,
        doff // unit,
        run_lo,
        run_hi,
        chunks,
        unit,
        perm,
        groups,
        partial,
        int(n.sum()),
        geo[0],
        descs,
        _Scratch(),
        _Scratch(),
        _Scratch(),
    )


def why_not(ctx: PullContext, session: Session, rec: Any, held: Held | None) -> str | None:
    """Why ``rec`` cannot be pulled as deltas onto the version ``held`` (a ``DELTA_REASONS`` value),
    None where it can be tried. The packing generations may differ: a delta is encoded in the byte
    order of its own version's slot, which the session plans against."""
    if held is None or not 0 < rec.v - held.v:
        return "no-base"
    if (held.epoch, held.incs) != (rec.epoch, rec.incs):
        return "new-epoch"
    geo = _prepare(ctx, session)
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


def _prepare(ctx: PullContext, session: Session) -> dict[int, _Geometry | str]:
    """Each source's delta geometry (or why it has none), computed once per session (its scratch
    buffers are released with the session)."""
    if session.delta is not None:
        return session.delta
    geo: dict[int, _Geometry | str] = {}
    for src in session.sources:
        served = session.records[src.rank]["transports"].get(src.transport, {})
        descs = served.get("delta")
        sizes = session.layouts[src.rank].region_sizes
        if not isinstance(descs, list) or not descs or not sizes:
            geo[src.rank] = "publisher-no-delta"
            continue
        size = int(sizes[0])
        starts = _checksum.slot_edges(session.layouts[src.rank], size)
        geo[src.rank] = _geometry(src, size, [unb64(d) for d in descs], starts) or "unsupported-plan"
    endpoints = ctx.endpoints

    def release() -> None:
        for src in session.sources:
            g, t = geo.get(src.rank), endpoints.get(src.transport)
            if isinstance(g, _Geometry) and t is not None:
                for scratch in (g.head, g.check, g.entries):
                    scratch.release(t)

    session.delta = geo
    session.closers.append(release)
    return geo


DELTA_REASONS = {
    "delta": "the pull applied deltas",
    "cost": "deltas were possible but estimated slower (or more bytes) than a full read on this link",
    "no-base": "the destination holds no whole version to apply deltas to (first pull, or one that failed)",
    "new-epoch": "the publishers registered again (or were restarted) since the version held",
    "too-far-behind": "more versions since the one held than the publishers keep deltas of",
    "publisher-no-delta": "the publishers keep no deltas (no Staging(delta=...)) over this transport",
    "no-delta": "a version since the one held has no delta (too many changes, or none to compare to)",
    "new-layout": "a delta since the one held is in another packing generation's byte order",
    "header-changed": "the ring was rewritten (for newer versions) before or while the deltas were read",
    "source-failed": "a source failed while its deltas were read (the full read fails over)",
    "malformed": "a delta's table or entries did not make sense",
    "unsupported-plan": "the plan reads one slot byte twice or from a region a delta does not cover",
    "zone": "read through the zone's relays",
}  # the values of ``PullStats.delta_reason``

ALPHA = 0.3  # weight of the newest count of entries per version (an EWMA)
WINDOW = 8  # a running cost (seconds per unit) is the least of this many latest measurements
PROBES = 2  # delta pulls measured before any is declined by cost (the first pays one-time costs)
PROBE_EVERY = 32  # a pull in this many chosen full by cost tries the deltas again (costs drift)
SURE = 1.0  # a decline on the exact count by this makes the next guesses decline without the tables
SKIP_MARGIN = 2.0  # the tables are not even read where deltas were guessed this much slower (``sure``: 1)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


def _least(seen: deque[float], new: float) -> float:
    """The running cost after measuring ``new``: the least of the latest ``WINDOW`` measurements.
    A busy host only ever adds time to a pull, so one slow measurement (a descheduled process, a
    first pull's one-time costs) does not turn the choice for the next ``PROBE_EVERY`` pulls, and
    a link that really got slower shows within ``WINDOW`` measurements."""
    seen.append(new)
    return min(seen)


@dataclass
class LinkCost:
    """What pulls over one link (the transports a session reads over) have cost, measured as they
    go: the subscriber pulls deltas only where they are estimated cheaper than a full read.

    - ``full``: seconds per byte of a full read (its reads, as posted).
    - ``waits``: seconds of a delta pull's reads beyond their bytes at the ``full`` rate (round trips).
    - ``cpu``: seconds per delta entry to decode and scatter it.
    - ``check``: seconds per byte of a delta pull's verification (hashing, chunks re-read).
    - ``entries``: delta entries per version the reads covered (to decide before reading tables).
    - ``declined``: pulls chosen full by cost since the last delta pull (a probe every ``PROBE_EVERY``).
    - ``sure``: the last pull was declined on the tables' exact count by ``SURE``: guesses are trusted as is.
    - ``probes``: delta pulls measured so far (none is declined by cost before ``PROBES``).
    - ``seen``: the latest ``WINDOW`` measurements of each cost in seconds.

    The four costs in seconds are each the least of their latest ``WINDOW`` measurements (``_least``).
    """

    full: float | None = None
    waits: float | None = None
    cpu: float | None = None
    check: float | None = None
    entries: float | None = None
    declined: int = 0
    sure: bool = False
    probes: int = 0
    seen: dict[str, deque[float]] = field(
        default_factory=lambda: {k: deque(maxlen=WINDOW) for k in ("full", "waits", "cpu", "check")}, repr=False
    )

    def full_read(self, nbytes: int, seconds: float) -> None:
        """Records a full read of ``nbytes`` that took ``seconds``."""
        if nbytes > 0:
            self.full = _least(self.seen["full"], seconds / nbytes)

    def estimate(self, entries: float, covered: int) -> float | None:
        """Seconds a delta pull of ``entries`` entries would take, verifying ``covered`` bytes;
        None before any delta pull was measured."""
        if self.waits is None or self.cpu is None or self.check is None or self.full is None:
            return None
        return self.waits + entries * (ENTRY_BYTES * self.full + self.cpu) + covered * self.check

    def delta_pull(
        self, entries: int, versions: int, reads: tuple[int, float], cpu_s: float, check: tuple[int, float]
    ) -> None:
        """Records a delta pull: ``entries`` over ``versions``; its reads (bytes, seconds); the
        seconds it took to decode and scatter them; its verification (bytes covered, seconds)."""
        if self.full is not None:
            self.waits = _least(self.seen["waits"], max(0.0, reads[1] - reads[0] * self.full))
        self.cpu = _least(self.seen["cpu"], cpu_s / max(entries, 1))
        self.check = _least(self.seen["check"], check[1] / max(check[0], 1))
        self.entries = _ewma(self.entries, entries / max(versions, 1))
        self.declined, self.sure, self.probes = 0, False, self.probes + 1


ENTRY_BYTES = 4  # bytes of one delta entry (``protocol.delta``)


def link(session: Session) -> str:
    """The name a session's costs are kept under: the transports it reads over."""
    return "+".join(sorted({s.transport for s in session.sources}))


def choose(
    ctx: PullContext, session: Session, rec: Any, held: Held | None, deadline: float
) -> tuple[PullResult | None, str]:
    """A delta pull of ``rec`` onto ``held`` where it is possible and estimated cheaper than a
    full read on this link: ``(result, "delta")``; else ``(None, reason)`` (``DELTA_REASONS``)
    before any write, and the caller pulls in full."""
    reason = why_not(ctx, session, rec, held)
    if reason is not None:
        return None, reason
    cost = ctx.costs.setdefault(link(session), LinkCost())
    geo = [session.delta[s.rank] for s in session.sources]
    full = sum(g.full for g in geo) * cost.full if cost.full is not None else None
    if full is not None and ctx.verify and cost.check is not None:  # a full pull verifies too
        full += sum(g.full for g in geo) * cost.check
    probe = cost.declined >= PROBE_EVERY or cost.probes < PROBES
    if full is not None and cost.entries is not None and not probe:
        guess = cost.estimate(cost.entries * (rec.v - held.v), sum(g.full for g in geo))
        if guess is not None and guess > (1.0 if cost.sure else SKIP_MARGIN) * full:
            cost.declined += 1
            return None, "cost"
    return _pull(ctx, session, rec, held.v, deadline, cost, full, probe)


def pull(ctx: PullContext, session: Session, rec: Any, base: int, deadline: float) -> PullResult | None:
    """Pulls ``rec`` as the deltas since ``base`` into ``dest`` and verifies it (repairing what
    does not match), whatever it costs; None before any write if the deltas cannot be used (the
    caller pulls in full)."""
    if not 0 < rec.v - base or any(isinstance(g, str) for g in _prepare(ctx, session).values()):
        return None
    if not session.sources or any(rec.v - base > len(session.delta[s.rank].descs) for s in session.sources):
        return None
    return _pull(ctx, session, rec, base, deadline, None, None, True)[0]


def _pull(
    ctx: PullContext,
    session: Session,
    rec: Any,
    base: int,
    deadline: float,
    cost: LinkCost | None,
    full: float | None,
    probe: bool,
) -> tuple[PullResult | None, str]:
    """The delta pull proper: headers and tables, the cost check (``cost``; ``full``: the full
    read's estimate; ``probe``: pull anyway), entries, apply, verify-and-repair."""
    t0 = time.perf_counter()
    spent = sum(
        x.spent for g in session.delta.values() if isinstance(g, _Geometry) for x in (g.head, g.check, g.entries)
    )
    got: dict[int, Any] = {}
    nbytes = ops = 0
    try:
        hs = {}
        for src in session.sources:
            h = heads(ctx.endpoints[src.transport], src, session, rec, base, deadline)
            if isinstance(h, str):
                return None, h
            hs[src.rank] = h
        total = sum(h.entries for h in hs.values())
        geo = [session.delta[s.rank] for s in session.sources]
        if 4 * total + sum(g.partial for g in geo) >= sum(g.full for g in geo):
            return None, "cost"  # more bytes than a full read
        if cost is not None and full is not None and not probe:
            est = cost.estimate(total, sum(g.full for g in geo))
            if est is not None and est >= full:
                cost.declined += 1
                cost.entries = _ewma(cost.entries, total / (rec.v - base))  # (what the tables said)
                cost.sure = est >= SURE * full  # clearly slower: the next guess needs no tables read to decline
                return None, "cost"
        for src in session.sources:
            r = entries(ctx.endpoints[src.transport], src, session, hs[src.rank], deadline)
            if r is None:
                return None, "header-changed"
            got[src.rank] = r
            nbytes, ops = nbytes + r[2], ops + r[3]
    except TransportError:
        return None, "source-failed"  # the full pull reads around a dead source (failover) or reports it
    tr = time.perf_counter()
    writes = [decode(src, session, got[src.rank]) for src in session.sources]
    if any(w is None for w in writes):
        return None, "malformed"  # before any write
    for region, offsets, values in (w for per in writes for w in per):
        _scatter(ctx.dest.buffers[region], offsets, values)
    t1 = time.perf_counter()
    repaired, extra, fops = verify_repair(ctx, session.sources, rec, deadline)
    if cost is not None:  # (the time spent setting up scratch buffers is not a delta's cost)
        covered = sum(g.full for g in geo)
        setup = sum(x.spent for g in geo for x in (g.head, g.check, g.entries)) - spent
        check_s = time.perf_counter() - t1
        cost.delta_pull(total, rec.v - base, (nbytes, tr - t0 - setup), t1 - tr, (covered, check_s))
    nbytes += extra + STAMP_BYTES * len(session.sources)  # the stamp check that follows
    return PullResult(nbytes, 0, ops + fops + len(session.sources), repaired, delta=True, reason="delta"), "delta"


@dataclass
class _Heads:
    """What one source's delta headers and tables said: per delta its table and the entry range
    of each run of chunks, and the entries the source's reads cover in all."""

    us: np.ndarray
    raw: np.ndarray  # the headers and tables as read (the headers are compared again after the entries)
    tables: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    entries: int
    nbytes: int


def heads(t: Any, src: Source, session: Session, rec: Any, base: int, deadline: float) -> _Heads | str:
    """Reads the headers and offset tables of the deltas ``base + 1 .. rec.v`` of ``src`` (one
    batched read); a reason (``DELTA_REASONS``) where they cannot be used."""
    g = session.delta[src.rank]
    k, tb = len(g.descs), table_bytes(g.nchunks)
    us = np.arange(base + 1, rec.v + 1, dtype=np.int64)
    m = len(us)
    g.head.ensure(t, m * tb)
    zeros = np.zeros(m, dtype=np.int64)
    batch = ReadBatch(us % k, zeros, zeros, np.arange(m, dtype=np.int64) * tb, np.full(m, tb, dtype=np.int64))
    _read(t, src, g.descs, g.head.region, batch, deadline)
    raw = g.head.buf.numpy()[: m * tb].reshape(m, tb).copy()
    head = raw[:, :HEADER_BYTES].view(np.uint64)
    gen = session.gens[src.rank] if session.gens else 0
    want = np.stack([np.full(m, DELTA_MAGIC, np.uint64), us.astype(np.uint64), (us - 1).astype(np.uint64)], 1)
    if not (head[:, :3] == want).all() or not (head[:, 4] == rec.epoch).all() or not (head[:, 6] == g.nchunks).all():
        return "header-changed"  # rewritten for a newer version, or another registration's
    if (head[:, 3] == DELTA_NONE).any():
        return "no-delta"
    if not (head[:, 3] == DELTA_STABLE).all():
        return "header-changed"
    if not (head[:, 5] == gen).all():
        return "new-layout"  # a delta in between is in another packing generation's byte order
    tables = raw[:, HEADER_BYTES : HEADER_BYTES + 4 * (g.nchunks + 1)].view(np.uint32).astype(np.int64)
    if np.any(tables[:, -1] != head[:, 7].astype(np.int64)) or np.any(np.diff(tables, axis=1) < 0):
        return "malformed"
    lo, hi = tables[:, g.run_lo], tables[:, g.run_hi + 1]
    return _Heads(us, raw, tables, lo, hi, int((hi - lo).sum()), m * tb)


def entries(t: Any, src: Source, session: Session, h: _Heads, deadline: float) -> tuple | None:
    """Reads the entries of the chunks ``src``'s reads cover (one row per delta and run of chunks),
    then the headers again: per delta the (table, entries) it read, plus bytes and reads; None
    where a delta was rewritten under the reads."""
    g = session.delta[src.rank]
    k, m = len(g.descs), len(h.us)
    g.check.ensure(t, m * HEADER_BYTES)
    zeros = np.zeros(m, dtype=np.int64)
    n = (h.hi - h.lo).reshape(-1)
    which = np.repeat(np.arange(m), len(g.run_lo))
    rows = n > 0
    dst = np.concatenate(([0], np.cumsum(n[rows])[:-1])).astype(np.int64) * 4
    total = int(n.sum()) * 4
    nbytes, ops = h.nbytes + m * HEADER_BYTES, 2 * m
    if total:
        g.entries.ensure(t, total)
        batch = ReadBatch(
            (h.us % k)[which[rows]],
            table_bytes(g.nchunks) + 4 * h.lo.reshape(-1)[rows],
            np.zeros(int(rows.sum()), dtype=np.int64),
            dst,
            4 * n[rows],
        )
        _read(t, src, g.descs, g.entries.region, batch, deadline)
        nbytes, ops = nbytes + total, ops + len(batch)
    # the headers again: a delta rewritten under the reads is not used
    again = ReadBatch(h.us % k, zeros, zeros, np.arange(m, dtype=np.int64) * HEADER_BYTES, np.full(m, 64))
    _read(t, src, g.descs, g.check.region, again, deadline)
    if not np.array_equal(g.check.buf.numpy()[: m * HEADER_BYTES].reshape(m, HEADER_BYTES), h.raw[:, :HEADER_BYTES]):
        return None
    got = g.entries.buf.numpy()[:total].view(np.uint32).copy() if total else np.zeros(0, np.uint32)
    return [(h.tables[i], h.lo[i], h.hi[i]) for i in range(m)], got, nbytes, ops


def _read(t: Any, src: Source, descs: list[bytes], local: Any, batch: ReadBatch, deadline: float) -> None:
    prep = t.prepare(src.peer, descs, [local], batch)
    try:
        t.read(prep, timeout=max(0.1, deadline - time.monotonic()))
    finally:
        t.release(prep)


def decode(src: Source, session: Session, got: tuple) -> list[tuple[int, np.ndarray, np.ndarray]] | None:
    """The writes of ``src``'s fetched deltas, in order (a later delta overwrites an earlier
    one's word): ``(destination region, offsets, values)`` per region and delta; None where
    an entry is malformed (positions not ascending within the delta)."""
    g = session.delta[src.rank]
    per_delta, entries = got[0], got[1]
    writes = []
    at = 0
    for table, lo, hi in per_delta:  # one step per delta version (k at most), vectorised inside
        total = int((hi - lo).sum())
        if not total:
            continue
        e = entries[at : at + total]
        at += total
        chunk = np.repeat(g.chunks, table[g.chunks + 1] - table[g.chunks])  # entries are in chunk order
        word = chunk * CHUNK_WORDS + (e & (CHUNK_WORDS - 1))
        val = (e >> 16).astype(np.uint16)
        if len(word) > 1 and not bool(np.all(word[1:] > word[:-1])):
            return None
        if g.unit == 2:
            pos, units = word, val
        else:  # reads at odd offsets: scatter the two bytes of each word on their own
            pos = np.stack((2 * word, 2 * word + 1), 1).reshape(-1)
            units = val.view(np.uint8).reshape(-1, 2).reshape(-1)  # little-endian words: low byte first
        # positions ascend: cut them at every read's start and end, then take each read's slice
        # in destination-region order (``perm``), so each region's entries are contiguous
        cut = np.searchsorted(pos, np.stack((g.soff, g.end), 1).reshape(-1))
        lo_, hi_ = cut[0::2][g.perm], cut[1::2][g.perm]
        n = hi_ - lo_
        at_read = np.cumsum(n) - n
        idx = np.arange(int(n.sum())) - np.repeat(at_read - lo_, n)
        doff = pos[idx] + np.repeat((g.doff - g.soff)[g.perm], n)
        units = units[idx]
        ends = np.append(at_read, len(idx))[g.groups]
        for r, a, b in zip(g.groups[:-1], ends[:-1], ends[1:]):  # one scatter per destination region
            if b > a:
                writes.append((int(g.dreg[g.perm[r]]), doff[a:b], units[a:b]))
    return writes


def _scatter(dst: Any, offsets: np.ndarray, values: np.ndarray) -> None:
    """``dst`` (a uint8 region) viewed as ``values``' dtype, ``[offsets] = values``."""
    w = values.dtype.itemsize
    if isinstance(dst, np.ndarray) or dst.device.type == "cpu":
        arr = _checksum.host_array(dst)
        arr[: len(arr) // w * w].view(values.dtype)[offsets] = values
        return
    import torch

    typed = dst[: int(dst.numel()) // w * w].view(torch.int16 if w == 2 else torch.uint8)
    vals = torch.from_numpy(values.view(np.int16) if w == 2 else values)
    typed[torch.from_numpy(offsets).to(dst.device)] = vals.to(dst.device)


def verify_repair(ctx: PullContext, sources: Sequence[Source], rec: Any, deadline: float) -> tuple[int, int, int]:
    """Verifies every byte the sources' reads cover against the publisher's chunk sums; a chunk
    that does not match is read in full from the slot and written into ``dest``. Returns (chunks
    repaired, bytes read, reads)."""
    import torch

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
        repaired += _checksum.verify_reads(src.batch, sums, dest, counted, where=where, repair=write)
        nbytes, ops = nbytes + count[0], ops + count[1]
    return repaired, nbytes, ops


__all__ = ["DELTA_REASONS", "LinkCost", "choose", "pull", "usable", "verify_repair", "why_not"]
