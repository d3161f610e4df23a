"""Chunk checksums of staging regions, so a subscriber can verify what it read (``verify=True``)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

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


def chunk_sums(buffers: Sequence[Any], chunk: int = CHUNK) -> dict:
    """``{"algo", "chunk", "regions": [[hash of each chunk] per buffer]}``."""
    regions, sizes = [], []
    for buf in buffers:
        arr = host_array(buf)
        regions.append([hash_bytes(arr[i : i + chunk]) for i in range(0, len(arr), chunk)])
        sizes.append(len(arr))
    return {"algo": ALGO, "chunk": chunk, "regions": regions, "sizes": sizes}


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


def verify_reads(batch: Any, sums: dict, dest: Sequence[Any], fetch, *, where: str, repair: Any = None) -> int:
    """Verifies every byte ``batch`` read into ``dest`` against the source's chunk sums.

    A chunk the batch covers completely is hashed from the destination in source order; for a
    chunk it covers only in part, ``fetch(region, offset, n)`` reads the whole chunk again, its
    hash is checked, and the destination bytes are compared with it (``fetch=None``: such a chunk is
    left to a later check of the whole destination, nothing is read again). Raises ``IntegrityError``;
    with ``repair(dst_region, dst_offset, bytes)`` a destination chunk that does not match is
    instead written from the chunk read again (whose own hash must match); returns how many
    chunks were repaired.
    """
    from ..errors import IntegrityError

    chunk = int(sums["chunk"])
    regions, sizes = sums["regions"], sums["sizes"]
    host = [host_array(d) for d in dest]
    order = np.lexsort((batch.src_offset, batch.src_region))
    rows = zip(
        *(getattr(batch, c)[order].tolist() for c in ("src_region", "src_offset", "dst_region", "dst_offset", "nbytes"))
    )
    pieces: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for sreg, soff, dreg, doff, n in rows:  # split reads at chunk boundaries
        while n > 0:
            c = soff // chunk
            take = min(n, (c + 1) * chunk - soff)
            pieces.setdefault((sreg, c), []).append((soff, dreg, doff, take))
            soff, doff, n = soff + take, doff + take, n - take
    repaired = 0
    for (sreg, c), parts in pieces.items():
        try:
            expected = regions[sreg][c]
            lo = c * chunk
            length = min(chunk, int(sizes[sreg]) - lo)
        except (IndexError, TypeError, ValueError):
            raise IntegrityError(f"{where}: no checksum for region {sreg} chunk {c}") from None
        if sum(p[3] for p in parts) == length:  # sorted and non-overlapping: the whole chunk
            h = _Stream()
            for _, dreg, doff, n in parts:
                h.update(host[dreg][doff : doff + n])
            if h.digest() == expected:
                continue
            if repair is None:
                raise IntegrityError(
                    f"{where}: checksum mismatch in region {sreg} bytes [{lo}, {lo + length}) (corrupted in flight?)"
                )
        elif fetch is None:
            continue
        ref = fetch(sreg, lo, length)
        if hash_bytes(ref) != expected:
            raise IntegrityError(f"{where}: checksum mismatch re-reading region {sreg} chunk {c}")
        fixed = False
        for soff, dreg, doff, n in parts:
            if not np.array_equal(host[dreg][doff : doff + n], ref[soff - lo : soff - lo + n]):
                if repair is None:
                    raise IntegrityError(
                        f"{where}: bytes read from region {sreg} offset {soff} "
                        f"(+{n}) differ from the publisher's (corrupted in flight?)"
                    )
                repair(dreg, doff, ref[soff - lo : soff - lo + n])
                fixed = True
        repaired += fixed
    return repaired
