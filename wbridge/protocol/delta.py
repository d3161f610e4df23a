"""The on-wire format of a version's delta, and its codec (``wbridge.publish.delta`` encodes each
version against the last, ``wbridge.pull.delta_reads`` reads and applies).

A delta says, per changed **pair** (4 bytes: two 2-byte words) of a staging slot, where it is and
how each of its bytes moved against the base version's byte (``new - old`` mod 256). An Adam step
moves a bf16 or FP8 element by one unit in the last place: as a byte difference that is ``+1`` or
``-1`` in one byte, whatever carries a XOR would show (measured on AdamW steps at lr 1e-6: 2.7 bits
of entropy per changed word XORed, 1.8 as differences). Differences apply byte by byte, so a reader
whose reads start or end on an odd byte applies them too. Coded as:

- **positions**: Elias-Fano over the pair indices, the low ``low_bits`` bits of each packed
  (``low``, eight fields at a time: a group of eight is ``low_bits`` bytes), the rest as one unary
  bucket count per ``2**low_bits`` pairs (``high``: a one per pair, a zero closing each bucket).
  ``low_bits`` is chosen per delta as the one that makes the two smallest (computed exactly for
  every width); 0 means a plain bitmap instead, one bit per pair of the slot (``high``; no
  ``low``), which is what the densest deltas take (Elias-Fano at width 0 would be that plus a bit
  per pair).
- **values**: each byte's difference ``d`` as a 2-bit code ``min(d + 1 mod 256, 3)`` (0: -1,
  1: unchanged, 2: +1, 3: other, its byte in ``raw``); a pair's four codes make one byte ``k``,
  which a per-delta dictionary of the 15 most frequent ``k`` (in the header, from a sample of the
  changed pairs) turns into a 4-bit symbol (``sym``); symbol 15 escapes, its ``k`` in ``esc``.

Layout of one delta buffer (native byte order, little-endian hosts)::

    header   16 x uint64       magic, v, base v - 1, state, epoch, packing gen of v, nchunks, pairs,
                               low_bits, escapes, raw bytes, then the byte offsets of the streams
                               high, low, sym, esc, raw (from the buffer's start)
    dict     uint8[16] at 128  symbol -> k (15 used)
    tables   uint32[3][nchunks + 1] at ``HEADER_BYTES``: per chunk the first pair, escape and raw
             byte of that chunk (cumulative counts; the last entry is the total)
    streams  high bits, low fields, 4-bit symbols, escapes, raw bytes (bits little-endian in bytes)

A chunk is ``CHUNK_PAIRS`` pairs of the slot. The tables give every stream's bytes of any run of
chunks, so a reader reads the streams of just the chunks its own reads cover (``ranges``) and
decodes them alone (``decode``): nothing of other readers' changes. The header says
``DELTA_WRITING`` while the buffer is rewritten and ``DELTA_NONE`` where the version has no delta;
readers read it before and after the streams (a seqlock). Pairs are in the byte order of ``v``'s
slot (its packing generation's layout); a slot's last pair may be short (padded with bytes that
never change).

The encoder (``encode_slots`` from two slots on the host, ``encode`` from changed pairs found
elsewhere) runs as compiled loops (``_delta_kernels``, numba, imported on the first encode only):
one streaming pass over the slots, then passes over the changed pairs alone. The dictionary
counts the ``k`` of up to 65536 of the changed pairs. The reader (``parse``, ``ranges``,
``decode``) is vectorised numpy: no Python step per pair, table lookups two pairs at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

PAIR = 4  # bytes per pair
CHUNK_PAIRS = 8192  # pairs per chunk (32 KiB of slot): >= 2 ** MAX_LOW_BITS, a multiple of 64
CHUNK_BYTES = PAIR * CHUNK_PAIRS
MAX_LOW_BITS = 13
GROUP = 8  # low fields are packed this many at a time (``low_bits`` bytes a group)
HEADER_BYTES = 144  # 16 x uint64, then the dictionary
DICT_AT, DICT_SIZE = 128, 15
ESCAPE = DICT_SIZE  # the symbol whose ``k`` is in the escape stream
DELTA_MAGIC = 0x574244454C544133  # "WBDELTA3"
DELTA_STABLE, DELTA_WRITING, DELTA_NONE = 0, 1, 2
# header fields (uint64 indices)
MAGIC, VERSION, BASE, STATE, EPOCH, GEN, NCHUNKS, PAIRS, LOW_BITS, ESCAPES, RAWS = range(11)
STREAMS = ("high", "low", "sym", "esc", "raw")
OFFSETS = 11  # header fields 11..15: the byte offset of each stream
CAPACITY_FRACTION = 2  # a delta buffer's streams hold up to half the slot's bytes
# A bitmap of positions is taken where it is at most this much larger than the best Elias-Fano:
# the host scan makes it as it goes (a word per 64 pairs compared), while Elias-Fano costs a pass
# over the changed pairs (bits set and fields packed one pair at a time), and a bitmap decodes
# faster. The price, over AdamW steps at lr 1e-5 (``benchmarks/delta.py``, about 10% of elements
# changed): 1.29 bytes per changed element where 1.0 (size alone) gives 1.16; lr 1e-6 (Elias-Fano
# at any slack) is not affected.
BITMAP_SLACK = 1.5
SAME = 0x55  # the ``k`` of a pair whose four bytes did not change (never coded)
_CODE_DIFF = (0xFF, 0, 0x01, 0)  # code -> its byte difference (3: from the raw stream)
_KDIFF = np.array(  # k -> its four byte differences as a little-endian uint32 (raw bytes 0)
    [sum(_CODE_DIFF[(k >> (2 * j)) & 3] << (8 * j) for j in range(4)) for k in range(256)], dtype=np.uint32
)
_KRAW = np.array(  # k -> a 1 in each byte coded 3 (raw), as a little-endian uint32
    [sum(int((k >> (2 * j)) & 3 == 3) << (8 * j) for j in range(4)) for k in range(256)], dtype=np.uint32
)


class Workspace:
    """Arrays reused from one call to the next, grown and never shrunk: a fresh multi-megabyte
    temporary costs its page faults each time, which on a virtual machine cost more than the
    arithmetic on it (3 ms for one 4 MB temporary here). What ``encode`` and ``decode`` return may
    be views of these arrays, valid until the workspace's next call."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype: type | np.dtype) -> np.ndarray:
        """``n`` elements of ``dtype`` under ``name``, undefined."""
        size = n * np.dtype(dtype).itemsize
        a = self._arrays.get(name)
        if a is None or len(a) < size:
            a = self._arrays[name] = np.empty(max(4096, size + size // 4), np.uint8)
        return a[:size].view(dtype)

    def mask(self, name: str, n: int) -> np.ndarray:
        """A bool array of ``n`` elements and False after them up to a multiple of 8 (what
        ``nonzero`` takes): the caller fills ``[:n]``."""
        m = self.get(name, -(-n // 8) * 8, bool)
        m[n:] = False
        return m

    def lookup(self, table: np.ndarray, index: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out[:] = table[index]`` for small unsigned ``index``: numpy's take first converts such
        indices to a fresh intp array, so they are widened into a reused one here."""
        wide = self.get("_lookup", len(index), np.intp)
        np.copyto(wide, index, casting="unsafe")
        return np.take(table, wide, out=out, mode="clip")

    def arange(self, n: int) -> np.ndarray:
        """``0 .. n - 1`` as int64 (computed once per size class)."""
        a = self._arrays.get("_arange")
        if a is None or len(a) < 8 * n:
            self._arrays["_arange"] = a = np.arange(max(1024, n + n // 4), dtype=np.int64).view(np.uint8)
        return a[: 8 * n].view(np.int64)


def nonzero(mask: np.ndarray, ws: Workspace, name: str) -> np.ndarray:
    """The indices (int64, ascending) of the True elements of ``mask`` (bool, a multiple of 8
    long: ``Workspace.mask``). Where few of its 8-element groups hold one, the groups are found
    first (a pass over an eighth of the words) and only theirs are looked at; else one pass. May
    be a view of ``ws`` under ``name``."""
    words = mask.view(np.uint64)
    hit = np.not_equal(words, 0, out=ws.get(f"{name}.hit", len(words), bool))
    if 2 * np.count_nonzero(hit) > len(words):
        return np.flatnonzero(mask)
    groups = np.flatnonzero(hit)
    j = np.flatnonzero(np.take(words, groups, out=ws.get(f"{name}.sub", len(groups), np.uint64)).view(bool))
    group = np.right_shift(j, 3, out=ws.get(f"{name}.group", len(j), np.int64))
    out = np.take(groups, group, out=ws.get(f"{name}.at", len(j), np.int64), mode="clip")  # (clip: unbuffered)
    np.left_shift(out, 3, out=out)
    return np.bitwise_or(out, np.bitwise_and(j, 7, out=j), out=out)


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


def _unpack_bits(data: np.ndarray, skip: int, count: int, width: int) -> np.ndarray:
    """``count`` fields of ``width`` bits after the first ``skip`` of ``data`` (whole groups of
    ``GROUP`` fields, as the encoder packs them), int64; ValueError where ``data`` is short."""
    if width == 0 or count == 0:
        return np.zeros(count, np.int64)
    m = -(-(skip + count) // GROUP)
    if len(data) < m * width:
        raise ValueError("short field stream")
    out = np.empty(GROUP * m, np.int64)
    if width in (1, 2, 4, 8):
        per = 8 // width
        b = data[: m * width]
        fields = out.reshape(-1, per)
        for j in range(per):
            np.bitwise_and(np.right_shift(b, np.uint8(j * width)), np.uint8((1 << width) - 1), out=fields[:, j],
                           casting="unsafe")  # fmt: skip
        return out[skip : skip + count]
    words = np.zeros((m, 16), np.uint8)
    words[:, :width] = data[: m * width].reshape(m, width)
    w = words.view(np.uint64)  # [m, 2]: the group's low and high 64 bits
    mask = np.uint64((1 << width) - 1)
    fields = out.reshape(m, GROUP).view(np.uint64)
    for j in range(GROUP):
        s = j * width
        if s + width <= 64:
            f = w[:, 0] >> np.uint64(s)
        elif s >= 64:
            f = w[:, 1] >> np.uint64(s - 64)
        else:  # straddles the two halves
            f = (w[:, 0] >> np.uint64(s)) | (w[:, 1] << np.uint64(64 - s))
        np.bitwise_and(f, mask, out=fields[:, j])
    return out[skip : skip + count]


def low_bits_for(changed: int, pairs: int, slack: float = 1.0) -> int:
    """The Elias-Fano low width that makes ``high`` and ``low`` smallest, in bits (exact sizes;
    whole groups of low fields), or 0 where a bitmap of the slot's pairs is at most ``slack``
    times that."""
    groups = -(-changed // GROUP)
    sizes = [-(-pairs // (1 << lb)) + changed + 8 * groups * lb for lb in range(1, MAX_LOW_BITS + 1)]
    best = int(np.argmin(sizes))
    return 0 if pairs <= slack * sizes[best] else best + 1


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


def _index_dtype(pairs: int) -> type:
    """The dtype the encoder holds pair indices in: 4 bytes each where they fit."""
    return np.uint32 if pairs <= 1 << 32 else np.int64


def encode_slots(
    prev: np.ndarray, cur: np.ndarray, geo: Geometry, most: int, ws: Workspace | None = None
) -> Encoded | None:
    """Codes what changed from slot ``prev`` to slot ``cur`` (uint8, ``geo.slot_bytes`` each; a
    short last pair compared padded with zeros): one compiled pass over the two slots finds the
    changed pairs (their indices, byte differences and bitmap), then the coding works on those
    pairs alone (``_delta_kernels``). None where more than ``most`` pairs changed. Its streams may
    be views of ``ws``: write them (``write``) before ``ws`` is used again."""
    from . import _delta_kernels as kernels

    ws = ws or Workspace()
    size, pairs = geo.slot_bytes, geo.pairs
    whole = size // PAIR * PAIR
    tails = np.zeros((2, PAIR), np.uint8)
    tails[0, : size - whole], tails[1, : size - whole] = prev[whole:size], cur[whole:size]
    tail = tails.view(np.uint32)[:, 0].astype(np.uint64)
    at = ws.get("enc.at", pairs, _index_dtype(pairs))
    diffs = ws.get("enc.diffs", pairs, np.uint32)
    bitmap = ws.get("enc.bitmap", -(-pairs // 64), np.uint64)
    tables = np.zeros((3, geo.nchunks + 1), np.uint32)
    a, b = prev[:whole].view(np.uint32), cur[:whole].view(np.uint32)
    n = kernels.scan(a, b, tail[0], tail[1], int(whole < size), most, CHUNK_PAIRS // 64, bitmap, at, diffs, tables[0])
    if n < 0:
        return None
    return _code(kernels, at[:n], diffs[:n], tables, geo, ws, bitmap.view(np.uint8)[: -(-pairs // 8)])


def load_encoder() -> None:
    """Loads the compiled encoder now (numba's start-up and the kernels' machine code, from its cache
    or compiled): about 0.3 s of CPU once per process, else paid by its first delta. A process that
    forks publishers (a forkserver) calls it once, and every fork starts with the encoder loaded."""
    prev = np.zeros(PAIR * 256, np.uint8)
    cur = prev.copy()
    cur[::7] = 1
    geo = geometry(len(cur))
    encode_slots(prev, cur, geo, geo.pairs)


def encode(pairs_at: np.ndarray, diffs: np.ndarray, geo: Geometry, ws: Workspace | None = None) -> Encoded:
    """Codes the changed pairs ``pairs_at`` (ascending pair indices, int64) whose byte differences
    are the rows of ``diffs`` (uint8 ``[n, 4]``, no row all zero), for a slot of ``geo``: what a
    scan elsewhere found (on a GPU), coded as ``encode_slots`` codes its own. Its streams may be
    views of ``ws``: write them (``write``) before ``ws`` is used again."""
    from . import _delta_kernels as kernels

    ws = ws or Workspace()
    tables = np.zeros((3, geo.nchunks + 1), np.uint32)
    tables[0] = np.searchsorted(pairs_at, np.arange(geo.nchunks + 1, dtype=np.int64) * CHUNK_PAIRS)
    at = np.ascontiguousarray(pairs_at, dtype=_index_dtype(geo.pairs))  # (as encode_slots': one compiled code)
    values = np.ascontiguousarray(diffs, dtype=np.uint8).reshape(-1).view(np.uint32)
    return _code(kernels, at, values, tables, geo, ws, None)


def _code(
    kernels: ModuleType,
    at: np.ndarray,
    diffs: np.ndarray,
    tables: np.ndarray,
    geo: Geometry,
    ws: Workspace,
    bitmap: np.ndarray | None,
) -> Encoded:
    """The changed pairs ``at`` with their byte differences ``diffs`` (uint32) and pair table
    (``tables[0]``) as one delta: the dictionary (the 15 most frequent ``k`` of up to 65536 of the
    pairs), the low width, then symbols, escapes, raw bytes, their tables and the positions
    (``bitmap``: the scan's, where it made one)."""
    n, pairs = len(at), geo.pairs
    lb = low_bits_for(n, pairs, BITMAP_SLACK)
    if lb == 0:
        high = bitmap if bitmap is not None else ws.get("enc.high", -(-pairs // 8), np.uint8)
        low = ws.get("enc.low", 0, np.uint8)
    else:
        high = ws.get("enc.high", -(-(-(-pairs // (1 << lb)) + n) // 8), np.uint8)
        low = ws.get("enc.low", -(-n // GROUP) * lb, np.uint8)
    dictionary = np.zeros(16, np.uint8)
    ks, sym, esc = (
        ws.get("enc.k", n, np.uint8),
        ws.get("enc.sym", (n + 1) // 2, np.uint8),
        ws.get("enc.esc", n, np.uint8),
    )
    raw = ws.get("enc.raw", PAIR * n + PAIR, np.uint8)
    ne, nraw = kernels.code(
        at,
        diffs,
        lb,
        max(1, n // 65536),
        SAME,
        ESCAPE,
        ks,
        dictionary,
        tables,
        sym,
        esc,
        raw,
        high,
        low,
        bitmap is None,
    )
    return Encoded(lb, dictionary, tables, (high, low, sym, esc[:ne], raw[:nraw]))


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
    """A delta's header, dictionary and tables as a reader read them (``parse``), and the lookup
    tables its symbols decode through: per byte of the symbol stream (two pairs), the two pairs'
    byte differences (raw bytes 0) and a 1 in each raw-coded byte, as uint64."""

    low_bits: int
    pairs: int  # of the whole slot
    dictionary: np.ndarray  # uint8[16]
    tables: np.ndarray  # int64[3, nchunks + 1]; -1 where not read
    offsets: np.ndarray  # int64[5]: where each stream starts in the buffer
    byte_diffs: np.ndarray  # uint64[256]
    byte_raws: np.ndarray  # uint64[256]


def table_rows(nchunks: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where in a delta buffer the table entries of runs of chunks ``lo[i]..hi[i]`` are (entries
    ``lo`` to ``hi + 1`` of each table): ``(offsets, lengths)`` in bytes, int64 ``[3 * runs]``,
    table by table. A reader of a slice reads these, not the whole tables."""
    base = HEADER_BYTES + 4 * (nchunks + 1) * np.arange(3, dtype=np.int64)
    offsets = (base[:, None] + 4 * lo[None, :]).reshape(-1)
    return offsets, np.tile(4 * (hi - lo + 2), 3)


def _symbol_tables(dictionary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per byte of the symbol stream, its two pairs' differences and raw marks (``Parsed``); the
    escape symbol's are 0 (the escape stream fills them in)."""
    k = dictionary[:DICT_SIZE].astype(np.intp)
    diff = np.zeros(16, np.uint64)
    raws = np.zeros(16, np.uint64)
    diff[:DICT_SIZE], raws[:DICT_SIZE] = _KDIFF[k], _KRAW[k]
    lo, hi = np.arange(256) & 15, np.arange(256) >> 4
    return diff[lo] | (diff[hi] << np.uint64(32)), raws[lo] | (raws[hi] << np.uint64(32))


def parse(
    header: np.ndarray, entries: np.ndarray, lo: np.ndarray, hi: np.ndarray, nchunks: int, pairs: int
) -> Parsed | None:
    """A delta's ``header`` (``HEADER_BYTES`` bytes) and the table ``entries`` of runs ``lo..hi``
    as ``table_rows`` placed them (uint8, concatenated), of a slot of ``pairs`` pairs in
    ``nchunks`` chunks; None where they do not make sense."""
    head = header[:HEADER_BYTES].view(np.uint64)
    lb = int(head[LOW_BITS])
    totals = np.array([int(head[PAIRS]), int(head[ESCAPES]), int(head[RAWS])], dtype=np.int64)
    dictionary = header[DICT_AT : DICT_AT + 16].copy()
    if lb > MAX_LOW_BITS or len(entries) != int(np.sum(table_rows(nchunks, lo, hi)[1])):
        return None
    if np.any(dictionary[:DICT_SIZE] == SAME):  # (no changed pair has it)
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
    byte_diffs, byte_raws = _symbol_tables(dictionary)
    return Parsed(lb, pairs, dictionary, tables, head[OFFSETS : OFFSETS + 5].astype(np.int64), byte_diffs, byte_raws)


def parse_buffer(buf: np.ndarray, nchunks: int, pairs: int) -> Parsed | None:
    """``parse`` of a whole delta buffer (its header and every table entry)."""
    lo, hi = np.array([0]), np.array([nchunks - 1])
    offsets, lengths = table_rows(nchunks, lo, hi)
    entries = np.concatenate([buf[o : o + n] for o, n in zip(offsets, lengths)])
    return parse(buf[:HEADER_BYTES], entries, lo, hi, nchunks, pairs)


def ranges(p: Parsed, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per run of chunks ``lo[i]..hi[i]`` the byte range of each stream it uses: ``(offsets,
    lengths)``, int64 ``[runs, 5]`` (offsets from the buffer's start). Low fields are read in
    whole groups."""
    t = p.tables
    p0, p1 = t[0, lo], t[0, hi + 1]
    lb = p.low_bits
    if lb == 0:  # a bitmap: the chunks' own bytes of it
        h0, h1 = lo * (CHUNK_PAIRS // 8), np.minimum((hi + 1) * (CHUNK_PAIRS // 8), -(-p.pairs // 8))
    else:
        h0 = (((lo * CHUNK_PAIRS) >> lb) + p0) // 8
        h1 = -(-(np.minimum(((hi + 1) * CHUNK_PAIRS) >> lb, -(-p.pairs // (1 << lb))) + p1) // 8)
    first = np.stack([h0, (p0 // GROUP) * lb, p0 // 2, t[1, lo], t[2, lo]], 1)
    end = np.stack([h1, -(-p1 // GROUP) * lb, -(-p1 // 2), t[1, hi + 1], t[2, hi + 1]], 1)
    return first + p.offsets[None, :], end - first


def _positions_of(p: Parsed, lo: int, hi: int, high: np.ndarray, low: np.ndarray, ws: Workspace) -> np.ndarray | None:
    """The pair indices of chunks ``lo..hi`` (ascending, checked), from their ``high`` and
    ``low`` stream pieces; None where malformed."""
    t, lb = p.tables, p.low_bits
    p0, p1 = int(t[0, lo]), int(t[0, hi + 1])
    n = p1 - p0
    if lb == 0:
        at = np.flatnonzero(np.unpackbits(high, bitorder="little").view(bool))  # (0 or 1: valid bools)
        if len(at) != n:
            return None
        np.add(at, lo * CHUNK_PAIRS, out=at)
    else:
        h0 = ((lo * CHUNK_PAIRS) >> lb) + p0
        at = np.flatnonzero(np.unpackbits(high, bitorder="little")[h0 % 8 :].view(bool))[:n]
        if len(at) != n:
            return None
        np.add(at, h0 - p0, out=at)
        np.subtract(at, ws.arange(n), out=at)  # the bucket of each pair
        np.left_shift(at, lb, out=at)
        np.bitwise_or(at, _unpack_bits(low, p0 % GROUP, n, lb), out=at)
        if np.any(np.less_equal(at[1:], at[:-1], out=ws.get("dec.b", n - 1, bool))):
            return None
    if at[0] < lo * CHUNK_PAIRS or at[-1] >= min((hi + 1) * CHUNK_PAIRS, p.pairs):
        return None
    return at


def decode(
    p: Parsed, lo: int, hi: int, pieces: list[np.ndarray], ws: Workspace | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """The changed pairs of chunks ``lo..hi`` from their stream ``pieces`` (as ``ranges`` cut
    them): ``(pair indices ascending, byte differences [n, 4] uint8)``, views of ``ws`` (valid until
    its next use); None where malformed."""
    ws = ws or Workspace()
    t = p.tables
    p0, p1 = int(t[0, lo]), int(t[0, hi + 1])
    n = p1 - p0
    if n == 0:
        return np.zeros(0, np.int64), np.zeros((0, 4), np.uint8)
    try:
        at = _positions_of(p, lo, hi, pieces[0], pieces[1], ws)
        if at is None:
            return None
        # each symbol byte (two pairs) to both pairs' differences and raw marks at once
        sym = pieces[2]
        first = p0 % 2
        if len(sym) != (first + n + 1) // 2:
            return None
        diffs = ws.lookup(p.byte_diffs, sym, ws.get("dec.d", len(sym), np.uint64)).view(np.uint32)
        marks = ws.lookup(p.byte_raws, sym, ws.get("dec.r", len(sym), np.uint64))
        # escapes: the symbols 15 (few), their k from the escape stream
        found = ws.mask("dec.em", 2 * len(sym))
        np.equal(np.bitwise_and(sym, np.uint8(0x0F), out=ws.get("dec.lo", len(sym), np.uint8)), ESCAPE,
                 out=found[0 : 2 * len(sym) : 2])  # fmt: skip
        np.greater_equal(sym, np.uint8(ESCAPE << 4), out=found[1 : 2 * len(sym) : 2])
        escaped = nonzero(found, ws, "dec.esc")
        escaped = escaped[(escaped >= first) & (escaped < first + n)]  # (half bytes of other chunks)
        k = pieces[3]
        if len(escaped) != len(k) or np.any(k == SAME):
            return None
        diffs[escaped] = _KDIFF[k]
        marks.view(np.uint32)[escaped] = _KRAW[k]
        # the bytes coded 3 (in pair, then byte order) take the raw stream's bytes
        raw_at = nonzero(marks.view(bool), ws, "dec.raw") - 4 * first
        raw_at = raw_at[(raw_at >= 0) & (raw_at < 4 * n)]
        if len(raw_at) != len(pieces[4]):
            return None
        out = diffs[first : first + n].view(np.uint8)
        out[raw_at] = pieces[4]
    except (ValueError, IndexError):
        return None
    return at, out.reshape(n, 4)


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
    "Workspace",
    "decode",
    "encode",
    "encode_slots",
    "geometry",
    "load_encoder",
    "nonzero",
    "parse",
    "parse_buffer",
    "ranges",
    "table_rows",
    "table_bytes",
    "write",
]
