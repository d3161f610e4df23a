"""An independent reference codec of the delta format (``wbridge.protocol.delta``): the vectorised
numpy encoder and decoder the library had before its compiled ones (``protocol._delta_kernels``).
The tests decode what each encoder writes with each decoder and compare. The reference
encoder's dictionary comes from a sample of a few thousand changed pairs (the library's from up
to 65536), so the two may pick different dictionaries; the format does not care, the decoders
read it from the buffer."""

from __future__ import annotations

import numpy as np

from wbridge.protocol import delta as _format
from wbridge.protocol.delta import (
    BITMAP_SLACK,
    CHUNK_PAIRS,
    DICT_SIZE,
    ESCAPE,
    GROUP,
    SAME,
    Encoded,
    Geometry,
    Parsed,
    low_bits_for,
)

_KDIFF = _format._KDIFF  # k -> its four byte differences as a little-endian uint32 (raw bytes 0)
_KRAW = np.array(  # k -> a 1 in each byte coded 3 (raw), as a little-endian uint32
    [sum(int((k >> (2 * j)) & 3 == 3) << (8 * j) for j in range(4)) for k in range(256)], dtype=np.uint32
)


class Workspace(_format.Workspace):
    """The library's workspace, and the whole-array helpers the numpy codec needs."""

    def mask(self, name: str, n: int) -> np.ndarray:
        """A bool array of ``n`` elements and False after them up to a multiple of 8 (what
        ``nonzero`` takes): the caller fills ``[:n]``."""
        m = self.get(name, -(-n // 8) * 8, bool)
        m[n:] = False
        return m

    def lookup(self, table: np.ndarray, index: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out[:] = table[index]`` for small unsigned ``index`` (widened into a reused array:
        numpy's take would convert them to a fresh one)."""
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
    long: ``Workspace.mask``): the 8-element groups holding one found first where they are few."""
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


_NIBBLE_ONES = np.uint64(0x1111111111111111)
_SPREAD = np.uint32(0x41041)  # four 2-bit fields at bits 0, 8, 16, 24 -> one byte at bit 18


def pack_bits(values: np.ndarray, width: int, ws: Workspace | None = None) -> np.ndarray:
    """``values`` (non-negative int64, each < 2**width, width <= 16) as ``width``-bit fields,
    little-endian, in whole groups of ``GROUP`` fields (``width`` bytes each, the last padded with
    zero fields): neighbouring fields merged into one word, then neighbouring words, three times
    (a few whole-array operations, none per field)."""
    ws = ws or Workspace()
    n = len(values)
    if width == 0 or not n:
        return np.zeros(0, np.uint8)
    m = -(-n // GROUP)
    small = width in (1, 2, 4, 8)  # (a group's fields fit in a byte per field's width: bytes throughout)
    v = ws.get("pack.v", GROUP * m, np.uint8 if small else np.uint32)
    np.copyto(v[:n], values, casting="unsafe")
    v[n:] = 0
    if small:
        for level in (1, 2, 4):
            if level * width >= 8:
                break
            merged = np.left_shift(v[1::2], np.uint8(level * width), out=ws.get(f"pack.{level}", len(v) // 2, np.uint8))
            v = np.bitwise_or(merged, v[0::2], out=merged)
        return v
    two = np.left_shift(v[1::2], np.uint32(width), out=ws.get("pack.2", 4 * m, np.uint32))
    np.bitwise_or(two, v[0::2], out=two)  # 2 fields (<= 32 bits)
    four = ws.get("pack.4", 2 * m, np.uint64)
    np.copyto(four, two[1::2])
    np.left_shift(four, np.uint64(2 * width), out=four)
    np.bitwise_or(four, two[0::2], out=four)  # 4 fields (<= 64 bits)
    words = ws.get("pack.w", 2 * m, np.uint64).reshape(m, 2)  # a group's low and high 64 bits
    np.left_shift(four[1::2], np.uint64(4 * width), out=words[:, 0])  # (bits past 64 fall off)
    np.bitwise_or(words[:, 0], four[0::2], out=words[:, 0])
    if width > 8:  # the fields' bits past 64
        np.right_shift(four[1::2], np.uint64(64 - 4 * width), out=words[:, 1])
    out = ws.get("pack.out", m * width, np.uint8).reshape(m, width)
    out[:] = words.view(np.uint8).reshape(m, 16)[:, :width]
    return out.reshape(-1)


def _dictionary(x: np.ndarray) -> np.ndarray:
    """The 15 most frequent ``k`` of the coded pairs ``x`` (``k`` at bit 18; a sample of a few
    thousand decides), as the delta's dictionary (uint8[16], the last unused)."""
    step = max(1, len(x) // 8192)
    sample = np.right_shift(x[::step], np.uint32(18)) & np.uint32(0xFF)
    counts = np.bincount(sample, minlength=256)
    counts[SAME] = -1  # (no changed pair has it)
    dictionary = np.zeros(16, np.uint8)
    dictionary[:DICT_SIZE] = np.argsort(-counts, kind="stable")[:DICT_SIZE]
    return dictionary


def _positions(pairs_at: np.ndarray, lb: int, pairs: int, bitmap: np.ndarray | None, ws: Workspace) -> tuple:
    """The ``high`` and ``low`` streams of the changed pairs ``pairs_at`` of a slot of ``pairs``
    pairs at low width ``lb`` (0: a bitmap, ``bitmap`` where the scan made one)."""
    n = len(pairs_at)
    if lb == 0:
        if bitmap is None:
            mask = ws.mask("enc.bitmap", pairs)
            mask[:pairs] = False
            mask[pairs_at] = True
            bitmap = np.packbits(mask[:pairs], bitorder="little")
        return bitmap, np.zeros(0, np.uint8)
    buckets = -(-pairs // (1 << lb))
    high_bits = ws.get("enc.high", buckets + n, bool)
    high_bits.fill(False)
    q = np.right_shift(pairs_at, lb, out=ws.get("enc.q", n, np.int64))
    high_bits[np.add(q, ws.arange(n), out=q)] = True
    high = np.packbits(high_bits, bitorder="little")
    return high, pack_bits(np.bitwise_and(pairs_at, (1 << lb) - 1, out=q), lb, ws)


def _escapes(sym: np.ndarray, ws: Workspace) -> np.ndarray:
    """The ranks of the pairs whose symbol is ``ESCAPE`` (few), ascending, from the symbol bytes
    ``sym`` (two a byte, zero-padded to a multiple of 8): nibbles of all ones found eight bytes
    at a time, then only the words holding one looked at."""
    words = sym.view(np.uint64)
    t = np.right_shift(words, np.uint64(1), out=ws.get("esc.t", len(words), np.uint64))
    np.bitwise_and(t, words, out=t)
    u = np.right_shift(t, np.uint64(2), out=ws.get("esc.u", len(words), np.uint64))
    np.bitwise_and(t, u, out=t)
    np.bitwise_and(t, _NIBBLE_ONES, out=t)  # bit 4j: nibble j is 15
    hit = np.flatnonzero(np.not_equal(t, 0, out=ws.get("esc.hit", len(t), bool)))
    bits = np.flatnonzero(np.unpackbits(np.take(t, hit).view(np.uint8), bitorder="little").view(bool))
    return np.take(hit, bits >> 6) * 16 + ((bits & 63) >> 2)


def encode(
    pairs_at: np.ndarray,
    diffs: np.ndarray,
    geo: Geometry,
    ws: Workspace | None = None,
    bitmap: np.ndarray | None = None,
) -> Encoded:
    """Codes the changed pairs ``pairs_at`` (ascending pair indices, int64) whose byte differences
    are the rows of ``diffs`` (uint8 ``[n, 4]``, no row all zero), for a slot of ``geo``; ``bitmap``
    (a bit per pair of the slot, set where it changed, as the scan made it) saves remaking it.
    Its streams may be views of ``ws``: write them (``write``) before ``ws`` is used again."""
    ws = ws or Workspace()
    n = len(pairs_at)
    d = np.ascontiguousarray(diffs).reshape(-1)
    # each byte's 2-bit code, and each pair's four of them as one byte k (at bit 18 of x)
    c = np.add(d, np.uint8(1), out=ws.get("enc.c", 4 * n, np.uint8))
    np.minimum(c, np.uint8(3), out=c)
    half = (n + 1) // 2
    x = ws.get("enc.x", 2 * half, np.uint32)
    np.multiply(c.view(np.uint32), _SPREAD, out=x[:n])
    dictionary = _dictionary(x[:n])
    lut = np.full(256, ESCAPE, np.uint8)
    lut[dictionary[:DICT_SIZE]] = np.arange(DICT_SIZE, dtype=np.uint8)
    if n % 2:
        x[n] = np.uint32(int(dictionary[0]) << 18)  # (the last half byte: symbol 0)
    # two pairs' symbols per byte: one lookup of both k (a 64 Ki-entry table) per byte
    both = (lut[None, :] | (lut[:, None] << np.uint8(4))).reshape(-1)
    y = x[: 2 * half].view(np.uint64)
    idx = np.right_shift(y, np.uint64(18), out=ws.get("enc.i", half, np.uint64))
    np.bitwise_and(idx, np.uint64(0xFF), out=idx)
    hi = np.right_shift(y, np.uint64(42), out=ws.get("enc.h", half, np.uint64))
    np.bitwise_and(hi, np.uint64(0xFF00), out=hi)
    np.bitwise_or(idx, hi, out=idx)
    padded = ws.get("enc.sym", -(-half // 8) * 8, np.uint8)
    padded[half:] = 0
    sym = np.take(both, idx.view(np.int64), out=padded[:half], mode="clip")
    escaped = _escapes(padded, ws)
    esc = (np.right_shift(np.take(x, escaped), np.uint32(18)) & np.uint32(0xFF)).astype(np.uint8)
    # raw bytes: the differences of bytes coded 3, in pair then byte order
    is_raw = ws.mask("enc.rm", 4 * n)
    np.equal(c, 3, out=is_raw[: 4 * n])
    raw_at = nonzero(is_raw, ws, "enc.raw")
    raw = np.take(d, raw_at)
    # tables: cumulative counts at chunk starts
    lb = low_bits_for(n, geo.pairs, BITMAP_SLACK if bitmap is not None else 1.0)
    starts = np.searchsorted(pairs_at, np.arange(geo.nchunks + 1, dtype=np.int64) * CHUNK_PAIRS)
    tables = np.stack([starts, np.searchsorted(escaped, starts), np.searchsorted(raw_at >> 2, starts)])
    high, low_fields = _positions(pairs_at, lb, geo.pairs, bitmap, ws)
    return Encoded(lb, dictionary, tables.astype(np.uint32), (high, low_fields, sym, esc, raw))


def unpack_bits(data: np.ndarray, skip: int, count: int, width: int) -> np.ndarray:
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


def _symbol_tables(dictionary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per byte of the symbol stream (two pairs), the two pairs' byte differences (raw bytes 0)
    and a 1 in each raw-coded byte, as uint64; the escape symbol's are 0 (the escape stream fills
    them in)."""
    k = dictionary[:DICT_SIZE].astype(np.intp)
    diff = np.zeros(16, np.uint64)
    raws = np.zeros(16, np.uint64)
    diff[:DICT_SIZE], raws[:DICT_SIZE] = _KDIFF[k], _KRAW[k]
    lo, hi = np.arange(256) & 15, np.arange(256) >> 4
    return diff[lo] | (diff[hi] << np.uint64(32)), raws[lo] | (raws[hi] << np.uint64(32))


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
        np.bitwise_or(at, unpack_bits(low, p0 % GROUP, n, lb), out=at)
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
        byte_diffs, byte_raws = _symbol_tables(p.dictionary)
        diffs = ws.lookup(byte_diffs, sym, ws.get("dec.d", len(sym), np.uint64)).view(np.uint32)
        marks = ws.lookup(byte_raws, sym, ws.get("dec.r", len(sym), np.uint64))
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
