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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transports._copy import CopyPlan

CHUNK = 1 << 20

try:  # xxh3 runs at memory speed; crc32 is the fallback that always exists
    import xxhash as _xxhash

    ALGO = "xxh3_64"

    def _hash(mv: memoryview) -> int:
        return _xxhash.xxh3_64_intdigest(mv)

    def hash_seeded(data: np.ndarray, seed: int) -> int:
        """``data``'s hash (contiguous bytes) started from ``seed`` (64 bits; crc32: its low 32)."""
        return _xxhash.xxh3_64_intdigest(data, seed)
except ImportError:  # pragma: no cover - depends on the environment
    ALGO = "crc32"

    def _hash(mv: memoryview) -> int:
        return zlib.crc32(mv)

    def hash_seeded(data: np.ndarray, seed: int) -> int:
        """``data``'s hash (contiguous bytes) started from ``seed`` (64 bits; crc32: its low 32)."""
        return zlib.crc32(data, seed & 0xFFFFFFFF)


ALGOS = ("xxh3_64", "crc32")  # an algorithm's number where a binary header names it: its index + 1


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


@dataclass(frozen=True)
class Coverage:
    """What a batch's reads cover of a source's checksum chunks (``coverage``): fixed for one batch
    and one chunk layout, so computed once and checked against each version's sums. Per piece (a
    read cut at chunk starts): its chunk ``c``, source offset ``lo``, length and destination; per
    chunk its region, index and bounds; the chunks read whole in one piece (``single``, with that
    piece), whole in several (``several``, gathered by ``gather``), and in part (``partial``)."""

    batch: Any  # the batch it was computed for
    key: tuple  # and the sums' (sizes, chunk, edges)
    regions: list
    c: np.ndarray
    lo: np.ndarray
    plen: np.ndarray
    pdreg: np.ndarray
    pdoff: np.ndarray
    region_of: np.ndarray
    index_in: np.ndarray
    all_starts: np.ndarray
    all_ends: np.ndarray
    single: list  # (chunk, region, index, destination region, offset, length)
    several: list  # (chunk, region, index, length), in ``gather`` order
    gather: tuple  # (destination regions, offsets, lengths) of the pieces of ``several``, in order
    partial: list
    plans: dict = field(default_factory=dict)  # the gather's copy plan and scratch, by destination addresses
    halves: int = 0  # ``single``'s first entries holding about half its bytes (0: too few bytes to split)


def _key(sums: dict) -> tuple:
    return (sums.get("sizes"), sums.get("chunk"), sums.get("edges"))


def coverage(batch: Any, sums: dict, where: str) -> Coverage:
    """What ``batch`` covers of the chunks of ``sums`` (``Coverage``): ``IntegrityError`` where it
    reads regions ``sums`` has no chunks of, or past them."""
    from ..errors import IntegrityError

    order = np.lexsort((batch.src_offset, batch.src_region))
    keep = order[batch.nbytes[order] > 0]
    sreg, soff, n = batch.src_region[keep], batch.src_offset[keep], batch.nbytes[keep]
    dreg, doff = batch.dst_region[keep], batch.dst_offset[keep]
    # split the reads at chunk starts: one piece per (read, chunk), keyed by a global chunk index
    regions = np.unique(sreg).tolist()
    try:
        starts = {r: _starts(sums, r) for r in regions}
        sizes = {r: int(sums["sizes"][r]) for r in regions}
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
    piece_of = np.full(len(all_starts), -1, dtype=np.int64)
    piece_of[c] = np.arange(len(c))  # (the last piece of each chunk: the only one, for ``single``)
    p = piece_of[single]
    singles = list(
        zip(*(a.tolist() for a in (single, region_of[single], index_in[single], pdreg[p], pdoff[p], plen[p])))
    )
    severals = list(zip(*(a.tolist() for a in (several, region_of[several], index_in[several], length[several]))))
    in_several = np.isin(c, several)
    gather = (pdreg[in_several], pdoff[in_several], plen[in_several])
    partial = np.setdiff1d(touched, whole).tolist()
    cum = np.cumsum(plen[p])
    halves = int(np.searchsorted(cum, cum[-1] / 2)) + 1 if len(cum) > 1 and cum[-1] >= PARALLEL_HASH_BYTES else 0
    return Coverage(
        batch, _key(sums), regions, c, lo, plen, pdreg, pdoff, region_of, index_in, all_starts, all_ends, singles,
        severals, gather, partial, halves=min(halves, max(len(singles) - 1, 0)),
    )  # fmt: skip


#: Bytes of chunks read whole from which ``verify_reads`` with a ``pool`` hashes them on two threads
#: (xxh3 lets go of the GIL): a 10 MB destination in 47 chunks, its caches cold, hashed in 0.92 ms
#: on two threads where one took 1.06 (medians of 40).
PARALLEL_HASH_BYTES = 4 << 20


def verify_reads(
    batch: Any,
    sums: dict,
    dest: Sequence[Any],
    fetch,
    *,
    where: str,
    repair: Any = None,
    name_at: Any = None,
    cache: dict | None = None,
    pool: Any = None,
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
    ``cache``: a dict kept by the caller for this very batch, where what it covers (``coverage``)
    is kept from call to call while the sums' chunks stay the same, and the host views of ``dest``
    while it is the same list. ``pool``: an executor with a thread free, which hashes half the
    chunks read whole in one piece where they hold ``PARALLEL_HASH_BYTES`` or more.
    """
    from ..errors import IntegrityError

    kept = None if cache is None else cache.get("host")  # (host buffers' views: the same while they are)
    if kept is not None and len(kept[0]) == len(dest) and all(a is b for a, b in zip(kept[0], dest)):
        host = kept[1]
    else:
        host = [host_array(d) for d in dest]
        if cache is not None and all(isinstance(d, np.ndarray) or d.device.type == "cpu" for d in dest):
            cache["host"] = (list(dest), host)
    cov = None if cache is None else cache.get("coverage")
    if cov is None or cov.batch is not batch or cov.key != _key(sums):
        cov = coverage(batch, sums, where)
        if cache is not None:
            cache["coverage"] = cov
    try:
        expected = {r: sums["regions"][r] for r in cov.regions}
    except (IndexError, KeyError, TypeError, ValueError):
        raise IntegrityError(f"{where}: no checksums for regions {cov.regions}") from None
    c, lo, plen, pdreg, pdoff = cov.c, cov.lo, cov.plen, cov.pdreg, cov.pdoff
    region_of, index_in, all_starts, all_ends = cov.region_of, cov.index_in, cov.all_starts, cov.all_ends

    def mismatched(single: list) -> list:
        return [k for k, r, i, dr, do, m in single if hash_bytes(host[dr][do : do + m]) != expected[r][i]]

    half = cov.halves if pool is not None else 0
    other = pool.submit(mismatched, cov.single[:half]) if half else None
    bad = mismatched(cov.single[half:])
    if other is not None:
        bad = other.result() + bad
    gather_n = cov.gather[2]
    if len(gather_n):
        addrs = tuple(h.ctypes.data for h in host)
        plan = cov.plans.get(addrs)
        if plan is None:  # (one kept: a device destination's host copies move)
            cov.plans.clear()
            scratch = np.empty(int(gather_n.sum()), dtype=np.uint8)
            at_scratch = np.cumsum(gather_n) - gather_n
            src = np.array(addrs, dtype=np.int64)[cov.gather[0]] + cov.gather[1]
            plan = cov.plans[addrs] = (CopyPlan.of(scratch.ctypes.data + at_scratch, src, gather_n), scratch)
        plan[0].run()
        scratch = plan[1]
        at = 0
        for k, r, i, size in cov.several:  # one hash per chunk (its pieces are contiguous in ``scratch``)
            h = hash_bytes(scratch[at : at + size])
            at += size
            if h != expected[r][i]:
                bad.append(k)
    length = all_ends - all_starts

    def tensor(p: int) -> str:
        return "" if name_at is None else f" (tensor {name_at(int(pdreg[p]), int(pdoff[p]))})"

    if bad and repair is None:
        k = bad[0]
        raise IntegrityError(
            f"{where}: checksum mismatch in chunk {int(index_in[k])} of region {int(region_of[k])}, bytes "
            f"[{int(all_starts[k])}, {int(all_ends[k])}){tensor(int(np.flatnonzero(c == k)[0]))} "
            "(corrupted in flight, or changed since?)"
        )
    todo = bad + ([] if fetch is None else cov.partial)
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
