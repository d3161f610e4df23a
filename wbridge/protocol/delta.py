"""The on-wire format of a version's delta (see ``wbridge.publish.delta`` for the encoding).

Layout of one delta buffer (native byte order)::

    header   8 x uint64   magic, version v, base v - 1, state, epoch, packing gen of v, nchunks, nentries
    table    uint32[nchunks + 1] at byte 64: entries of chunk c are [table[c], table[c + 1])
    entries  uint32 at byte ``table_bytes(nchunks)``: word index within its chunk (low 16 bits) | new word << 16

The header says ``DELTA_WRITING`` while the buffer is rewritten and ``DELTA_NONE`` where the version
has no delta; readers (``wbridge.pull.delta``) read it before and after the entries (a seqlock).
Entries are word indices in the byte order of ``v``'s slot (its packing generation's layout).
"""

from __future__ import annotations

CHUNK_WORDS = 4096  # 2-byte words per chunk: an entry's in-chunk index fits in 12 bits
CHUNK_BYTES = 2 * CHUNK_WORDS
HEADER_BYTES = 64
DELTA_MAGIC = 0x574244454C544131  # "WBDELTA1"
DELTA_STABLE, DELTA_WRITING, DELTA_NONE = 0, 1, 2
CAPACITY_FRACTION = 4  # a delta buffer holds up to 1/4 of the slot's words changed (4 bytes each)


def table_bytes(nchunks: int) -> int:
    """Bytes of the header plus the offset table, rounded up to 8: what a reader reads first."""
    return (HEADER_BYTES + 4 * (nchunks + 1) + 7) // 8 * 8


def geometry(slot_bytes: int) -> tuple[int, int] | None:
    """``(nchunks, capacity in entries)`` of the deltas of a slot of ``slot_bytes``; None where the
    slot is too small for one word. The last byte of an odd-sized slot is in no word: a version
    that changes it has no delta."""
    if slot_bytes < 2:
        return None
    words = slot_bytes // 2
    return -(-words // CHUNK_WORDS), max(CHUNK_WORDS, words // CAPACITY_FRACTION)


__all__ = [
    "CAPACITY_FRACTION",
    "CHUNK_BYTES",
    "CHUNK_WORDS",
    "DELTA_MAGIC",
    "DELTA_NONE",
    "DELTA_STABLE",
    "DELTA_WRITING",
    "HEADER_BYTES",
    "geometry",
    "table_bytes",
]
