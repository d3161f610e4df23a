"""The delta encoder's loops, compiled with numba (``wbridge.protocol.delta`` says the format, and
imports this module only where it encodes: a process that never encodes a delta never imports
numba).

- ``scan``: one streaming pass over two slots (as 32-bit pairs): 64 pairs compared into a mask
  word (the positions bitmap's word) and their differences computed, then only its set bits
  walked, each changed pair's index and byte differences appended; the pair table noted at each
  chunk start.
- ``code``: passes over the changed pairs alone (the scan's, or what a GPU scan found): ``codes``
  (each pair's ``k``), ``count`` (a sample's ``k``, for the dictionary), ``symbols`` (4-bit
  symbols, escapes, the escape table), ``raws`` (the raw stream and table: only the pairs with a
  raw byte visited) and ``positions`` (Elias-Fano ``high`` and ``low``, or a bitmap where the
  scan made none).

Each loop is branch-light: masks of 64 pairs computed without branches (vectorised by the
compiler), then a walk of their set bits; the rare cases (escapes) behind a branch.

``scan`` and ``code`` are compiled on first use (the steps compiled into ``code``) and cached
next to this file (``__pycache__/numba-<version>``), so a later process loads the machine code
instead of compiling. Where that directory cannot be written numba's own fallbacks apply
(``__pycache__``, then a per-user cache directory); where no cache directory can be written at
all, the kernels compile in each process, silently (``_jit``).
"""

from __future__ import annotations

import os

import numpy as np
from numba import __version__, njit
from numba.core import config
from numba.cpython.unsafe.numbers import trailing_zeros

_U0, _U1 = np.uint64(0), np.uint64(1)
_FF = np.uint64(0xFF)
_H = np.uint64(0x80808080)  # the top bit of each of a pair's bytes
_L7 = np.uint64(0x7F7F7F7F)
_ONES = np.uint64(0x01010101)
_LOW2 = np.uint64(0x03030303)
_SEVEN_D = np.uint64(0x7D7D7D7D)
_SPREAD = np.uint64(0x41041)  # four 2-bit fields at bits 0, 8, 16, 24 -> one byte at bit 18


def _jit(f):
    """``numba.njit(cache=True, nogil=True)``, cached in ``__pycache__/numba-<version>`` (the venvs
    of one checkout hold different numba versions: in one directory each would overwrite the
    others' cache index), unless ``NUMBA_CACHE_DIR`` says where; or without the cache where numba
    finds no directory it can write one to (it raises then, at decoration)."""
    chosen = config.CACHE_DIR
    if not chosen:  # (numba reads it when it decorates: set for these kernels alone)
        config.CACHE_DIR = os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "__pycache__", f"numba-{__version__}"
        )
    try:
        return njit(cache=True, nogil=True, error_model="numpy")(f)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(nogil=True, error_model="numpy")(f)
    finally:
        config.CACHE_DIR = chosen


_inner = njit(nogil=True, error_model="numpy")  # a step of a cached kernel: compiled into it


@njit(inline="always")
def _diff(x, y):
    """The byte differences ``y - x`` (mod 256 each) of two pairs (uint64 holding 32 bits)."""
    return (((y | _H) - (x & _L7)) ^ ((y ^ ~x) & _H)) & np.uint64(0xFFFFFFFF)


@njit(inline="always")
def _code(d):
    """A pair's byte differences ``d`` (uint64) as ``(k, r)``: its ``k`` (four 2-bit codes
    ``min(d + 1, 3)``) and a 1 in each byte coded 3 (raw)."""
    e = ((d & _L7) + _ONES) ^ (d & _H)  # byte-wise d + 1
    r = ((((e & _L7) + _SEVEN_D) | e) & _H) >> np.uint64(7)  # 1 where e >= 3
    c = (e & _LOW2) | (r * np.uint64(3))
    return ((c * _SPREAD) >> np.uint64(18)) & _FF, r


@_jit
def scan(a, b, tail_a, tail_b, has_tail, most, chunk_words, bitmap, at, diffs, ptab):
    """Compares the slots ``a`` and ``b`` (uint32 pairs), and a short last pair (``tail_a``,
    ``tail_b``: uint64, padded; ``has_tail``) after them: writes the bitmap of changed pairs
    (``bitmap``, uint64 words, zero past the last pair), each changed pair's index (``at``) and
    byte differences (``diffs``, uint32), and at each chunk start (every ``chunk_words`` words)
    the changed pairs before it (``ptab``: one entry per chunk, then the total). 64 pairs are
    compared into a mask word (their differences computed alongside, without a branch), then only
    its set bits are walked. Returns the changed pairs, or -1 as soon as a chunk start finds more
    than ``most``. ``at`` and ``diffs`` hold room for every pair."""
    full = a.shape[0]
    pairs = full + has_tail
    n = 0
    whole = full // 64
    word = np.empty(64, np.uint32)  # a word's pairs' byte differences
    for w in range(whole):
        base = w * 64
        if w % chunk_words == 0:
            if n > most:
                return -1
            ptab[w // chunk_words] = n
        m = _U0
        for j in range(64):  # (no branch: vectorised)
            x, y = np.uint64(a[base + j]), np.uint64(b[base + j])
            word[j] = _diff(x, y)
            m |= np.uint64(x != y) << np.uint64(j)
        bitmap[w] = m
        while m:
            j = np.int64(trailing_zeros(m))
            m &= m - _U1
            at[n] = base + j
            diffs[n] = word[j]
            n += 1
    if pairs > whole * 64:  # the last, partial word (and the short last pair)
        base = whole * 64
        if whole % chunk_words == 0:
            ptab[whole // chunk_words] = n
        m = _U0
        for p in range(base, pairs):
            if p < full:
                x, y = np.uint64(a[p]), np.uint64(b[p])
            else:
                x, y = tail_a, tail_b
            if x != y:
                m |= _U1 << np.uint64(p - base)
                at[n] = p
                diffs[n] = _diff(x, y)
                n += 1
        bitmap[whole] = m
    if n > most:
        return -1
    ptab[len(ptab) - 1] = n
    return n


@_inner
def codes(diffs, ks):
    """Each pair's ``k`` (``ks``, uint8) from its byte differences ``diffs`` (a loop the compiler
    vectorises)."""
    for i in range(len(diffs)):
        ks[i] = _code(np.uint64(diffs[i]))[0]


@_inner
def count(ks, step, counts):
    """Adds every ``step``-th ``k`` of ``ks`` to ``counts``."""
    for i in range(0, len(ks), step):
        counts[ks[i]] += 1


@njit(inline="always")
def _note(table, ptab, c, i, value):
    """Fills ``table`` with ``value`` for the chunks from ``c`` whose first pair is at or before
    rank ``i``; the next chunk to fill."""
    while c < len(table) and ptab[c] <= i:
        table[c] = value
        c += 1
    return c


@_inner
def symbols(ks, both, escape, ptab, sym, esc, etab):
    """The changed pairs' symbols (``sym``: two a byte, the first in the low half; ``both``: two
    pairs' ``k`` as ``k0 | k1 << 8`` -> their symbol byte), escapes (symbol ``escape``; ``esc``:
    their ``k``) and
    escape table (``etab``: escapes before each chunk's first pair, ``ptab``). Returns the
    escapes."""
    n = len(ks)
    ne = 0
    c = 0
    for h in range((n + 1) // 2):
        k0 = ks[2 * h]
        k1 = ks[2 * h + 1] if 2 * h + 1 < n else ks[2 * h]
        s = both[np.int64(k0) | (np.int64(k1) << 8)]
        if 2 * h + 1 == n:  # (the last pair's symbol alone in its byte)
            s &= 15
        sym[h] = s
        if (s & 15) == escape or s >= escape << 4:  # (few)
            if (s & 15) == escape:
                c = _note(etab, ptab, c, 2 * h, ne)
                esc[ne] = k0
                ne += 1
            if s >= escape << 4:
                c = _note(etab, ptab, c, 2 * h + 1, ne)
                esc[ne] = k1
                ne += 1
    _note(etab, ptab, c, n, ne)
    return ne


@_inner
def raws(ks, diffs, ptab, raw, rtab):
    """The raw stream (the byte differences of bytes coded 3, pair then byte order) and table
    (``rtab``: raw bytes before each chunk's first pair, ``ptab``): 64 pairs' ``k`` tested into a
    mask word, then only the pairs with a raw byte visited. Returns the raw bytes; ``raw`` holds
    room for four more than that."""
    n = len(ks)
    o = 0
    c = 0
    for w in range((n + 63) // 64):
        base = w * 64
        m = _U0
        for j in range(min(64, n - base)):
            k = ks[base + j]
            m |= np.uint64((k & (k >> 1) & 0x55) != 0) << np.uint64(j)  # a code 3 in k
        while m:
            i = base + np.int64(trailing_zeros(m))
            m &= m - _U1
            c = _note(rtab, ptab, c, i, o)
            d = np.uint64(diffs[i])
            k = ks[i]
            for j in range(4):
                raw[o] = (d >> np.uint64(8 * j)) & _FF
                o += np.int64((k >> (2 * j)) & (k >> (2 * j + 1)) & 1)
    _note(rtab, ptab, c, n, o)
    return o


@_inner
def positions(at, lb, high, low, make_bitmap):
    """The positions of the changed pairs ``at``: where ``lb`` > 0 the Elias-Fano ``high`` (a one
    per pair and a zero closing each bucket of ``2**lb`` pairs) and ``low`` (fields of ``lb``
    bits, in whole groups of eight), else, where ``make_bitmap``, the bitmap of the slot's pairs
    into ``high``; both zeroed here first."""
    n = at.shape[0]
    if lb == 0:
        if make_bitmap:
            high[:] = 0
            for i in range(n):
                p = at[i]
                high[p >> 3] |= np.uint8(1 << (p & 7))
        return
    high[:] = 0
    mask = np.uint64((1 << lb) - 1)
    width = np.uint64(lb)
    acc = _U0
    bits = _U0
    o = 0
    for i in range(n):
        p = at[i]
        q = (p >> lb) + i
        high[q >> 3] |= np.uint8(1 << (q & 7))
        acc |= (np.uint64(p) & mask) << bits
        bits += width
        if bits >= 32:
            for j in range(4):
                low[o + j] = (acc >> np.uint64(8 * j)) & _FF
            acc >>= np.uint64(32)
            bits -= np.uint64(32)
            o += 4
    while o < len(low):  # the last bits, then zero fields up to a whole group
        low[o] = acc & _FF
        acc >>= np.uint64(8)
        o += 1


@_jit
def code(at, diffs, lb, step, same, escape, ks, dictionary, tables, sym, esc, raw, high, low, make_bitmap):
    """Codes the changed pairs ``at`` with their byte differences ``diffs`` (uint32) and pair
    table (``tables[0]``): their ``k`` (``ks``), the dictionary (``dictionary``: the 15 most
    frequent ``k`` of every ``step``-th pair, ``same`` never), symbols (``sym``; ``escape`` where
    not in the dictionary), escapes (``esc``), raw bytes (``raw``), the escape and raw tables
    (``tables[1]``, ``tables[2]``) and positions at low width ``lb`` (``high``, ``low``; a bitmap
    made only ``make_bitmap``). Returns ``(escapes, raw bytes)``."""
    codes(diffs, ks)
    counts = np.zeros(256, np.int64)
    count(ks, step, counts)
    counts[same] = -1  # (no changed pair has it)
    lut = np.full(256, escape, np.uint8)
    for s in range(escape):  # the most frequent k left (the least k of equals)
        best = 0
        for k in range(256):
            if counts[k] > counts[best]:
                best = k
        dictionary[s] = best
        lut[best] = s
        counts[best] = -2
    both = np.empty(1 << 16, np.uint8)  # two pairs' k as k0 | k1 << 8 -> their symbol byte
    for k1 in range(256):
        for k0 in range(256):
            both[k1 << 8 | k0] = lut[k0] | (lut[k1] << 4)
    ne = symbols(ks, both, escape, tables[0], sym, esc, tables[1])
    nraw = raws(ks, diffs, tables[0], raw, tables[2])
    positions(at, lb, high, low, make_bitmap)
    return ne, nraw
