"""Delta pulls on the wire: what a source's reads cover, reading its deltas (whole, or their
tables then streams), decoding them and adding them into the destination (the format:
``wbridge.protocol.delta``).

Per session and source, once (``prepare``): the source's reads sorted by slot offset, the runs of
adjacent delta chunks they touch, and how they map onto the destination (``SourceGeometry``). Per
pull, where the reads cover every chunk and the version record says each delta's bytes
(``whole_deltas``): one batched read of the deltas ``a + 1 .. v`` whole, with the slot's stamp
where asked (``read_heads``), each delta then checked against its digest (``heads``: a buffer
rewritten under the read fails it); else one read of their headers and table entries for those
runs (a reader of a slice reads its slice of the tables), one of the stream bytes of just the runs
of chunks the reads cover (``fetch``), and then the headers again, with the slot's stamp where
asked: a buffer rewritten meanwhile is not used (``recheck``); the table and header reads of a
shape are prepared once and replayed (``Scratch.prepared``). Each delta and run is decoded into its
changed pairs (``decode``, compiled; a delta read whole and intact, in one call) and added: on the
host one compiled call per delta over every read (``apply``), on a device its changed bytes cut at
the reads and scattered per destination region (``writes``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transports.base import ReadBatch

from .._deadline import Deadline
from .._lifecycle import quietly
from .._tensors import address, alloc_bytes
from ..errors import IntegrityError
from ..protocol import checksum as _checksum
from ..protocol import delta as _format
from ..protocol.delta import CHUNK_BYTES, DELTA_MAGIC, DELTA_NONE, DELTA_STABLE, HEADER_BYTES, PAIR, table_rows
from ..protocol.records import unb64
from ..protocol.stamps import STAMP_BYTES, Stamp
from .context import PullContext
from .reads import stamp_read
from .session import Session, Source


@dataclass
class Scratch:
    """A host buffer registered with one transport (grown on demand), and the reads into it that
    recur from pull to pull, prepared once (``prepared``; dropped when it grows)."""

    buf: Any = None
    region: Any = None
    spent: float = 0.0  # seconds spent allocating and registering (not a delta's cost: done once)
    preps: dict = field(default_factory=dict)

    def ensure(self, t: Any, n: int) -> None:
        if self.buf is not None and int(self.buf.numel()) >= n:
            return
        t0 = time.perf_counter()
        self.release(t)
        self.buf = alloc_bytes(max(n, 4096), "cpu")
        self.region = t.register(address(self.buf), int(self.buf.numel()))
        self.spent += time.perf_counter() - t0

    def prepared(self, t: Any, key: tuple, make: Callable[[], tuple]) -> Any:
        """The read ``key`` into this buffer, prepared on first use: ``make()`` gives ``t.prepare``'s
        arguments. (A delta pull's headers and tables, and the headers again, differ only in the
        versions' ring positions: a few shapes, each prepared once.)"""
        prep = self.preps.get(key)
        if prep is None:
            prep = self.preps[key] = t.prepare(*make())
        return prep

    def release(self, t: Any) -> None:
        for prep in self.preps.values():
            quietly(t.release, prep)
        self.preps = {}
        if self.region is not None:
            quietly(t.deregister, self.region)
        self.buf = self.region = None


@dataclass(frozen=True)
class SourceGeometry:
    """What one source's plan batch covers, computed once per session: its reads sorted by slot
    offset, the runs of adjacent delta chunks they touch (inclusive chunk indices), and the
    scratch buffers its delta reads land in."""

    soff: np.ndarray
    end: np.ndarray
    dreg: np.ndarray
    doff: np.ndarray
    run_lo: np.ndarray
    run_hi: np.ndarray
    perm: np.ndarray  # reads ordered by destination region (stable), so one scatter per region
    groups: np.ndarray  # in ``perm`` order: the index of each region's first read, and len(perm)
    partial: int  # bytes of the checksum chunks these reads cover only in part (re-read to verify)
    full: int  # bytes of a full read
    geo: _format.Geometry
    descs: tuple[bytes, ...]
    head: Scratch
    check: Scratch
    streams: Scratch
    work: _format.Workspace  # the decoder's arrays, reused from pull to pull
    targets: dict = field(default_factory=dict)  # where the reads land on the host (``_host_targets``)

    @property
    def scratches(self) -> tuple[Scratch, ...]:
        return (self.head, self.check, self.streams)

    @functools.cached_property
    def whole(self) -> bool:
        """Whether the reads cover every chunk: every stream byte of a delta is needed."""
        return len(self.run_lo) == 1 and self.run_lo[0] == 0 and self.run_hi[0] == self.geo.nchunks - 1

    @functools.cached_property
    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Where a delta buffer's header and the table entries of ``run_lo..run_hi`` are: ``(offsets,
        lengths)`` (``table_rows``, after the header's)."""
        at, n = table_rows(self.geo.nchunks, self.run_lo, self.run_hi)
        return np.concatenate(([0], at)), np.concatenate(([HEADER_BYTES], n))


def source_geometry(src: Source, slot_bytes: int, descs: list[bytes], sum_starts: np.ndarray) -> SourceGeometry | None:
    """``src``'s delta geometry over a slot of ``slot_bytes``; None where its plan reads one slot
    byte twice or from another region than the slot's first."""
    b = src.batch
    geo = _format.geometry(slot_bytes)
    if geo is None or (len(b) and np.any(b.src_region != 0)):
        return None
    order = np.argsort(b.src_offset, kind="stable")
    soff, n = b.src_offset[order], b.nbytes[order]
    end = soff + n
    if len(soff) > 1 and np.any(soff[1:] < end[:-1]):
        return None  # overlapping reads of one source: one slot byte, two destinations
    keep = n > 0
    c0, c1 = soff[keep] // CHUNK_BYTES, np.minimum((end[keep] - 1) // CHUNK_BYTES, geo.nchunks - 1)
    # merge [c0, c1] ranges that overlap or touch into runs
    reach = np.maximum.accumulate(c1) if len(c1) else c1
    starts = np.ones(len(c0), dtype=bool)
    starts[1:] = c0[1:] > reach[:-1] + 1
    first = np.flatnonzero(starts)
    last = np.append(first[1:] - 1, len(c0) - 1).astype(np.int64) if len(first) else first
    run_lo, run_hi = c0[first], reach[last] if len(last) else last
    doff, dreg = b.dst_offset[order], b.dst_region[order]
    perm = np.argsort(dreg, kind="stable")
    groups = np.append(np.flatnonzero(np.diff(dreg[perm], prepend=-1)), len(perm))
    # bytes covered below x: cum[i] + (x - soff[i]) clipped, for the last read starting below x
    cum = np.concatenate(([0], np.cumsum(n)))
    edges = np.append(sum_starts, slot_bytes)  # the checksum chunks (``checksum.slot_edges``)
    i = np.searchsorted(soff, edges, side="right") - 1
    j = np.maximum(i, 0)
    below = np.where(i >= 0, cum[j] + np.clip(edges - soff[j], 0, n[j]), 0)
    covered, length = np.diff(below), np.diff(edges)
    partial = int(length[(covered > 0) & (covered < length)].sum())
    return SourceGeometry(
        soff, end, dreg, doff, run_lo.astype(np.int64), run_hi.astype(np.int64), perm, groups, partial,
        int(n.sum()), geo, tuple(descs), Scratch(), Scratch(), Scratch(), _format.Workspace(),
    )  # fmt: skip


def prepare(ctx: PullContext, session: Session) -> dict[int, SourceGeometry | str]:
    """Each source's delta geometry (or why it has none: a ``DELTA_REASONS`` value), computed once
    per session (its scratch buffers are released with the session)."""
    if session.delta is not None:
        return session.delta
    geo: dict[int, SourceGeometry | str] = {}
    for src in session.sources:
        served = session.records[src.rank]["transports"].get(src.transport, {})
        descs = served.get("delta")
        sizes = session.layouts[src.rank].region_sizes
        if not isinstance(descs, list) or not descs or not sizes:
            geo[src.rank] = "publisher-no-delta"
            continue
        size = int(sizes[0])
        starts = _checksum.slot_edges(session.layouts[src.rank], size)
        geo[src.rank] = source_geometry(src, size, [unb64(d) for d in descs], starts) or "unsupported-plan"
    if any(isinstance(g, SourceGeometry) for g in geo.values()):
        _format.load_decoder()  # (numba's start-up: here, not in the first delta pull's timings)
    endpoints = ctx.endpoints

    def release() -> None:
        for src in session.sources:
            g, t = geo.get(src.rank), endpoints.get(src.transport)
            if isinstance(g, SourceGeometry) and t is not None:
                for scratch in g.scratches:
                    scratch.release(t)

    session.delta = geo
    session.closers.append(release)
    return geo


@dataclass(frozen=True)
class HeadsRead:
    """One source's delta headers and tables as read (``read_heads``): the versions, per version
    its header and table entries (``raw``: ``[versions, bytes]``), the bytes read, and where the
    deltas were read whole (``whole_deltas``) the deltas themselves, each at ``held_at[i]`` of
    ``held`` and ``sizes[i]`` bytes long (else None)."""

    us: np.ndarray
    raw: np.ndarray
    nbytes: int
    held: np.ndarray | None = None
    held_at: np.ndarray | None = None
    sizes: np.ndarray | None = None


@dataclass(frozen=True)
class Heads:
    """What one source's delta headers and tables said (``heads``): the read, each delta's parsed
    tables, and per delta, run and stream the byte range to read (``offsets``, ``lengths``:
    ``[versions, runs, 5]``); ``whole``: the read holds those ranges already; ``intact``: True
    where read whole and every delta's digest matched (None: not read whole, or a digest this
    process cannot compute; the headers are read again instead). Where ``intact``, nothing is
    parsed here (no ``parsed``, ``offsets``, ``lengths``): ``decode`` decodes each delta whole in
    one call."""

    read: HeadsRead
    parsed: tuple[_format.Parsed, ...]
    offsets: np.ndarray | None
    lengths: np.ndarray | None
    pairs: int  # changed pairs the reads' runs cover, over every delta
    stream_bytes: int  # the bytes of those runs' streams, over every delta
    whole: bool
    intact: bool | None = None

    @property
    def us(self) -> np.ndarray:
        return self.read.us

    @property
    def nbytes(self) -> int:  # bytes read for the headers and tables (and the streams, where ``whole``)
        return self.read.nbytes


def whole_deltas(g: SourceGeometry, rec: Any, rank: int, us: np.ndarray) -> np.ndarray | None:
    """The bytes of each delta ``us`` (its header, tables and streams), where ``src``'s reads cover
    every chunk and the version record says them (``VersionRecord.deltas``); else None. Such a
    reader reads each delta in one read: a buffer is read only once the version it holds (or a
    newer one) is committed, and a position of the ring holds ever newer versions, so a rewrite
    that began under the read shows in the delta's digest (``heads``), or, where this process
    cannot compute the publisher's digest, in its headers read again (``recheck``)."""
    extents, k = rec.deltas[rank] if rank < len(rec.deltas) else (), len(g.descs)
    if not g.whole or len(extents) != k:
        return None
    n = [extents[u % k] for u in us.tolist()]  # (Python ints: a version or a few, in a cold process)
    least, most = int(g.rows[1].sum()), g.geo.buffer_bytes
    return np.array(n, dtype=np.int64) if all(least <= x <= most for x in n) else None


def read_heads(
    t: Any,
    src: Source,
    session: Session,
    rec: Any,
    base: int,
    deadline: Deadline,
    sizes: np.ndarray | None,
    stamp: Stamp | None = None,
) -> HeadsRead:
    """Reads the headers of the deltas ``base + 1 .. rec.v`` of ``src`` and the table entries of
    the runs of chunks its reads cover (one batched read); with ``sizes`` (``whole_deltas``) the
    deltas whole instead, and with ``stamp`` the slot's stamp in that same read
    (``StaleVersionError`` where it does not say ``stamp``)."""
    g = session.delta[src.rank]
    k = len(g.descs)
    us = np.arange(base + 1, rec.v + 1, dtype=np.int64)
    m = len(us)
    rows_at, rows_n = g.rows
    per = int(rows_n.sum())  # bytes per version: the header, then its runs' table entries
    if sizes is not None:  # one row per delta: its header, tables (contiguous: every run) and streams
        held_at = np.cumsum(sizes) - sizes
        g.head.ensure(t, int(sizes.sum()))
        descs, local = [g.descs[u] for u in (us % k).tolist()], [g.head.region]
        rows = [np.arange(m), np.zeros(m, np.int64), np.zeros(m, np.int64), held_at, sizes]
        if stamp is not None:  # (remote region m, local region 1: the source's stamp buffer)
            descs.append(src.regions[stamp.slot][-1])
            local.append(src.stamp_region)
            rows = [np.append(x, y) for x, y in zip(rows, (m, 0, 1, 0, STAMP_BYTES))]
        read(t, src, descs, local, ReadBatch(*rows), deadline)
        if stamp is not None:
            stamp_read(src, stamp)
        held = g.head.buf.numpy()[: int(sizes.sum())]  # (the scratch is read into again by the next pull only)
        raw = np.stack([held[a : a + per] for a in held_at.tolist()])
        return HeadsRead(us, raw, int(sizes.sum()), held, held_at, sizes)
    g.head.ensure(t, m * per)
    r = len(rows_at)

    def batch() -> tuple:
        dst = np.arange(m, dtype=np.int64)[:, None] * per + (np.cumsum(rows_n) - rows_n)[None, :]
        b = ReadBatch(np.repeat(us % k, r), np.tile(rows_at, m), np.zeros(m * r, np.int64), dst.reshape(-1),
                      np.tile(rows_n, m))  # fmt: skip
        return src.peer, list(g.descs), [g.head.region], b

    t.read(g.head.prepared(t, ("heads", src.peer, m, int(us[0] % k)), batch), timeout=deadline.left(0.1))
    return HeadsRead(us, g.head.buf.numpy()[: m * per].reshape(m, per).copy(), m * per)


def heads(src: Source, session: Session, rec: Any, got: HeadsRead) -> Heads | str:
    """What ``src``'s delta headers and tables as read say; a reason (``DELTA_REASONS``) where they
    cannot be used, or "torn" where read whole a delta does not match its digest (rewritten under
    the read, or bad bytes: the caller reads the headers again to tell)."""
    g = session.delta[src.rank]
    nchunks = g.geo.nchunks
    us, raw, m = got.us, got.raw, len(got.us)
    rows = raw[:, :HEADER_BYTES].view(np.uint64)[:, :8].tolist()  # (a step per version: k at most)
    gen = session.gens[src.rank] if session.gens else 0
    if any(
        (h[0], h[1], h[2], h[4], h[6]) != (DELTA_MAGIC, u, u - 1, rec.epoch, nchunks) for u, h in zip(us.tolist(), rows)
    ):
        return "header-changed"  # rewritten for a newer version, or another registration's
    if any(h[3] == DELTA_NONE for h in rows):
        return "no-delta"
    if any(h[3] != DELTA_STABLE for h in rows):
        return "header-changed"
    if any(h[5] != gen for h in rows):
        return "new-layout"  # a delta in between is in another packing generation's byte order
    if got.sizes is not None:  # read whole: each delta's digest, before its tables are parsed
        seen = [_format.intact(got.held[a : a + n]) for a, n in zip(got.held_at.tolist(), got.sizes.tolist())]
        if False in seen:
            return "torn"
        if None not in seen:  # each as its publisher wrote it: decoded whole, parsed there (``decode``)
            if any(h[7] > g.geo.pairs for h in rows):
                return "malformed"
            streams = int(got.sizes.sum()) - m * _format.table_bytes(nchunks)
            return Heads(got, (), None, None, sum(h[7] for h in rows), streams, True, True)
    parsed = tuple(
        _format.parse(raw[i, :HEADER_BYTES], raw[i, HEADER_BYTES:], g.run_lo, g.run_hi, nchunks, g.geo.pairs)
        for i in range(m)
    )
    if any(p is None for p in parsed):
        return "malformed"
    cut = [_format.ranges(p, g.run_lo, g.run_hi) for p in parsed]
    offsets, lengths = np.stack([c[0] for c in cut]), np.stack([c[1] for c in cut])
    if np.any(lengths < 0) or np.any(offsets + lengths > g.geo.buffer_bytes):
        return "malformed"
    pairs = sum(int((p.tables[0, g.run_hi + 1] - p.tables[0, g.run_lo]).sum()) for p in parsed)
    # (where the record's sizes fell short of the streams, ``fetch`` reads them)
    whole = got.sizes is not None and not np.any(offsets + lengths > got.sizes[:, None, None])
    return Heads(got, parsed, offsets, lengths, pairs, int(lengths.sum()), whole)


@dataclass(frozen=True)
class Fetched:
    """One source's stream bytes as read: per delta and run its five stream pieces, plus the bytes
    and reads the fetch took (headers and tables included)."""

    pieces: tuple[tuple[tuple[np.ndarray, ...], ...], ...]
    nbytes: int
    ops: int


def fetch(t: Any, src: Source, session: Session, h: Heads, deadline: Deadline) -> Fetched:
    """Reads the stream bytes of the runs of chunks ``src``'s reads cover (one row per delta, run
    and stream); ``recheck`` then reads the headers again (not where every delta was read whole
    and matched its digest: its bytes and reads count none)."""
    g = session.delta[src.rank]
    k, m = len(g.descs), len(h.us)
    if h.intact:  # read whole with the headers, each delta decoded whole (``decode``)
        return Fetched((), h.nbytes, m)
    n = h.lengths.reshape(-1)
    nbytes, ops = h.nbytes + m * HEADER_BYTES, 2 * m
    if h.whole:  # read with the headers
        held = h.read.held
        offsets = (h.offsets + h.read.held_at[:, None, None]).reshape(h.offsets.shape[0], -1)
        pieces = tuple(
            tuple(tuple(held[a : a + b] for a, b in zip(o[5 * r : 5 * r + 5], n_[5 * r : 5 * r + 5]))
                  for r in range(h.lengths.shape[1]))
            for o, n_ in zip(offsets.tolist(), h.lengths.reshape(m, -1).tolist())
        )  # fmt: skip
        return Fetched(pieces, nbytes, ops)
    which = np.repeat(np.arange(m), h.lengths.shape[1] * h.lengths.shape[2])
    rows = n > 0
    at = np.concatenate(([0], np.cumsum(n)))
    total = int(at[-1])
    if total:
        g.streams.ensure(t, total)
        # (the versions' buffers alone: ``us`` are consecutive, so at most one per ring position)
        batch = ReadBatch(which[rows], h.offsets.reshape(-1)[rows], np.zeros(int(rows.sum()), dtype=np.int64),
                          at[:-1][rows], n[rows])  # fmt: skip
        read(t, src, [g.descs[u] for u in (h.us % k).tolist()], [g.streams.region], batch, deadline)
        nbytes, ops = nbytes + total, ops + len(batch)
    got = g.streams.buf.numpy()[:total].copy() if total else np.zeros(0, np.uint8)
    shape = h.lengths.shape
    pieces = tuple(
        tuple(tuple(got[at[(i * shape[1] + r) * 5 + s] : at[(i * shape[1] + r) * 5 + s + 1]] for s in range(5))
              for r in range(shape[1]))
        for i in range(shape[0])
    )  # fmt: skip
    return Fetched(pieces, nbytes, ops)


def recheck(
    t: Any, src: Source, session: Session, h: HeadsRead, deadline: Deadline, stamp: Stamp | None = None
) -> bool:
    """Reads the headers of ``src``'s deltas again after their streams (the seqlock check): False
    where one was rewritten under the reads. With ``stamp``, the slot's stamp comes in that read
    too (the seqlock check of a pull that reads nothing of the slot: ``reads.check_stamps`` needs
    no read of its own), and ``StaleVersionError`` is raised where it does not say ``stamp``."""
    g = session.delta[src.rank]
    k, m = len(g.descs), len(h.us)
    g.check.ensure(t, m * HEADER_BYTES)

    def again() -> tuple:
        rows = np.stack([h.us % k, 0 * h.us, 0 * h.us, np.arange(m) * HEADER_BYTES, np.full(m, HEADER_BYTES)])
        if stamp is None:
            return src.peer, list(g.descs), [g.check.region], ReadBatch(*rows)
        rows = np.concatenate((rows, [[k], [0], [1], [0], [STAMP_BYTES]]), axis=1)  # the slot's stamp
        return src.peer, [*g.descs, src.regions[stamp.slot][-1]], [g.check.region, src.stamp_region], ReadBatch(*rows)

    key = ("again", src.peer, m, int(h.us[0] % k), None if stamp is None else stamp.slot)
    t.read(g.check.prepared(t, key, again), timeout=deadline.left(0.1))
    if not np.array_equal(g.check.buf.numpy()[: m * HEADER_BYTES].reshape(m, HEADER_BYTES), h.raw[:, :HEADER_BYTES]):
        return False
    if stamp is not None:
        stamp_read(src, stamp)
    return True


def read(t: Any, src: Source, descs: list[bytes], local: list[Any], batch: ReadBatch, deadline: Deadline) -> None:
    prep = t.prepare(src.peer, descs, local, batch)
    try:
        t.read(prep, timeout=deadline.left(0.1))
    finally:
        t.release(prep)


@dataclass(frozen=True)
class Decoded:
    """One source's deltas, decoded: per delta its changed pairs over the runs its reads cover
    (indices ascending, int64; views of the source's workspace) and their byte differences (uint32)."""

    pairs: tuple[tuple[np.ndarray, np.ndarray], ...]


def decode(src: Source, session: Session, h: Heads, got: Fetched) -> Decoded | None:
    """``src``'s fetched deltas decoded (a compiled call per delta and run; read whole and intact:
    per delta, ``decode_whole``); None where one is malformed. Writes nothing to the destination."""
    g = session.delta[src.rank]
    out = []
    if h.intact:
        held, nchunks, pairs = h.read.held, g.geo.nchunks, g.geo.pairs
        for i, (a, n) in enumerate(zip(h.read.held_at.tolist(), h.read.sizes.tolist())):
            delta = held[a : a + n]
            k = _format.pairs_of(delta)
            at, diffs = g.work.get(f"d.at.{i}", k, np.int64), g.work.get(f"d.diffs.{i}", k, np.uint32)
            if not _format.decode_whole(delta, nchunks, pairs, at, diffs, g.work):
                return None
            out.append((at, diffs))
        return Decoded(tuple(out))
    for i, p in enumerate(h.parsed):  # (a delta's arrays are its own: the deltas are applied together)
        counts = (p.tables[0, g.run_hi + 1] - p.tables[0, g.run_lo]).tolist()
        at = g.work.get(f"d.at.{i}", sum(counts), np.int64)
        diffs = g.work.get(f"d.diffs.{i}", sum(counts), np.uint32)
        m = 0
        for r, (lo, hi, n) in enumerate(zip(g.run_lo.tolist(), g.run_hi.tolist(), counts)):
            if not _format.decode_into(p, lo, hi, list(got.pieces[i][r]), at[m : m + n], diffs[m : m + n]):
                return None
            m += n
        out.append((at, diffs))
    return Decoded(tuple(out))


def apply(dest: list[Any], src: Source, session: Session, d: Decoded, pool: Any = None) -> None:
    """Adds ``src``'s decoded deltas into the destination buffers ``dest`` (uint8 regions, host or
    device), mod 256: on the host one compiled call per delta over every read (``add_pairs``: each
    read's destination checked once to lie in its region; with ``pool``, an executor with a thread
    free, that thread adds half the pairs: their bytes are distinct, and the destination's cache
    lines come from memory twice as fast on two cores), on a device a scatter per region."""
    g = session.delta[src.rank]
    addr = _host_targets(g, dest)
    if addr is None:
        for w in writes(g, d):
            apply_write(dest[w.region], w)
        return
    for at, diffs in d.pairs:  # (one delta after the other: two may change one pair)
        half = len(at) // 2 if pool is not None and len(at) >= PARALLEL_PAIRS else 0
        other = pool.submit(_format.add_pairs, at[:half], diffs[:half], g.soff, g.end, addr) if half else None
        _format.add_pairs(at[half:], diffs[half:], g.soff, g.end, addr)
        if other is not None:
            other.result()


PARALLEL_PAIRS = 16384  # changed pairs from which a delta is added on two threads


def _host_targets(g: SourceGeometry, dest: list[Any]) -> np.ndarray | None:
    """Where each of ``g``'s reads lands in host memory (int64 addresses, in ``g``'s read order),
    each checked to lie within its destination region (``IntegrityError`` where one does not);
    None where a destination is on a device. Kept in ``g`` for this ``dest`` (the subscriber's
    registered buffers: their memory stays while they are registered)."""
    kept = g.targets.get("dest")
    if kept is not None and kept[0] is dest:
        return kept[1]
    regions = np.unique(g.dreg).tolist()
    if not all(isinstance(dest[r], np.ndarray) or dest[r].device.type == "cpu" for r in regions):
        return None
    base, size = np.zeros(len(dest), np.int64), np.zeros(len(dest), np.int64)
    for r in regions:
        host = _checksum.host_array(dest[r])
        base[r], size[r] = host.ctypes.data, len(host)
    outside = (g.doff < 0) | (g.doff + (g.end - g.soff) > size[g.dreg])
    if np.any(outside):
        bad = int(g.dreg[np.flatnonzero(outside)[0]])
        raise IntegrityError(f"a delta write falls outside destination region {bad} ({int(size[bad])} bytes)")
    addr = base[g.dreg] + g.doff
    g.targets["dest"] = (dest, addr)
    return addr


FEW_READS = 64  # a source with at most this many reads gets a write per read (else one per region)


@dataclass(frozen=True)
class Write:
    """Byte differences to add at byte offsets of one destination region."""

    region: int
    offsets: np.ndarray
    values: np.ndarray  # uint8


def writes(g: SourceGeometry, d: Decoded) -> list[Write]:
    """The writes of decoded deltas on a device destination (each delta's, in order; byte
    differences add, so their order does not matter): their changed bytes cut at the reads and
    grouped per destination region."""
    out: list[Write] = []
    for i, (at, diffs) in enumerate(d.pairs):
        pos = g.work.get(f"w.pos.{i}", PAIR * len(at), np.int64)  # (a delta's own: they are applied together)
        units = g.work.get(f"w.units.{i}", PAIR * len(at), np.uint8)
        m = _format.changed_bytes(at, diffs, pos, units)
        pos, units = pos[:m], units[:m]
        # positions ascend: cut them at every read's start and end
        cut = np.searchsorted(pos, np.stack((g.soff, g.end), 1).reshape(-1))
        lo_, hi_ = cut[0::2][g.perm], cut[1::2][g.perm]
        if len(lo_) <= FEW_READS:  # a write per read: slices, no index arrays
            shift = (g.doff - g.soff)[g.perm]
            for r in np.flatnonzero(hi_ > lo_):
                a, b = int(lo_[r]), int(hi_[r])
                pos[a:b] += shift[r]  # (slot offsets become destination offsets, in place)
                out.append(Write(int(g.dreg[g.perm[r]]), pos[a:b], units[a:b]))
            continue
        # many reads: each read's slice in destination-region order (``perm``), so that each
        # region's bytes are contiguous, then a write per region
        n = hi_ - lo_
        at_read = np.cumsum(n) - n
        idx = np.arange(int(n.sum())) - np.repeat(at_read - lo_, n)
        doff = pos[idx] + np.repeat((g.doff - g.soff)[g.perm], n)
        units = units[idx]
        ends = np.append(at_read, len(idx))[g.groups]
        for r, a, b in zip(g.groups[:-1], ends[:-1], ends[1:]):  # one write per destination region
            if b > a:
                out.append(Write(int(g.dreg[g.perm[r]]), doff[a:b], units[a:b]))
    return out


def apply_write(dst: Any, w: Write) -> None:
    """Adds ``w``'s byte differences into ``dst`` (a uint8 region, host or device), mod 256."""
    if isinstance(dst, np.ndarray) or dst.device.type == "cpu":
        if not _format.add(_checksum.host_array(dst), w.offsets, w.values):
            raise IntegrityError(f"a delta write falls outside destination region {w.region} ({len(dst)} bytes)")
        return
    import torch

    idx = torch.from_numpy(w.offsets).to(dst.device)
    dst[idx] = dst[idx] + torch.from_numpy(w.values).to(dst.device)


__all__ = [
    "Decoded",
    "Fetched",
    "Heads",
    "HeadsRead",
    "Scratch",
    "SourceGeometry",
    "Write",
    "apply",
    "apply_write",
    "decode",
    "fetch",
    "heads",
    "prepare",
    "read",
    "read_heads",
    "recheck",
    "source_geometry",
    "writes",
]
