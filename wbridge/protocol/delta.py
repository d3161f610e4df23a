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
    digest   2 x uint64 at 144 its algorithm (``checksum.ALGOS``: 1 + the index) and value
    tables   uint32[3][nchunks + 1] at ``HEADER_BYTES``: per chunk the first pair, escape and raw
             byte of that chunk (cumulative counts; the last entry is the total)
    streams  high bits, low fields, 4-bit symbols, escapes, raw bytes (bits little-endian in bytes)

A chunk is ``CHUNK_PAIRS`` pairs of the slot. The tables give every stream's bytes of any run of
chunks, so a reader reads the streams of just the chunks its own reads cover (``ranges``) and
decodes them alone (``decode``): nothing of other readers' changes. The header says
``DELTA_WRITING`` while the buffer is rewritten and ``DELTA_NONE`` where the version has no delta;
a reader of some chunks reads it before and after the streams (a seqlock). The **digest** hashes
the whole delta (header words 4 on, dictionary, digest algorithm, tables, streams) seeded with
``v``, and is written last before the state: a reader of the whole delta in one read checks it
instead (``intact``). A read that a rewrite tore (a new version's bytes in part, whatever the order
the transport moved them in) fails it, so one read suffices. Pairs are in the byte order of ``v``'s
slot (its packing generation's layout); a slot's last pair may be short (padded with bytes that
never change).

The codec runs as compiled loops (``_delta_kernels``, numba, imported on the first encode or
decode only). The encoder (``encode_slots`` from two slots on the host, ``encode`` from changed
pairs found elsewhere): one streaming pass over the slots that finds and codes the changed pairs
(their indices, ``k`` and raw bytes), then passes over their ``k`` alone; the dictionary counts
the ``k`` of up to 65536 of the changed pairs. The reader: ``parse`` and ``ranges`` (compiled, a
call per delta), then ``decode`` (a run's pairs) or ``changes`` (its changed bytes), one pass over
the run's streams each; a delta read whole and checked by its digest, all three in one call
(``decode_whole``). The tests hold an independent numpy codec to compare with
(``tests/delta_reference.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from . import checksum as _checksum

PAIR = 4  # bytes per pair
CHUNK_PAIRS = 8192  # pairs per chunk (32 KiB of slot): >= 2 ** MAX_LOW_BITS, a multiple of 64
CHUNK_BYTES = PAIR * CHUNK_PAIRS
MAX_LOW_BITS = 13
GROUP = 8  # low fields are packed this many at a time (``low_bits`` bytes a group)
HEADER_BYTES = 160  # 16 x uint64, the dictionary, the digest
DICT_AT, DICT_SIZE = 128, 15
DIGEST_ALGO, DIGEST = 18, 19  # header uint64 fields: the digest's algorithm (1 + ``checksum.ALGOS`` index), value
ESCAPE = DICT_SIZE  # the symbol whose ``k`` is in the escape stream
DELTA_MAGIC = 0x574244454C544134  # "WBDELTA4"
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


class Workspace:
    """Arrays reused from one call to the next, grown and never shrunk: a fresh multi-megabyte
    temporary costs its page faults each time, which on a virtual machine cost more than the
    arithmetic on it (3 ms for one 4 MB temporary here). What ``encode`` and ``decode`` return may
    be views of these arrays, valid until the workspace's next call."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._last: dict[str, tuple[int, object, np.ndarray]] = {}  # name -> the last call's n, dtype, view

    def get(self, name: str, n: int, dtype: type | np.dtype) -> np.ndarray:
        """``n`` elements of ``dtype`` under ``name``, undefined."""
        last = self._last.get(name)
        if last is not None and last[0] == n and last[1] is dtype:  # (as last time: the view made then)
            return last[2]
        size = n * np.dtype(dtype).itemsize
        a = self._arrays.get(name)
        if a is None or len(a) < size:
            a = self._arrays[name] = np.empty(max(4096, size + size // 4), np.uint8)
        view = a[:size].view(dtype)
        self._last[name] = (n, dtype, view)
        return view


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


def low_bits_for(changed: int, pairs: int, slack: float = 1.0) -> int:
    """The Elias-Fano low width that makes ``high`` and ``low`` smallest, in bits (exact sizes;
    whole groups of low fields), or 0 where a bitmap of the slot's pairs is at most ``slack``
    times that."""
    groups = -(-changed // GROUP)
    size, best = min((-(-pairs // (1 << lb)) + changed + 8 * groups * lb, lb) for lb in range(1, MAX_LOW_BITS + 1))
    return 0 if pairs <= slack * size else best


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
    changed pairs and codes them (their bitmap, indices, ``k`` and raw bytes: as it goes, or with
    AVX2 alone from the changed pairs after it), then the symbols and positions are coded from
    those pairs alone (``_delta_kernels``). None where more than ``most`` pairs changed. Its
    streams may be views of ``ws``: write them (``write``) before ``ws`` is used again."""
    from . import _delta_kernels as kernels

    ws = ws or Workspace()
    size, pairs = geo.slot_bytes, geo.pairs
    whole = size // PAIR * PAIR
    tail_a = np.uint64(int.from_bytes(prev[whole:size].tobytes(), "little"))  # (the short last pair, padded)
    tail_b = np.uint64(int.from_bytes(cur[whole:size].tobytes(), "little"))
    at = ws.get("enc.at", pairs, _index_dtype(pairs))
    ks = ws.get("enc.k", pairs, np.uint8)
    raw = ws.get("enc.raw", PAIR * pairs + 64, np.uint8)
    diffs = ws.get("enc.diffs", pairs if kernels.PERMUTE else 0, np.uint32)
    bitmap = ws.get("enc.bitmap", -(-pairs // 64), np.uint64)
    tables = np.zeros((3, geo.nchunks + 1), np.uint32)
    a, b, tail = prev[:whole].view(np.uint32), cur[:whole].view(np.uint32), int(whole < size)
    ptab, rtab = tables[0], tables[2]
    n = kernels.scan(a, b, tail_a, tail_b, tail, most, CHUNK_PAIRS // 64, bitmap, at, ks, diffs, raw, ptab, rtab)
    if n < 0:
        return None
    lb, dictionary, high, low, sym, esc = _streams(n, geo, ws, bitmap.view(np.uint8)[: -(-pairs // 8)])
    ne = kernels.finish(
        at[:n], ks[:n], lb, max(1, n // 65536), SAME, ESCAPE, dictionary, tables, sym, esc, high, low, False
    )
    return Encoded(lb, dictionary, tables, (high, low, sym, esc[:ne], raw[: tables[2, -1]]))


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
    n = len(at)
    lb, dictionary, high, low, sym, esc = _streams(n, geo, ws, None)
    ks, raw = ws.get("enc.k", n, np.uint8), ws.get("enc.raw", PAIR * n + 32, np.uint8)
    step = max(1, n // 65536)
    ne, nraw = kernels.code(at, values, lb, step, SAME, ESCAPE, ks, dictionary, tables, sym, esc, raw, high, low)
    return Encoded(lb, dictionary, tables, (high, low, sym, esc[:ne], raw[:nraw]))


def _streams(
    n: int, geo: Geometry, ws: Workspace, bitmap: np.ndarray | None
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The low width of a delta of ``n`` changed pairs of ``geo``'s slot, and room for its
    dictionary and streams: ``(low_bits, dictionary, high, low, sym, esc)``; ``high`` is
    ``bitmap`` (the scan's) where positions are a bitmap and the scan made one."""
    pairs = geo.pairs
    lb = low_bits_for(n, pairs, BITMAP_SLACK)
    if lb == 0:
        high = bitmap if bitmap is not None else ws.get("enc.high", -(-pairs // 8), np.uint8)
        low = ws.get("enc.low", 0, np.uint8)
    else:
        high = ws.get("enc.high", -(-(-(-pairs // (1 << lb)) + n) // 8), np.uint8)
        low = ws.get("enc.low", -(-n // GROUP) * lb, np.uint8)
    sym, esc = ws.get("enc.sym", (n + 1) // 2, np.uint8), ws.get("enc.esc", n, np.uint8)
    return lb, np.zeros(16, np.uint8), high, low, sym, esc


def write(buf: np.ndarray, e: Encoded) -> int:
    """Writes ``e``'s dictionary, tables and streams into ``buf`` (a delta buffer, uint8), its
    counts and offsets into the header, and then the digest (``digest``: the caller wrote the
    header's first eight words before); the caller writes the header's state last. Returns the
    bytes written from the buffer's start (``extent``)."""
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
    head[DIGEST_ALGO] = _DIGEST_ALGO
    head[DIGEST] = digest(buf[:at])  # (last: over every byte above)
    return at


_DIGEST_ALGO = _checksum.ALGOS.index(_checksum.ALGO) + 1  # (this process's algorithm, as a header names it)


def digest(delta: np.ndarray) -> int:
    """The digest of ``delta`` (a delta buffer's bytes up to its extent, uint8) by this process's
    algorithm: header words 4 on, the dictionary, the digest's algorithm field, the tables and
    streams, seeded with the header's ``v`` (words 0-3 are the magic, ``v``, ``v - 1`` and the
    state, which a reader checks as they are)."""
    v = int(delta[8 * VERSION : 8 * VERSION + 8].view(np.uint64)[0])
    head = _checksum.hash_seeded(delta[32 : 8 * DIGEST], v)
    return _checksum.hash_seeded(delta[HEADER_BYTES:], head)


def intact(delta: np.ndarray) -> bool | None:
    """Whether ``delta`` (as read whole, up to the extent its version record gave) is the delta its
    publisher wrote: its digest matches; None where the publisher's algorithm is not this process's
    (the reader checks the headers again instead)."""
    head = delta[:HEADER_BYTES].view(np.uint64)
    if int(head[DIGEST_ALGO]) != _DIGEST_ALGO:
        return None
    return int(head[DIGEST]) == digest(delta)


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
    from . import _delta_kernels as kernels

    head = header[:HEADER_BYTES].view(np.uint64)
    lb = int(head[LOW_BITS])
    totals = head[[PAIRS, ESCAPES, RAWS]].astype(np.int64)
    dictionary = header[DICT_AT : DICT_AT + 16].copy()
    if lb > MAX_LOW_BITS or len(entries) % 4 or SAME in dictionary[:DICT_SIZE]:  # (no changed pair has SAME)
        return None
    tables = np.full((3, nchunks + 1), -1, dtype=np.int64)
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    if not kernels.tables(entries.view(np.uint32), lo, hi, nchunks, totals, tables):
        return None
    return Parsed(lb, pairs, dictionary, tables, head[OFFSETS : OFFSETS + 5].astype(np.int64))


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
    from . import _delta_kernels as kernels

    first, length = np.empty((len(lo), 5), np.int64), np.empty((len(lo), 5), np.int64)
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    kernels.stream_ranges(p.tables, lo, hi, p.low_bits, p.pairs, p.offsets, CHUNK_PAIRS, GROUP, first, length)
    return first, length


def decode(
    p: Parsed, lo: int, hi: int, pieces: list[np.ndarray], ws: Workspace | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """The changed pairs of chunks ``lo..hi`` from their stream ``pieces`` (uint8, as ``ranges``
    cut them): ``(pair indices ascending, byte differences [n, 4] uint8)``, views of ``ws`` (valid
    until its next use); None where malformed."""
    from . import _delta_kernels as kernels

    ws = ws or Workspace()
    p0, p1 = int(p.tables[0, lo]), int(p.tables[0, hi + 1])
    n = p1 - p0
    at, diffs = ws.get("dec.at", n, np.int64), ws.get("dec.d", n, np.uint32)
    if n and not _decoded(kernels, p, lo, hi, pieces, at, diffs):
        return None
    return at, diffs.view(np.uint8).reshape(n, PAIR)


def decode_into(p: Parsed, lo: int, hi: int, pieces: list[np.ndarray], at: np.ndarray, diffs: np.ndarray) -> bool:
    """``decode`` into the caller's ``at`` (int64) and ``diffs`` (uint32), exactly as long as the
    run's changed pairs (ValueError where not); False where malformed."""
    from . import _delta_kernels as kernels

    n = int(p.tables[0, hi + 1] - p.tables[0, lo])
    if len(at) != n or len(diffs) != n or at.dtype != np.int64 or diffs.dtype != np.uint32:
        raise ValueError(f"room for {len(at)} pairs ({at.dtype}) and {len(diffs)} ({diffs.dtype}), not {n}")
    return not n or _decoded(kernels, p, lo, hi, pieces, at, diffs)


_WHOLE_FIELDS = np.array([LOW_BITS, PAIRS, ESCAPES, RAWS, OFFSETS], dtype=np.int64)  # (``decode_whole``'s)


def decode_whole(delta: np.ndarray, nchunks: int, pairs: int, at: np.ndarray, diffs: np.ndarray, ws: Workspace) -> bool:
    """``parse``, ``ranges`` and ``decode`` of a delta read whole (``delta``: its bytes up to its
    extent, uint8; of a slot of ``pairs`` pairs in ``nchunks`` chunks) in one compiled call: its
    changed pairs into ``at`` (int64) and ``diffs`` (uint32), which hold exactly as many as its
    header says (``pairs_of``); False where it is malformed (what ``parse``, ``ranges`` and
    ``decode`` refuse). The tables go to ``ws``."""
    from . import _delta_kernels as kernels

    if len(delta) < table_bytes(nchunks):
        return False
    head = delta[:HEADER_BYTES].view(np.uint64)
    entries = delta[HEADER_BYTES : HEADER_BYTES + 12 * (nchunks + 1)].view(np.uint32)
    t = ws.get("whole.t", 3 * (nchunks + 1), np.int64).reshape(3, nchunks + 1)
    return kernels.decode_whole(
        delta, head, entries, _WHOLE_FIELDS, nchunks, pairs, CHUNK_PAIRS, GROUP, MAX_LOW_BITS, DICT_AT, ESCAPE, SAME,
        _KDIFF, t, at, diffs,
    )  # fmt: skip


def pairs_of(delta: np.ndarray) -> int:
    """The changed pairs a delta's header says it holds (``delta``: at least its header)."""
    return int(delta[8 * PAIRS : 8 * PAIRS + 8].view(np.uint64)[0])


def add_pairs(at: np.ndarray, diffs: np.ndarray, soff: np.ndarray, end: np.ndarray, addr: np.ndarray) -> None:
    """Adds the byte differences ``diffs`` (uint32) of the changed pairs ``at`` (int64, ascending)
    into host memory, compiled: the reads ``soff[r] .. end[r] - 1`` of the slot (int64, ascending,
    disjoint) land at addresses ``addr[r]``, which the caller checked to be its own for as many
    bytes; a byte no read covers is skipped."""
    from . import _delta_kernels as kernels

    kernels.add_pairs(at, diffs, soff, end, addr)


def changes(
    p: Parsed, lo: int, hi: int, pieces: list[np.ndarray], offsets: np.ndarray, values: np.ndarray, ws: Workspace
) -> int | None:
    """The bytes that changed in chunks ``lo..hi`` (``decode``'s pairs, byte by byte): their slot
    offsets (ascending) into ``offsets`` (int64) and differences into ``values`` (uint8, none 0),
    each with room for ``PAIR`` per changed pair (ValueError where not: the compiled loop writes
    unchecked); how many, or None where malformed."""
    n = int(p.tables[0, hi + 1] - p.tables[0, lo])
    _room(n, offsets, values)
    got = decode(p, lo, hi, pieces, ws)
    if got is None:
        return None
    return changed_bytes(got[0], got[1].reshape(-1).view(np.uint32), offsets, values)


def changed_bytes(at: np.ndarray, diffs: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> int:
    """The bytes that changed of the pairs ``at`` (int64, ascending) with byte differences
    ``diffs`` (uint32), compiled: their slot offsets (ascending) into ``offsets`` (int64) and
    differences into ``values`` (uint8, none 0), each with room for ``PAIR`` per pair (ValueError
    where not); how many."""
    from . import _delta_kernels as kernels

    _room(len(at), offsets, values)
    return kernels.changed_bytes(at, diffs, offsets, values)


def _room(n: int, offsets: np.ndarray, values: np.ndarray) -> None:
    """ValueError where ``offsets`` or ``values`` hold fewer than the changed bytes of ``n`` pairs
    (the compiled loop writes unchecked)."""
    if min(len(offsets), len(values)) < PAIR * n:
        raise ValueError(f"room for {min(len(offsets), len(values))} changed bytes, not the {PAIR * n} of {n} pairs")


def _decoded(
    kernels: ModuleType, p: Parsed, lo: int, hi: int, pieces: list[np.ndarray], at: np.ndarray, diffs: np.ndarray
) -> bool:
    p0 = int(p.tables[0, lo])
    first, end = lo * CHUNK_PAIRS, min((hi + 1) * CHUNK_PAIRS, p.pairs)
    high, low, sym, esc, raw = (np.ascontiguousarray(x, dtype=np.uint8) for x in pieces)
    return kernels.decode(
        high, low, sym, esc, raw, p.low_bits, p0, first, end, p.dictionary, ESCAPE, SAME, _KDIFF, at, diffs
    )


def add(dst: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> bool:
    """``dst[offsets] += values`` (uint8, mod 256; ``offsets`` int64, in any order), compiled;
    False, writing nothing, where an offset is outside ``dst`` (ValueError where ``values`` is not
    as long as ``offsets``)."""
    from . import _delta_kernels as kernels

    if len(values) != len(offsets):
        raise ValueError(f"{len(values)} values for {len(offsets)} offsets")
    return kernels.add_at(dst, offsets, values)


def load_decoder() -> None:
    """Loads the compiled decoder now (numba's start-up and the kernels' machine code, from its cache
    or compiled), so that the first delta pull does not pay it: about 0.3 s of CPU once per
    process. (Empty inputs of the types a pull passes: each kernel loads for those.)"""
    from . import _delta_kernels as kernels

    none, pairs, offsets = np.zeros(0, np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64)
    diffs = np.zeros(0, np.uint32)
    kernels.decode(none, none, none, none, none, 0, 0, 0, 0, np.zeros(16, np.uint8), ESCAPE, SAME, _KDIFF, pairs, diffs)
    kernels.changed_bytes(pairs, diffs, offsets, none)
    kernels.add_at(np.zeros(1, np.uint8), offsets, none)
    kernels.add_pairs(pairs, diffs, offsets, offsets, offsets)
    decode_whole(np.zeros(HEADER_BYTES + 24, np.uint8), 1, 1, pairs, diffs, Workspace())
    two = np.zeros((3, 2), np.int64)
    kernels.tables(np.zeros(6, np.uint32), np.zeros(1, np.int64), np.zeros(1, np.int64), 1, np.zeros(3, np.int64), two)
    p = Parsed(1, 1, np.zeros(16, np.uint8), two, np.zeros(5, np.int64))
    ranges(p, np.zeros(1, np.int64), np.zeros(1, np.int64))


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
    "add",
    "add_pairs",
    "changed_bytes",
    "changes",
    "decode",
    "decode_into",
    "decode_whole",
    "digest",
    "encode",
    "encode_slots",
    "geometry",
    "intact",
    "load_decoder",
    "load_encoder",
    "parse",
    "pairs_of",
    "parse_buffer",
    "ranges",
    "table_rows",
    "table_bytes",
    "write",
]
