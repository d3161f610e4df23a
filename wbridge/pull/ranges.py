"""Byte ranges of a staging buffer, as relays split and announce them (``wbridge.pull.zone``):
sorted, disjoint ``(lo, hi)`` pairs; set differences, unions, even splits and clipped read batches."""

from __future__ import annotations

import numpy as np

from transports.base import ReadBatch

ALIGN = 4096  # range boundaries (bytes)

Ranges = list[tuple[int, int]]


def subtract(ranges: Ranges, cut: Ranges) -> Ranges:
    """``ranges`` without the bytes of ``cut`` (both sorted, disjoint)."""
    out = []
    for lo, hi in ranges:
        for a, b in cut:
            if b <= lo or a >= hi:
                continue
            if a > lo:
                out.append((lo, a))
            lo = max(lo, b)
            if lo >= hi:
                break
        if lo < hi:
            out.append((lo, hi))
    return out


def union(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def part(size: int, i: int, n: int) -> tuple[int, int]:
    """Byte range ``i`` of ``n`` near-equal ranges of ``size`` bytes (boundaries ``ALIGN``ed)."""
    cut = [min(size, (size * j // n + ALIGN // 2) // ALIGN * ALIGN) for j in range(n + 1)]
    cut[-1] = size
    return cut[i], cut[i + 1]


def clip(batch: ReadBatch, ranges: Ranges) -> ReadBatch:
    """The reads of ``batch`` (into one destination region) cut to the destination bytes in ``ranges``."""
    end = batch.dst_offset + batch.nbytes
    cols: list[list[np.ndarray]] = [[], [], [], [], []]
    for lo, hi in ranges:
        a, b = np.maximum(batch.dst_offset, lo), np.minimum(end, hi)
        m = b > a
        shift = a[m] - batch.dst_offset[m]
        picked = (batch.src_region[m], batch.src_offset[m] + shift, batch.dst_region[m], a[m], (b - a)[m])
        for c, x in zip(cols, picked):
            c.append(x)
    return ReadBatch(*(np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols))


def widen(batches: list[ReadBatch], ranges: Ranges, chunk: int) -> Ranges:
    """``ranges`` widened to the destination bytes of every source chunk (``chunk`` bytes of one
    source region, per batch: one batch per source) that ``batches`` clipped to ``ranges`` touch,
    as far as ``batches`` read them: a check of the widened ranges never covers a chunk only in
    part where the whole batches do not."""
    out = list(ranges)
    for batch in batches:
        inside = clip(batch, ranges)
        if not len(inside):
            continue
        touched = np.unique(_chunk_keys(inside, chunk)[0])
        keys, soff, doff, n = _chunk_keys(batch, chunk)
        m = np.isin(keys, touched)
        out += list(zip(doff[m].tolist(), (doff[m] + n[m]).tolist()))
    return union(out)


def _chunk_keys(batch: ReadBatch, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``batch``'s reads cut at ``chunk`` boundaries of their source: per piece a key (source region
    and chunk), its source offset, destination offset and length."""
    first = batch.src_offset // chunk
    count = np.where(batch.nbytes > 0, (batch.src_offset + batch.nbytes - 1) // chunk - first + 1, 0)
    row = np.repeat(np.arange(len(batch)), count)
    c = first[row] + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(batch.src_offset[row], c * chunk)
    hi = np.minimum((batch.src_offset + batch.nbytes)[row], (c + 1) * chunk)
    doff = batch.dst_offset[row] + lo - batch.src_offset[row]
    return batch.src_region[row] * (1 << 40) + c, lo, doff, hi - lo


__all__ = ["ALIGN", "Ranges", "clip", "part", "subtract", "union", "widen"]
