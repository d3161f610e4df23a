"""Chunk checksums cut where readers' ranges begin and end (``checksum.slot_edges``): a reader whose
reads are whole cells re-reads nothing to verify them; bad bytes are found, and repaired where asked."""

from __future__ import annotations

import numpy as np
import pytest

from transports.base import ReadBatch
from wbridge.errors import IntegrityError
from wbridge.protocol.checksum import chunk_edges, chunk_sums, verify_reads


def _setup(cuts: list[int]) -> tuple[np.ndarray, dict, ReadBatch, np.ndarray]:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 3 << 20, dtype=np.uint8)  # three 1 MiB chunks, cut further by cells
    sums = chunk_sums([src], chunk=1 << 20, edges=[chunk_edges(len(src), cuts)])
    # a reader of the cells [100, 5000) and [1 MiB + 7, 2 MiB + 3), the second one row by row
    rows = [(100, 0, 4900)]
    at = 4900
    for a in range((1 << 20) + 7, (2 << 20) + 3, 1000):
        n = min(1000, (2 << 20) + 3 - a)
        rows.append((a, at, n))
        at += n
    rows = rows[::-1]  # any order
    batch = ReadBatch.of([(0, s, 0, d, n) for s, d, n in rows])
    dest = np.zeros(at, dtype=np.uint8)
    for s, d, n in rows:
        dest[d : d + n] = src[s : s + n]
    return src, sums, batch, dest


def test_whole_cells_verify_without_reading_again() -> None:
    src, sums, batch, dest = _setup([100, 5000, (1 << 20) + 7, (2 << 20) + 3])
    fetched = []

    def fetch(region: int, offset: int, n: int) -> np.ndarray:
        fetched.append((offset, n))
        return src[offset : offset + n].copy()

    assert verify_reads(batch, sums, [dest], fetch, where="t") == 0
    assert fetched == []
    dest[4900 + 123_456] ^= 1  # a bad byte in the cell read row by row
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        verify_reads(batch, sums, [dest], fetch, where="t")
    written = []

    def repair(region: int, offset: int, data: np.ndarray) -> None:
        written.append(offset)
        dest[offset : offset + len(data)] = data

    assert verify_reads(batch, sums, [dest], fetch, where="t", repair=repair) == 1
    assert verify_reads(batch, sums, [dest], None, where="t") == 0 and len(written) == 1


def test_fixed_chunks_covered_in_part_are_read_again() -> None:
    src, sums, batch, dest = _setup([])  # 1 MiB chunks: the reads cover each only in part
    fetched = []

    def fetch(region: int, offset: int, n: int) -> np.ndarray:
        fetched.append((offset, n))
        return src[offset : offset + n].copy()

    assert verify_reads(batch, sums, [dest], fetch, where="t") == 0
    assert sorted(fetched) == [(0, 1 << 20), (1 << 20, 1 << 20), (2 << 20, 1 << 20)]


def test_what_a_batch_covers_is_kept_for_that_batch_alone() -> None:
    # ``cache``: the coverage of a batch is computed once; another batch (or other chunks) never reuses it
    src, sums, batch, dest = _setup([100, 5000, (1 << 20) + 7, (2 << 20) + 3])
    cache: dict = {}
    assert verify_reads(batch, sums, [dest], None, where="t", cache=cache) == 0
    kept = cache["coverage"]
    assert verify_reads(batch, sums, [dest], None, where="t", cache=cache) == 0 and cache["coverage"] is kept
    # another batch into the same destination: the third chunk's cell [2 MiB + 3, 3 MiB), one read
    other = np.zeros(1 << 20, dtype=np.uint8)
    other[: (1 << 20) - 3] = src[(2 << 20) + 3 :]
    batch2 = ReadBatch.of([(0, (2 << 20) + 3, 0, 0, (1 << 20) - 3)])
    assert verify_reads(batch2, sums, [other], None, where="t", cache=cache) == 0
    other[5] ^= 1
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        verify_reads(batch2, sums, [other], None, where="t", cache=cache)
    # other chunks for the first batch (fixed 1 MiB ones, each covered in part: read again)
    fixed = chunk_sums([src], chunk=1 << 20, edges=[chunk_edges(len(src), [])])
    fetched = []

    def fetch(region: int, offset: int, n: int) -> np.ndarray:
        fetched.append(offset)
        return src[offset : offset + n].copy()

    other[5] ^= 1
    assert verify_reads(batch2, fixed, [other], fetch, where="t", cache=cache) == 0 and fetched == [2 << 20]
    assert verify_reads(batch, fixed, [dest], fetch, where="t", cache=cache) == 0 and len(fetched) == 4


def test_chunks_hashed_on_two_threads_find_every_bad_byte() -> None:
    """With a ``pool`` and ``PARALLEL_HASH_BYTES`` or more of chunks read whole, the pool's thread
    hashes the first half of them: a bad byte in either half is found, and repaired, alike."""
    from concurrent.futures import ThreadPoolExecutor

    from wbridge.protocol import checksum

    rng = np.random.default_rng(1)
    size = checksum.PARALLEL_HASH_BYTES + (3 << 20) + 12_345
    src = rng.integers(0, 256, size, dtype=np.uint8)
    sums = chunk_sums([src], chunk=1 << 20)
    batch = ReadBatch.of([(0, 0, 0, 0, size)])
    with ThreadPoolExecutor(1) as pool:
        for bad in (5, size // 2 - 1, size - 3):  # (the first half, the middle, the last chunk)
            dest, cache = src.copy(), {}
            assert verify_reads(batch, sums, [dest], None, where="t", cache=cache, pool=pool) == 0
            assert 0 < cache["coverage"].halves < len(cache["coverage"].single)
            dest[bad] ^= 0x10
            with pytest.raises(IntegrityError, match=f"chunk {bad >> 20} "):
                verify_reads(batch, sums, [dest], None, where="t", cache=cache, pool=pool)

            def repair(region: int, offset: int, data: np.ndarray, dest: np.ndarray = dest) -> None:
                dest[offset : offset + len(data)] = data

            fetch = lambda region, offset, n: src[offset : offset + n].copy()  # noqa: E731
            assert verify_reads(batch, sums, [dest], fetch, where="t", repair=repair, cache=cache, pool=pool) == 1
            assert np.array_equal(dest, src)
