"""Chunk checksums of staging regions, so a subscriber can verify what it read (``verify=True``).

A rank's checksum record of a version (``Keys.sums``) is bound to what the bytes mean, not only to
the bytes: it names the version, the rank's incarnation and the hash of the slot layout it was
computed over (``bind``), and a reader takes it only where all three are the version record's
(``read_sums``). A record of another history (same key, same token: replayed) or of a slot laid out
otherwise than the reader planned (a packing generation it was misled about) fails the check, so a
wrong plan cannot verify: the checksums hold the bytes to the places the version's own layouts say.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from transports._copy import CopyPlan

CHUNK = 1 << 20

try:  # xxh3 runs at memory speed; crc32 is the fallback that always exists
    import xxhash as _xxhash

    ALGO = "xxh3_64"

    def _hash(mv: memoryview) -> int:
        return _xxhash.xxh3_64_intdigest(mv)
except ImportError:  # pragma: no cover - depends on the environment
    ALGO = "crc32"

    def _hash(mv: memoryview) -> int:
        return zlib.crc32(mv)


def hash_bytes(data: memoryview | bytes | np.ndarray) -> int:
    return _hash(memoryview(data).cast("B"))


def host_array(buf: Any) -> np.ndarray:
    """A uint8 numpy view (or host copy, for CUDA) of a torch uint8 buffer or numpy array."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    if buf.device.type != "cpu":
        buf = buf.cpu()
    return buf.numpy()


def chunk_edges(size: int, cuts: Any = (), chunk: int = CHUNK) -> np.ndarray:
    """The starts of the checksum chunks of a buffer of ``size`` bytes: every multiple of ``chunk``
    and every offset of ``cuts`` (where readers' ranges begin and end: the cells of a packed slot),
    so a reader whose ranges are whole cells covers whole chunks and re-reads none to check them,
    and each chunk lies within one ``chunk``-aligned chunk."""
    cuts = np.asarray(cuts, dtype=np.int64).reshape(-1)
    cuts = cuts[(cuts > 0) & (cuts < size)]
    return np.unique(np.concatenate((np.arange(0, max(size, 1), chunk, dtype=np.int64), cuts)))


def slot_edges(layout: Any, size: int) -> np.ndarray:
    """``chunk_edges`` of the first region (``size`` bytes) of a staging slot laid out as ``layout``
    (``region_edges``)."""
    return region_edges(layout, [size])[0]


def region_edges(layout: Any, sizes: Sequence[int]) -> list[np.ndarray]:
    """``chunk_edges`` of each region of a slot laid out as ``layout`` (a ``RankLayout``; region
    ``i`` has ``sizes[i]`` bytes): the tensors' (a packed slot's cells') starts and ends cut the
    chunks, so a reader whose ranges are whole cells covers whole chunks."""
    out = []
    for i, size in enumerate(sizes):
        at = np.array([(t.offset, t.offset + t.nbytes) for t in layout.tensors if t.region == i], dtype=np.int64)
        out.append(chunk_edges(size, at))
    return out


def slot_sums(buffers: Sequence[Any], layout: Any) -> dict:
    """The chunk checksums of a slot's ``buffers`` laid out as ``layout``, cut at its cells
    (``region_edges``)."""
    sizes = [b.nbytes if isinstance(b, np.ndarray) else int(b.numel()) * b.element_size() for b in buffers]
    return chunk_sums(buffers, edges=region_edges(layout, sizes))


def bind(sums: dict, v: int, inc: str, layout: str) -> dict:
    """``sums`` as the checksum record of version ``v`` of a rank of incarnation ``inc`` whose slot
    is laid out as the layout of hash ``layout``."""
    return {**sums, "v": v, "inc": inc, "layout": layout}


def read_sums(chan: Any, rec: Any, ranks: Sequence[int], known: dict | None = None) -> dict:
    """The checksum records of version record ``rec`` of publisher ranks ``ranks`` (one batched read;
    ``known``: records read already, by rank, added to), each checked to be bound to ``rec``:
    ``StaleVersionError`` where one was collected (a newer version replaced ``rec``),
    ``IntegrityError`` naming the key where one is of another version, incarnation or slot layout."""
    from ..errors import IntegrityError, StaleVersionError

    known = {} if known is None else known
    todo = [r for r in ranks if r not in known]
    keys = [chan.keys.sums(rec.v, r) for r in todo]
    for r, key, raw in zip(todo, keys, chan.store.get_many(keys) if keys else []):
        if raw is None:  # written before the commit: collected since, so the slot was reused
            raise StaleVersionError(f"checksums of version {rec.v} were collected (a newer version replaced it)")
        sums = chan.open(key, raw)
        want = (rec.v, rec.incs[r] if rec.incs else None, rec.layouts[r] if rec.layouts else None)
        got = (sums.get("v"), sums.get("inc"), sums.get("layout")) if isinstance(sums, dict) else None
        if got != want:
            raise IntegrityError(
                f"store key {key!r} holds checksums of another version, publisher incarnation or slot layout "
                f"than version {rec.v} of publisher rank {r} (a record of a lost history put back?)"
            )
        if sums.get("algo") != ALGO:
            raise IntegrityError(f"publisher rank {r} uses checksum {sums.get('algo')}, this subscriber {ALGO}")
        known[r] = sums
    return known


def chunk_sums(buffers: Sequence[Any], chunk: int = CHUNK, edges: Sequence[Any] | None = None) -> dict:
    """``{"algo", "chunk", "regions": [[hash of each chunk] per buffer], "sizes"}``; with
    ``edges`` (per buffer the chunk starts, ``chunk_edges``) also ``"edges"``: chunks of varying
    length, each at most ``chunk`` bytes."""
    regions, sizes = [], []
    for i, buf in enumerate(buffers):
        arr = host_array(buf)
        starts = np.arange(0, len(arr), chunk) if edges is None else np.asarray(edges[i], dtype=np.int64)
        ends = np.append(starts[1:], len(arr)).tolist()
        regions.append([hash_bytes(arr[a:e]) for a, e in zip(starts.tolist(), ends)])
        sizes.append(len(arr))
    out = {"algo": ALGO, "chunk": chunk, "regions": regions, "sizes": sizes}
    if edges is not None:
        out["edges"] = [np.asarray(e, dtype=np.int64).tolist() for e in edges]
    return out


class _Stream:
    def __init__(self) -> None:
        if ALGO == "xxh3_64":
            self._h = _xxhash.xxh3_64()
            self._crc = None
        else:
            self._h, self._crc = None, 0

    def update(self, data: np.ndarray) -> None:
        mv = memoryview(np.ascontiguousarray(data)).cast("B")
        if self._h is not None:
            self._h.update(mv)
        else:
            self._crc = zlib.crc32(mv, self._crc)

    def digest(self) -> int:
        return self._h.intdigest() if self._h is not None else self._crc


def _starts(sums: dict, region: int) -> np.ndarray:
    """The chunk starts of ``region`` in ``sums`` (fixed ``chunk`` bytes where it has no edges)."""
    size = int(sums["sizes"][region])
    edges = sums.get("edges")
    if edges is None:
        return np.arange(0, max(size, 1), int(sums["chunk"]), dtype=np.int64)
    return np.asarray(edges[region], dtype=np.int64)


def tensor_at(layout: Any) -> Any:
    """``name_at(region, offset)`` for ``verify_reads``: the name of ``layout``'s tensor holding
    that byte of a destination region (a ``RankLayout``)."""

    def name_at(region: int, offset: int) -> str:  # (only for an error: the layout is scanned then)
        for t in layout.tensors:
            r, lo, hi, name = t.region, t.offset, t.offset + t.nbytes, t.name
            if r == region and lo <= offset < hi:
                return name
        return f"region {region} offset {offset}"

    return name_at


def verify_reads(
    batch: Any, sums: dict, dest: Sequence[Any], fetch, *, where: str, repair: Any = None, name_at: Any = None
) -> int:
    """Verifies every byte ``batch`` read into ``dest`` against the source's chunk sums.

    The chunks the batch covers completely are gathered from the destination in source order
    (one vectorised copy plan, no Python call per read) and hashed; for a chunk it covers only in
    part, ``fetch(region, offset, n)`` reads the whole chunk again, its hash is checked, and the
    destination bytes are compared with it (``fetch=None``: such a chunk is left to a later check
    of the whole destination, nothing is read again). Raises ``IntegrityError``; with
    ``repair(dst_region, dst_offset, bytes)`` a destination chunk that does not match is instead
    written from the chunk read again (whose own hash must match); returns how many chunks were
    repaired. ``name_at(dst_region, dst_offset)`` (``tensor_at``) names the destination tensor in errors.
    """
    from ..errors import IntegrityError

    host = [host_array(d) for d in dest]
    order = np.lexsort((batch.src_offset, batch.src_region))
    keep = order[batch.nbytes[order] > 0]
    sreg, soff, n = batch.src_region[keep], batch.src_offset[keep], batch.nbytes[keep]
    dreg, doff = batch.dst_region[keep], batch.dst_offset[keep]
    # split the reads at chunk starts: one piece per (read, chunk), keyed by a global chunk index
    regions = np.unique(sreg).tolist()
    try:
        starts = {r: _starts(sums, r) for r in regions}
        sizes = {r: int(sums["sizes"][r]) for r in regions}
        expected = {r: sums["regions"][r] for r in regions}
    except (IndexError, KeyError, TypeError, ValueError):
        raise IntegrityError(f"{where}: no checksums for regions {regions}") from None
    base = {}
    at = 0
    for r in regions:
        base[r] = at
        at += len(starts[r])
    all_starts = np.concatenate([starts[r] for r in regions]) if regions else np.zeros(0, np.int64)
    all_ends = np.concatenate([np.append(starts[r][1:], sizes[r]) for r in regions]) if regions else all_starts
    ri = np.searchsorted(np.array(regions, dtype=np.int64), sreg)
    c0 = np.empty(len(sreg), dtype=np.int64)
    c1 = np.empty(len(sreg), dtype=np.int64)
    for j, r in enumerate(regions):  # one step per source region (a few), vectorised inside
        m = ri == j
        c0[m] = np.searchsorted(starts[r], soff[m], side="right") - 1 + base[r]
        c1[m] = np.searchsorted(starts[r], soff[m] + n[m] - 1, side="right") - 1 + base[r]
    if len(sreg) and (np.any(c0 < 0) or np.any(soff + n > np.array([sizes[r] for r in regions])[ri])):
        raise IntegrityError(f"{where}: reads past the checksummed bytes")
    count = c1 - c0 + 1
    row = np.repeat(np.arange(len(sreg)), count)
    c = np.repeat(c0, count) + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(soff[row], all_starts[c])
    hi = np.minimum((soff + n)[row], all_ends[c])
    plen = hi - lo
    pdoff = doff[row] + lo - soff[row]
    pdreg = dreg[row]
    covered = np.bincount(c, weights=plen, minlength=len(all_starts)).astype(np.int64)
    length = all_ends - all_starts
    touched = np.flatnonzero(covered > 0)
    whole = touched[covered[touched] == length[touched]]
    # a whole chunk read in one piece is hashed where it landed; one of several pieces is
    # gathered from the destination in source order first (one vectorised copy plan)
    npieces = np.bincount(c, minlength=len(all_starts))
    single = whole[npieces[whole] == 1]
    several = whole[npieces[whole] > 1]
    region_of = np.repeat(np.array(regions, dtype=np.int64), [len(starts[r]) for r in regions])
    first_index = np.repeat(np.array([base[r] for r in regions], dtype=np.int64), [len(starts[r]) for r in regions])
    index_in = np.arange(len(all_starts)) - first_index
    bad: list[int] = []
    piece_of = np.full(len(all_starts), -1, dtype=np.int64)
    piece_of[c] = np.arange(len(c))  # (the last piece of each chunk: the only one, for ``single``)
    for k, p in zip(single.tolist(), piece_of[single].tolist()):
        dr, do, m = int(pdreg[p]), int(pdoff[p]), int(plen[p])
        if hash_bytes(host[dr][do : do + m]) != expected[int(region_of[k])][int(index_in[k])]:
            bad.append(k)
    in_several = np.isin(c, several)
    gather_n = plen[in_several]
    scratch = np.empty(int(gather_n.sum()), dtype=np.uint8)
    if len(scratch):
        at_scratch = np.cumsum(gather_n) - gather_n
        addrs = np.array([h.ctypes.data for h in host], dtype=np.int64)
        CopyPlan.of(scratch.ctypes.data + at_scratch, addrs[pdreg[in_several]] + pdoff[in_several], gather_n).run()
    at = 0
    for k in several.tolist():  # one hash per chunk (its pieces are contiguous in ``scratch``)
        size = int(length[k])
        h = hash_bytes(scratch[at : at + size])
        at += size
        if h != expected[int(region_of[k])][int(index_in[k])]:
            bad.append(k)

    def tensor(p: int) -> str:
        return "" if name_at is None else f" (tensor {name_at(int(pdreg[p]), int(pdoff[p]))})"

    if bad and repair is None:
        k = bad[0]
        raise IntegrityError(
            f"{where}: checksum mismatch in chunk {int(index_in[k])} of region {int(region_of[k])}, bytes "
            f"[{int(all_starts[k])}, {int(all_ends[k])}){tensor(int(np.flatnonzero(c == k)[0]))} "
            "(corrupted in flight, or changed since?)"
        )
    todo = bad + ([] if fetch is None else np.setdiff1d(touched, whole).tolist())
    repaired = 0
    for k in todo:  # chunks read again: mismatches and chunks covered in part (few, by design)
        r, lo_k, size = int(region_of[k]), int(all_starts[k]), int(length[k])
        ref = fetch(r, lo_k, size)
        if hash_bytes(ref) != expected[r][int(index_in[k])]:
            raise IntegrityError(f"{where}: checksum mismatch re-reading region {r} bytes [{lo_k}, {lo_k + size})")
        fixed = False
        for p in np.flatnonzero(c == k).tolist():
            a, m, dr, do = int(lo[p]) - lo_k, int(plen[p]), int(pdreg[p]), int(pdoff[p])
            if not np.array_equal(host[dr][do : do + m], ref[a : a + m]):
                if repair is None:
                    raise IntegrityError(
                        f"{where}: bytes read from region {r} offset {lo_k + a} (+{m}){tensor(p)} "
                        "differ from the publisher's (corrupted in flight, or changed since?)"
                    )
                repair(dr, do, ref[a : a + m])
                fixed = True
        repaired += fixed
    return repaired
