"""Delta updates, subscriber side: a pull that reads only the changes since the version held.

A subscriber whose destination holds version ``a`` of the same publisher epoch and packing
generations, pulling ``v`` with ``v - a <= k`` (the publisher's ring of deltas, ``wbridge.publish.delta``),
reads per source rank the headers and offset tables of the deltas ``a + 1 .. v`` (one batched
read), then the entries of just the chunks its own reads cover (one batched read: one row per run
of adjacent chunks per delta), then the headers again (a delta buffer rewritten meanwhile: the pull
goes full). It applies the deltas in order with one vectorised scatter per destination region and
then always verifies every byte it covers against the publisher's chunk checksums: a chunk that
does not match (its memory was changed by someone else, bad bytes, a bit flip) is read in full
from the slot and written back (``repaired`` in the stats). Anything that makes the deltas
unusable before the first byte is written (a header that does not say "version u, stable, this
epoch", a transport error) makes the caller pull in full; ``PullStats.delta`` is False then.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transports.base import ReadBatch
from transports.errors import TransportError

from .._lifecycle import quietly
from .._tensors import address, alloc_bytes
from ..errors import IntegrityError, StaleVersionError
from ..protocol import checksum as _checksum
from ..protocol.delta import CHUNK_BYTES, CHUNK_WORDS, DELTA_MAGIC, DELTA_STABLE, HEADER_BYTES, geometry, table_bytes
from ..protocol.records import unb64
from ..protocol.stamps import STAMP_BYTES
from .context import Held, PullContext, PullResult
from .session import Session, Source, fetch_chunk


@dataclass
class _Scratch:
    """A host buffer registered with one transport (grown on demand)."""

    buf: Any = None
    region: Any = None

    def ensure(self, t: Any, n: int) -> None:
        if self.buf is not None and int(self.buf.numel()) >= n:
            return
        self.release(t)
        self.buf = alloc_bytes(max(n, 4096), "cpu")
        self.region = t.register(address(self.buf), int(self.buf.numel()))

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


def _geometry(src: Source, slot_bytes: int, descs: list[bytes]) -> _Geometry | None:
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
    edges = np.arange(0, slot_bytes + _checksum.CHUNK, _checksum.CHUNK)
    edges[-1] = min(edges[-1], slot_bytes)
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


def usable(ctx: PullContext, session: Session, rec: Any, held: Held | None) -> bool:
    """Whether ``rec`` can be pulled as deltas onto the version ``held``."""
    gens = session.gens
    if held is None or held.epoch != rec.epoch or held.gens != gens or not 0 < rec.v - held.v:
        return False
    geo = _prepare(ctx, session)
    if not session.sources or any(geo.get(s.rank) is None for s in session.sources):
        return False
    return all(rec.v - held.v <= len(geo[s.rank].descs) for s in session.sources)


def _prepare(ctx: PullContext, session: Session) -> dict[int, _Geometry | None]:
    """Each source's delta geometry, computed once per session (its scratch buffers are released
    with the session)."""
    if session.delta is not None:
        return session.delta
    geo: dict[int, _Geometry | None] = {}
    for src in session.sources:
        served = session.records[src.rank]["transports"].get(src.transport, {})
        descs = served.get("delta")
        sizes = session.layouts[src.rank].region_sizes
        if not isinstance(descs, list) or not descs or not sizes:
            geo[src.rank] = None
            continue
        geo[src.rank] = _geometry(src, int(sizes[0]), [unb64(d) for d in descs])
    endpoints = ctx.endpoints

    def release() -> None:
        for src in session.sources:
            g, t = geo.get(src.rank), endpoints.get(src.transport)
            if g is not None and t is not None:
                for scratch in (g.head, g.check, g.entries):
                    scratch.release(t)

    session.delta = geo
    session.closers.append(release)
    return geo


def fetch(t: Any, src: Source, session: Session, rec: Any, base: int, deadline: float) -> tuple | None:
    """Reads the deltas ``base + 1 .. rec.v`` that ``src``'s reads cover: per delta the
    (table, entries) it read, plus bytes and ops; None where they cannot be used."""
    g = session.delta[src.rank]
    k, tb = len(g.descs), table_bytes(g.nchunks)
    us = np.arange(base + 1, rec.v + 1, dtype=np.int64)
    m = len(us)
    g.head.ensure(t, m * tb)
    g.check.ensure(t, m * HEADER_BYTES)
    zeros = np.zeros(m, dtype=np.int64)
    heads = ReadBatch(us % k, zeros, zeros, np.arange(m, dtype=np.int64) * tb, np.full(m, tb, dtype=np.int64))
    _read(t, src, g.descs, g.head.region, heads, deadline)
    raw = g.head.buf.numpy()[: m * tb].reshape(m, tb)
    head = raw[:, :HEADER_BYTES].view(np.uint64)
    gen = session.gens[src.rank] if session.gens else 0
    want = np.stack([np.full(m, DELTA_MAGIC, np.uint64), us.astype(np.uint64), (us - 1).astype(np.uint64)], 1)
    ok = (head[:, :3] == want).all() and (head[:, 3] == DELTA_STABLE).all()
    ok = ok and (head[:, 4] == rec.epoch).all() and (head[:, 5] == gen).all() and (head[:, 6] == g.nchunks).all()
    if not ok:
        return None
    tables = raw[:, HEADER_BYTES : HEADER_BYTES + 4 * (g.nchunks + 1)].view(np.uint32).astype(np.int64)
    if np.any(tables[:, -1] != head[:, 7].astype(np.int64)) or np.any(np.diff(tables, axis=1) < 0):
        return None
    # one row per (delta, run of chunks): the runs' entries are contiguous in the buffer
    lo, hi = tables[:, g.run_lo], tables[:, g.run_hi + 1]
    n = (hi - lo).reshape(-1)
    which = np.repeat(np.arange(m), len(g.run_lo))
    rows = n > 0
    dst = np.concatenate(([0], np.cumsum(n[rows])[:-1])).astype(np.int64) * 4
    total = int(n.sum()) * 4
    nbytes, ops = m * tb + m * HEADER_BYTES, 2 * m
    if total + g.partial >= g.full:  # would read more than a full pull (counting verification)
        return None
    if total:
        g.entries.ensure(t, total)
        batch = ReadBatch(
            (us % k)[which[rows]],
            table_bytes(g.nchunks) + 4 * lo.reshape(-1)[rows],
            np.zeros(int(rows.sum()), dtype=np.int64),
            dst,
            4 * n[rows],
        )
        _read(t, src, g.descs, g.entries.region, batch, deadline)
        nbytes, ops = nbytes + total, ops + len(batch)
    # the headers again: a delta rewritten under the reads is not used
    again = ReadBatch(us % k, zeros, zeros, np.arange(m, dtype=np.int64) * HEADER_BYTES, np.full(m, 64))
    _read(t, src, g.descs, g.check.region, again, deadline)
    if not np.array_equal(g.check.buf.numpy()[: m * HEADER_BYTES].reshape(m, HEADER_BYTES), raw[:, :HEADER_BYTES]):
        return None
    entries = g.entries.buf.numpy()[:total].view(np.uint32).copy() if total else np.zeros(0, np.uint32)
    return [(tables[i], lo[i], hi[i]) for i in range(m)], entries, nbytes, ops


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


def pull(ctx: PullContext, session: Session, rec: Any, base: int, deadline: float) -> PullResult | None:
    """Pulls ``rec`` as the deltas since ``base`` into ``dest`` and verifies it (repairing what
    does not match); None before any write if the deltas cannot be used (the caller pulls in
    full)."""
    got = {}
    nbytes = ops = 0
    try:
        for src in session.sources:
            r = fetch(ctx.endpoints[src.transport], src, session, rec, base, deadline)
            if r is None:
                return None
            got[src.rank] = r
            nbytes, ops = nbytes + r[2], ops + r[3]
    except TransportError:
        return None  # the full pull reads around a dead source (failover) or reports it
    writes = [decode(src, session, got[src.rank]) for src in session.sources]
    if any(w is None for w in writes):
        return None  # before any write
    for region, offsets, values in (w for per in writes for w in per):
        _scatter(ctx.dest.buffers[region], offsets, values)
    repaired, extra, fops = verify_repair(ctx, session.sources, rec, deadline)
    nbytes += extra + STAMP_BYTES * len(session.sources)  # the stamp check that follows
    return PullResult(nbytes, 0, ops + fops + len(session.sources), repaired, delta=True)


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

    sum_keys = [ctx.keys.sums(rec.v, src.rank) for src in sources]
    dest = ctx.dest.buffers
    repaired = nbytes = ops = 0
    for src, key, raw in zip(sources, sum_keys, ctx.store.get_many(sum_keys)):
        if raw is None:  # collected: the slot was reused since
            raise StaleVersionError(f"checksums of version {rec.v} were collected (a newer version replaced it)")
        sums = ctx.chan.open(key, raw)
        if sums.get("algo") != _checksum.ALGO:
            raise IntegrityError(f"publisher rank {src.rank} uses checksum {sums.get('algo')}, not {_checksum.ALGO}")
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


__all__ = ["pull", "usable", "verify_repair"]
