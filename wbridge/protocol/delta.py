"""The on-wire format of a version's delta, and its codec (``wbridge.publish.delta`` scans the
slots, ``wbridge.pull.delta_reads`` reads and applies).

A delta says, per changed **pair** (4 bytes: two 2-byte words) of a staging slot, where it is and
how each of its bytes moved against the base version's byte (``new - old`` mod 256). An Adam step
moves a bf16 or FP8 element by one unit in the last place: as a byte difference that is ``+1`` or
``-1`` in one byte, whatever carries a XOR would show (measured on AdamW steps at lr 1e-6: 2.7 bits
of entropy per changed word XORed, 1.8 as differences). Differences apply byte by byte, so a reader
whose reads start or end on an odd byte applies them too. Coded as:

- **positions**: Elias-Fano over the pair indices, the low ``low_bits`` bits of each packed
  (``low``), the rest as one unary bucket count per ``2**low_bits`` pairs (``high``: a one per
  pair, a zero closing each bucket). ``low_bits`` is chosen per delta as the one that makes the two
  smallest (computed exactly for every width); with 0 ``high`` is a bitmap with a zero after each pair.
- **values**: each byte's difference ``d`` as a 2-bit code ``min(d + 1 mod 256, 3)`` (0: -1,
  1: unchanged, 2: +1, 3: other, its byte in ``raw``); a pair's four codes make one byte ``k``,
  which a per-delta dictionary of the 15 most frequent ``k`` (in the header, from a sample of the
  pairs) turns into a 4-bit symbol (``sym``); symbol 15 escapes, its ``k`` in ``esc``.

Layout of one delta buffer (native byte order, little-endian hosts)::

    header   16 x uint64       magic, v, base v - 1, state, epoch, packing gen of v, nchunks, pairs,
                               low_bits, escapes, raw bytes, then the byte offsets of the streams
                               high, low, sym, esc, raw (from the buffer's start)
    dict     uint8[16] at 128  symbol -> k (15 used)
    tables   uint32[3][nchunks + 1] at ``HEADER_BYTES``: per chunk the first pair, escape and raw
             byte of that chunk (cumulative counts; the last entry is the total)
    streams  high bits, low bits, 4-bit symbols, escapes, raw bytes (bits little-endian in bytes)

A chunk is ``CHUNK_PAIRS`` pairs of the slot. The tables give every stream's bytes of any run of
chunks, so a reader reads the streams of just the chunks its own reads cover (``ranges``) and
decodes them alone (``decode``): nothing of other readers' changes. The header says
``DELTA_WRITING`` while the buffer is rewritten and ``DELTA_NONE`` where the version has no delta;
readers read it before and after the streams (a seqlock). Pairs are in the byte order of ``v``'s
slot (its packing generation's layout); a slot's last pair may be short (padded with bytes that
never change). Everything here is vectorised numpy: no Python step per pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAIR = 4  # bytes per pair
CHUNK_PAIRS = 8192  # pairs per chunk (32 KiB of slot): >= 2 ** MAX_LOW_BITS
CHUNK_BYTES = PAIR * CHUNK_PAIRS
MAX_LOW_BITS = 13
HEADER_BYTES = 144  # 16 x uint64, then the dictionary
DICT_AT, DICT_SIZE = 128, 15
ESCAPE = DICT_SIZE  # the symbol whose ``k`` is in the escape stream
DELTA_MAGIC = 0x574244454C544132  # "WBDELTA2"
DELTA_STABLE, DELTA_WRITING, DELTA_NONE = 0, 1, 2
# header fields (uint64 indices)
MAGIC, VERSION, BASE, STATE, EPOCH, GEN, NCHUNKS, PAIRS, LOW_BITS, ESCAPES, RAWS = range(11)
STREAMS = ("high", "low", "sym", "esc", "raw")
OFFSETS = 11  # header fields 11..15: the byte offset of each stream
CAPACITY_FRACTION = 2  # a delta buffer's streams hold up to half the slot's bytes


_SPREAD = np.uint32(0x41041)  # four 2-bit fields at bits 0, 8, 16, 24 -> one byte at bit 18
SAME = 0x55  # the ``k`` of a pair whose four bytes did not change (never coded)
_KDIFF = np.array(  # k -> its four byte differences as a little-endian uint32 (raw bytes 0)
    [sum((0xFF, 0, 0x01, 0)[(k >> (2 * j)) & 3] << (8 * j) for j in range(4)) for k in range(256)], dtype=np.uint32
)
_KCODES = np.array([sum(((k >> (2 * j)) & 3) << (8 * j) for j in range(4)) for k in range(256)], dtype=np.uint32)


class Workspace:
    """Arrays reused from one call to the next, grown and never shrunk: a fresh multi-megabyte
    temporary costs its page faults each time, which on a virtual machine cost more than the
    arithmetic on it (3 ms for one 4 MB temporary here). What ``encode`` and ``decode`` return may
    be views of these arrays, valid until the workspace's next call."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype: type | np.dtype) -> np.ndarray:
        """``n`` elements of ``dtype`` (contents undefined) under ``name``."""
        size = n * np.dtype(dtype).itemsize
        a = self._arrays.get(name)
        if a is None or len(a) < size:
            a = self._arrays[name] = np.empty(max(4096, size + size // 4), np.uint8)
        return a[:size].view(dtype)

    def full(self, name: str, n: int, value: int, dtype: type | np.dtype) -> np.ndarray:
        """``n`` elements of ``dtype``, each ``value`` (numpy's minimum of a uint8 array and a
        scalar runs an order of magnitude slower than of two arrays)."""
        key = f"_full.{name}"
        a = self._arrays.get(key)
        size = n * np.dtype(dtype).itemsize
        if a is None or len(a) < size:
            a = self._arrays[key] = np.empty(max(4096, size + size // 4), np.uint8)
            a.view(dtype)[:] = value
        return a[:size].view(dtype)

    def lookup(self, table: np.ndarray, index: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out[:] = table[index]`` for small unsigned ``index``: numpy's take first converts such
        indices to a fresh intp array, so they are widened into a reused one here."""
        wide = self.get("_lookup", len(index), np.intp)
        np.copyto(wide, index, casting="unsafe")
        return np.take(table, wide, out=out)

    def arange(self, n: int) -> np.ndarray:
        """``0 .. n - 1`` as int64 (computed once per size class)."""
        a = self._arrays.get("_arange")
        if a is None or len(a) < 8 * n:
            self._arrays["_arange"] = a = np.arange(max(1024, n + n // 4), dtype=np.int64).view(np.uint8)
        return a[: 8 * n].view(np.int64)


def table_bytes(nchunks: int) -> int:
    """Bytes of the header, dictionary and tables, rounded up to 8: what a reader reads first."""
    return (HEADER_BYTES + 12 * (nchunks + 1) + 7) // 8 * 8


@dataclass(frozen=True)
class Geometry:
    """The deltas of a slot of ``slot_bytes``: its pairs, chunks and a buffer's size."""

    slot_bytes: int
    pairs: int  # ceil(slot_bytes / PAIR)
    nchunks: int
    capacity: int  # bytes of streams a buffer holds

    @property
    def buffer_bytes(self) -> int:
        return table_bytes(self.nchunks) + self.capacity


def geometry(slot_bytes: int) -> Geometry | None:
    """The delta geometry of a slot of ``slot_bytes``; None where it is empty."""
    if slot_bytes < 1:
        return None
    pairs = -(-slot_bytes // PAIR)
    return Geometry(slot_bytes, pairs, -(-pairs // CHUNK_PAIRS), max(4096, slot_bytes // CAPACITY_FRACTION))


def codes(diffs: np.ndarray, ws: Workspace | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per pair (rows of ``diffs``: its four byte differences ``d``, uint8 ``[n, 4]``) the byte
    ``k`` of its four 2-bit codes ``min(d + 1 mod 256, 3)`` (0: -1, 1: same, 2: +1, 3: other;
    byte ``j``'s at bits ``2j``, ``2j + 1``), and the codes themselves (uint8 ``[4 n]``): a few
    vectorised byte and word operations."""
    ws = ws or Workspace()
    n = len(diffs)
    c = np.add(np.ascontiguousarray(diffs).reshape(-1), np.uint8(1), out=ws.get("codes.c", 4 * n, np.uint8))
    np.minimum(c, ws.full("three", 4 * n, 3, np.uint8), out=c)
    x = np.multiply(c.view(np.uint32), _SPREAD, out=ws.get("codes.x", n, np.uint32))
    np.right_shift(x, np.uint32(18), out=x)
    k = ws.get("codes.k", n, np.uint8)
    np.copyto(k, x, casting="unsafe")
    return k, c


def raw_pairs(k: np.ndarray, ws: Workspace | None = None) -> np.ndarray:
    """Which pairs (their codes ``k``) carry raw bytes (a byte coded 3)."""
    ws = ws or Workspace()
    t = np.right_shift(k, np.uint8(1), out=ws.get("raw.t", len(k), np.uint8))
    np.bitwise_and(t, k, out=t)
    np.bitwise_and(t, np.uint8(0x55), out=t)
    return np.flatnonzero(np.not_equal(t, 0, out=ws.get("raw.b", len(k), bool)))  # (of bools: the fast nonzero)


def _pack_bits(values: np.ndarray, width: int, ws: Workspace | None = None) -> np.ndarray:
    """``values`` (int64, each < 2**width) as ``width``-bit fields, little-endian, in bytes."""
    ws = ws or Workspace()
    n = len(values)
    if width == 0 or not n:
        return np.zeros(0, np.uint8)
    if width == 8:
        out = ws.get("pack.out", n, np.uint8)
        np.copyto(out, values, casting="unsafe")
        return out
    if width in (1, 2, 4):
        per = 8 // width
        m = -(-n // per)
        v = ws.get("pack.v", m * per, np.uint8)
        np.copyto(v[:n], values, casting="unsafe")
        v[n:] = 0
        v = v.reshape(m, per)
        out = ws.get("pack.out", m, np.uint8)
        out[:] = v[:, 0]
        t = ws.get("pack.t", m, np.uint8)
        for j in range(1, per):
            np.left_shift(v[:, j], np.uint8(j * width), out=t)
            np.bitwise_or(out, t, out=out)
        return out
    v = values.astype("<u2").view(np.uint8)  # any other width (at most 16): through single bits
    bits = np.unpackbits(v, bitorder="little").reshape(n, 16)[:, :width]
    return np.packbits(bits.reshape(-1), bitorder="little")


def _unpack_bits(data: np.ndarray, first_bit: int, count: int, width: int) -> np.ndarray:
    """``count`` fields of ``width`` bits starting at bit ``first_bit`` of ``data`` (int64)."""
    if width == 0 or count == 0:
        return np.zeros(count, np.int64)
    if width == 8 and first_bit == 0:
        out = data[:count]
    elif width in (1, 2, 4) and first_bit % width == 0:
        per = 8 // width
        skip = first_bit // width
        m = -(-(skip + count) // per)
        b = data[:m]
        out = np.empty((m, per), np.uint8)
        for j in range(per):
            out[:, j] = (b >> (j * width)) & ((1 << width) - 1)
        out = out.reshape(-1)[skip : skip + count]
    else:
        bits = np.unpackbits(data, bitorder="little")[first_bit : first_bit + count * width]
        if len(bits) != count * width:
            raise ValueError("short field stream")
        wide = np.zeros((count, 16), np.uint8)
        wide[:, :width] = bits.reshape(count, width)
        out = np.packbits(wide.reshape(-1), bitorder="little").view("<u2")
    if len(out) != count:
        raise ValueError("short field stream")
    return out.astype(np.int64)


def low_bits_for(changed: int, pairs: int) -> int:
    """The Elias-Fano low width that makes ``high`` and ``low`` smallest, in bits (exact sizes)."""
    sizes = [-(-pairs // (1 << lb)) + changed * (1 + lb) for lb in range(MAX_LOW_BITS + 1)]
    return int(np.argmin(sizes))


@dataclass(frozen=True)
class Encoded:
    """One delta, coded: its low width, dictionary, tables and streams (``STREAMS`` order)."""

    low_bits: int
    dictionary: np.ndarray  # uint8[16]
    tables: np.ndarray  # uint32[3, nchunks + 1]: first pair, escape, raw byte of each chunk
    streams: tuple[np.ndarray, ...]

    @property
    def pairs(self) -> int:
        return int(self.tables[0, -1])

    @property
    def nbytes(self) -> int:
        """Bytes of the streams, each aligned to 8."""
        return sum((len(s) + 7) // 8 * 8 for s in self.streams)


def encode(pairs_at: np.ndarray, diffs: np.ndarray, geo: Geometry, ws: Workspace | None = None) -> Encoded:
    """Codes the changed pairs ``pairs_at`` (ascending pair indices, int64) whose byte differences
    are the rows of ``diffs`` (uint8 ``[n, 4]``, no row all zero), for a slot of ``geo``. Its
    streams may be views of ``ws``: write them (``write``) before ``ws`` is used again."""
    ws = ws or Workspace()
    n = len(pairs_at)
    k, c = codes(diffs, ws)
    # the dictionary: the 15 most frequent k (a sample of a few thousand pairs decides)
    step = max(1, n // 8192)
    counts = np.bincount(k[::step], minlength=256)
    counts[SAME] = -1  # (no changed pair has it)
    top = np.argsort(-counts, kind="stable")[:DICT_SIZE].astype(np.uint8)
    lut = np.full(256, ESCAPE, np.uint8)
    lut[top] = np.arange(DICT_SIZE, dtype=np.uint8)
    dictionary = np.zeros(16, np.uint8)
    dictionary[:DICT_SIZE] = top
    sym = ws.get("enc.sym", n + 1, np.uint8)
    ws.lookup(lut, k, sym[:n])
    sym[n] = 0  # (a last half byte of padding)
    escaped = np.flatnonzero(np.equal(sym[:n], ESCAPE, out=ws.get("enc.b", n, bool)))
    esc = k[escaped]
    # raw bytes: the differences of bytes coded 3, in pair then byte order
    with_raw = raw_pairs(k, ws)
    some = np.take(np.ascontiguousarray(diffs).reshape(-1).view(np.uint32), with_raw).view(np.uint8)
    is_raw = np.take(c.view(np.uint32), with_raw)  # their codes, four bytes per pair
    raw = np.compress(is_raw.view(np.uint8) == 3, some)  # (compress: 7x a boolean index here)
    # tables: cumulative counts at chunk starts
    starts = np.searchsorted(pairs_at, np.arange(geo.nchunks + 1, dtype=np.int64) * CHUNK_PAIRS)
    per = (((is_raw & np.uint32(0x01010101)) & (is_raw >> np.uint32(1))) * np.uint32(0x01010101)) >> np.uint32(24)
    raw_cum = np.concatenate(([0], np.cumsum(per, dtype=np.int64)))  # (bytes coded 3: both code bits set)
    tables = np.stack([starts, np.searchsorted(escaped, starts), raw_cum[np.searchsorted(with_raw, starts)]]).astype(
        np.uint32
    )
    # positions: Elias-Fano
    lb = low_bits_for(n, geo.pairs)
    buckets = -(-geo.pairs // (1 << lb))
    high_bits = ws.get("enc.high", buckets + n, bool)
    high_bits.fill(False)
    q = np.right_shift(pairs_at, lb, out=ws.get("enc.q", n, np.int64))
    high_bits[np.add(q, ws.arange(n), out=q)] = True
    high = np.packbits(high_bits, bitorder="little")
    low = _pack_bits(np.bitwise_and(pairs_at, (1 << lb) - 1, out=q), lb, ws)
    half = (n + 1) // 2
    packed_sym = np.left_shift(sym[1 : 2 * half : 2], np.uint8(4), out=ws.get("enc.nib", half, np.uint8))
    np.bitwise_or(packed_sym, sym[0 : 2 * half : 2], out=packed_sym)
    return Encoded(lb, dictionary, tables, (high, low, packed_sym, esc, raw))


def write(buf: np.ndarray, e: Encoded) -> None:
    """Writes ``e``'s dictionary, tables and streams into ``buf`` (a delta buffer, uint8) and its
    counts and offsets into the header; the caller writes the header's state last."""
    head = buf[:HEADER_BYTES].view(np.uint64)
    nchunks = e.tables.shape[1] - 1
    buf[DICT_AT : DICT_AT + 16] = e.dictionary
    buf[HEADER_BYTES : HEADER_BYTES + e.tables.nbytes] = e.tables.reshape(-1).view(np.uint8)
    at = table_bytes(nchunks)
    for i, s in enumerate(e.streams):
        head[OFFSETS + i] = at
        buf[at : at + len(s)] = s
        at += (len(s) + 7) // 8 * 8
    head[PAIRS], head[LOW_BITS] = e.pairs, e.low_bits
    head[ESCAPES], head[RAWS] = int(e.tables[1, -1]), int(e.tables[2, -1])


@dataclass(frozen=True)
class Parsed:
    """A delta's header, dictionary and tables as a reader read them (``parse``)."""

    low_bits: int
    pairs: int  # of the whole slot
    dictionary: np.ndarray  # uint8[16]
    tables: np.ndarray  # int64[3, nchunks + 1]; -1 where not read
    offsets: np.ndarray  # int64[5]: where each stream starts in the buffer


def table_rows(nchunks: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where in a delta buffer the table entries of runs of chunks ``lo[i]..hi[i]`` are (entries
    ``lo`` to ``hi + 1`` of each table): ``(offsets, lengths)`` in bytes, int64 ``[3 * runs]``,
    table by table. A reader of a slice reads these, not the whole tables."""
    base = HEADER_BYTES + 4 * (nchunks + 1) * np.arange(3, dtype=np.int64)
    offsets = (base[:, None] + 4 * lo[None, :]).reshape(-1)
    return offsets, np.tile(4 * (hi - lo + 2), 3)


def parse(
    header: np.ndarray, entries: np.ndarray, lo: np.ndarray, hi: np.ndarray, nchunks: int, pairs: int
) -> Parsed | None:
    """A delta's ``header`` (``HEADER_BYTES`` bytes) and the table ``entries`` of runs ``lo..hi``
    as ``table_rows`` placed them (uint8, concatenated), of a slot of ``pairs`` pairs in
    ``nchunks`` chunks; None where they do not make sense."""
    head = header[:HEADER_BYTES].view(np.uint64)
    lb = int(head[LOW_BITS])
    totals = np.array([int(head[PAIRS]), int(head[ESCAPES]), int(head[RAWS])], dtype=np.int64)
    if lb > MAX_LOW_BITS or len(entries) != int(np.sum(table_rows(nchunks, lo, hi)[1])):
        return None
    tables = np.full((3, nchunks + 1), -1, dtype=np.int64)
    values = entries.view(np.uint32).astype(np.int64)
    at = 0
    for t in range(3):  # (a step per table and run: runs are few, their entries vectorised)
        for a, b in zip(lo, hi):
            got = values[at : at + b - a + 2]
            at += b - a + 2
            if np.any(np.diff(got) < 0) or got[-1] > totals[t] or (a == 0 and got[0] != 0):
                return None
            if b + 1 == nchunks and got[-1] != totals[t]:
                return None
            tables[t, a : b + 2] = got
    return Parsed(
        lb, pairs, header[DICT_AT : DICT_AT + 16].copy(), tables, head[OFFSETS : OFFSETS + 5].astype(np.int64)
    )


def parse_buffer(buf: np.ndarray, nchunks: int, pairs: int) -> Parsed | None:
    """``parse`` of a whole delta buffer (its header and every table entry)."""
    lo, hi = np.array([0]), np.array([nchunks - 1])
    offsets, lengths = table_rows(nchunks, lo, hi)
    entries = np.concatenate([buf[o : o + n] for o, n in zip(offsets, lengths)])
    return parse(buf[:HEADER_BYTES], entries, lo, hi, nchunks, pairs)


def ranges(p: Parsed, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per run of chunks ``lo[i]..hi[i]`` the byte range of each stream it uses: ``(offsets,
    lengths)``, int64 ``[runs, 5]`` (offsets from the buffer's start)."""
    t = p.tables
    p0, p1 = t[0, lo], t[0, hi + 1]
    lb = p.low_bits
    h0 = ((lo * CHUNK_PAIRS) >> lb) + p0
    h1 = np.minimum(((hi + 1) * CHUNK_PAIRS) >> lb, -(-p.pairs // (1 << lb))) + p1
    first = np.stack([h0 // 8, (p0 * lb) // 8, p0 // 2, t[1, lo], t[2, lo]], 1)
    end = np.stack([-(-h1 // 8), -(-(p1 * lb) // 8), -(-p1 // 2), t[1, hi + 1], t[2, hi + 1]], 1)
    return first + p.offsets[None, :], end - first


def decode(
    p: Parsed, lo: int, hi: int, pieces: list[np.ndarray], ws: Workspace | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """The changed pairs of chunks ``lo..hi`` from their stream ``pieces`` (as ``ranges`` cut
    them): ``(pair indices ascending, byte differences [n, 4] uint8)``, views of ``ws`` (valid until
    its next use); None where malformed."""
    ws = ws or Workspace()
    t, lb = p.tables, p.low_bits
    p0, p1 = int(t[0, lo]), int(t[0, hi + 1])
    n = p1 - p0
    if n == 0:
        return np.zeros(0, np.int64), np.zeros((0, 4), np.uint8)
    try:
        h0 = ((lo * CHUNK_PAIRS) >> lb) + p0
        bits = np.unpackbits(pieces[0], bitorder="little")[h0 % 8 :]
        at = np.flatnonzero(bits.view(bool))[:n]  # (unpacked bits are 0 or 1: valid bools)
        if len(at) != n:
            return None
        np.add(at, h0 - p0, out=at)
        np.subtract(at, ws.arange(n), out=at)  # the bucket of each pair
        np.left_shift(at, lb, out=at)
        np.bitwise_or(at, _unpack_bits(pieces[1], (p0 * lb) % 8, n, lb), out=at)
        if np.any(np.less_equal(at[1:], at[:-1], out=ws.get("dec.b", n - 1, bool))):
            return None
        if at[0] < lo * CHUNK_PAIRS or at[-1] >= min((hi + 1) * CHUNK_PAIRS, p.pairs):
            return None
        nib = pieces[2]
        both = ws.get("dec.both", 2 * len(nib), np.uint8)
        np.bitwise_and(nib, np.uint8(15), out=both[0::2])
        np.right_shift(nib, np.uint8(4), out=both[1::2])
        sym = both[p0 % 2 : p0 % 2 + n]
        if len(sym) != n:
            return None
        k = ws.lookup(p.dictionary, sym, ws.get("dec.k", n, np.uint8))
        escaped = np.flatnonzero(np.equal(sym, ESCAPE, out=ws.get("dec.b", n, bool)))
        if len(escaped) != len(pieces[3]):
            return None
        k[escaped] = pieces[3]
        if np.any(np.equal(k, SAME, out=ws.get("dec.b", n, bool))):
            return None
        diffs = ws.lookup(_KDIFF, k, ws.get("dec.d", n, np.uint32)).view(np.uint8).reshape(n, 4)
        with_raw = raw_pairs(k, ws)
        # the bytes coded 3 (in pair, then byte order) take the raw stream's bytes
        byte = np.flatnonzero(np.take(_KCODES, np.take(k, with_raw)).view(np.uint8) == 3)
        if len(byte) != len(pieces[4]):
            return None
        diffs.reshape(-1)[np.take(with_raw, byte >> 2) * 4 + (byte & 3)] = pieces[4]
    except (ValueError, IndexError):
        return None
    return at, diffs


__all__ = [
    "CAPACITY_FRACTION",
    "CHUNK_BYTES",
    "CHUNK_PAIRS",
    "DELTA_MAGIC",
    "DELTA_NONE",
    "DELTA_STABLE",
    "DELTA_WRITING",
    "Encoded",
    "Geometry",
    "HEADER_BYTES",
    "PAIR",
    "Parsed",
    "codes",
    "decode",
    "encode",
    "geometry",
    "parse",
    "parse_buffer",
    "ranges",
    "table_rows",
    "table_bytes",
    "write",
]
