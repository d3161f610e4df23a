"""An independent reference encoder of the delta format (``wbridge.protocol.delta``): the
vectorised numpy encoder the library had before its compiled one (``protocol._delta_kernels``).
The tests decode what each writes and compare. Its dictionary comes from a sample of a few
thousand changed pairs (the library's from up to 65536), so the two may pick different
dictionaries; the format does not care, the decoder reads it from the buffer."""

from __future__ import annotations

import numpy as np

from wbridge.protocol.delta import (
    BITMAP_SLACK,
    CHUNK_PAIRS,
    DICT_SIZE,
    ESCAPE,
    GROUP,
    SAME,
    Encoded,
    Geometry,
    Workspace,
    low_bits_for,
    nonzero,
)

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
