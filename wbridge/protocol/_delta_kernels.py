"""The delta codec's loops, compiled with numba (``wbridge.protocol.delta`` says the format, and
imports this module only where it encodes or decodes: a process that never does either never
imports numba).

Encoding:

- ``scan``: one streaming pass over two slots (as 32-bit pairs) that codes as it compares: per 64
  pairs a mask word (the positions bitmap's word), and each changed pair's index, ``k`` and raw
  bytes appended; the pair and raw tables noted at each chunk start. With AVX-512 (``COMPRESS``)
  16 pairs at a time are compared and coded as vectors and the changed ones compacted into place
  (``_compact``); with AVX2 (``PERMUTE``) 8 at a time are compared and the changed ones' indices
  and differences moved into place by a permute (``_pack8``), and the codes and raw bytes come
  after the pass, from the changed pairs alone (``coded``); elsewhere the word's
  differences are computed alongside its compares and only its set bits walked.
- ``finish``: passes over the changed pairs' ``k`` alone: ``count`` (a sample's ``k``, for the
  dictionary), ``symbols`` (4-bit symbols, escapes, the escape table) and ``positions``
  (Elias-Fano ``high`` and ``low``, or a bitmap where the scan made none).
- ``code``: the changed pairs a GPU's scan found (indices and byte differences): ``coded`` (each
  pair's ``k``, and the raw stream and table: in one pass 8 pairs at a time with AVX2,
  ``_raw8``; else ``codes``, then ``raws``, which visits only the pairs with a raw byte), then
  ``finish``.

Decoding (a run of chunks, from its stream pieces):

- ``decode``: the pairs' positions (``bitmap_positions`` or ``elias_fano_positions``: set bits
  walked 64 at a time) and byte differences (``pair_diffs``: a symbol each), every piece checked
  to be used exactly; each step its own function (inlined into one loop, the checks between
  them slow the symbol loop tenfold).
- ``changed_bytes``: the changed bytes of decoded pairs; ``add_at``: adds them into a
  destination, after checking every offset.

Each loop is branch-light: masks of 64 pairs computed without branches (vectorised by the
compiler), then a walk of their set bits; the rare cases (escapes) behind a branch.

``scan``, ``finish``, ``code`` and the decoder are compiled on first use (the steps compiled into them) and cached
next to this file (``__pycache__/numba-<version>``), so a later process loads the machine code
instead of compiling. Where that directory cannot be written numba's own fallbacks apply
(``__pycache__``, then a per-user cache directory); where no cache directory can be written at
all, the kernels compile in each process, silently (``_jit``).
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import __version__, carray, njit, types
from numba.core import cgutils, config
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

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


AHEAD = 2048  # pairs (8 KiB of each slot): how far ahead ``scan`` asks for the slots' cache lines


@intrinsic
def _prefetch(typingctx, array, index):
    """Asks for the cache line of ``array[index]`` (``llvm.prefetch``, for reading, kept in every
    cache level): a hint that never faults. A slot the snapshot wrote long ago is in no cache, and
    the scan's work per 64 pairs hides too little of the memory's latency on its own."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        signature = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, signature, "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # (read, highest locality, data)
        return context.get_dummy_value()

    return types.void(array, index), codegen


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


LANES = 16  # pairs ``_compact`` compares and compacts at once (a 512-bit vector of each slot)


def _compresses() -> bool:
    """Whether the CPU numba compiles for compacts vector lanes in one instruction, 32-bit lanes and
    bytes alike, and looks bytes up in a 128-byte table (AVX-512 with VBMI and VBMI2:
    ``vpcompressd``, ``vpcompressb``, ``vpermi2b``). Elsewhere LLVM lowers
    ``llvm.masked.compressstore`` to a branch per lane, slower than walking a mask's set bits, so
    ``scan`` walks them there, and ``symbols`` looks each ``k`` up alone."""
    from numba.core.codegen import get_host_cpu_features

    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return {"+avx512f", "+avx512bw", "+avx512vbmi", "+avx512vbmi2"} <= set(features.split(","))


COMPRESS = _compresses()


def _permutes() -> bool:
    """Whether the CPU numba compiles for permutes 32-bit lanes by a vector of indices (AVX2:
    ``vpermd``) and bytes by one (``pshufb``), where ``COMPRESS`` does not hold: ``scan`` then packs
    the changed pairs eight at a time (``_pack8``), and their raw bytes eight pairs at a time
    (``_raw8``)."""
    from numba.core.codegen import get_host_cpu_features

    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return not COMPRESS and "+avx2" in features.split(",")


PERMUTE = _permutes()
# per 8-bit mask, the indices that move its set lanes to the front, in order (``vpermd``, ``pshufb``)
_PACK_LANES = np.array(
    [[j for j in range(8) if m >> j & 1] + [0] * (8 - bin(m).count("1")) for m in range(256)], dtype=np.int32
)
_PACK_BYTES = _PACK_LANES.astype(np.uint8)


def _v8(builder, array, index):
    """A pointer to ``<8 x element>`` at ``array[index]`` (``array``: a numba array's data pointer)."""
    return builder.bitcast(builder.gep(array, [index]), ir.VectorType(array.type.pointee, 8).as_pointer())


def _vector_diff(builder, x, y):
    """``_diff`` of vectors of pairs (32-bit lanes)."""
    h, l7 = (ir.Constant(x.type, [int(v)] * x.type.count) for v in (_H, _L7))
    return builder.xor(
        builder.sub(builder.or_(y, h), builder.and_(x, l7)), builder.and_(builder.xor(y, builder.not_(x)), h)
    )


def _vector_code(builder, d):
    """``_code`` of a vector of pairs' byte differences (32-bit lanes): each pair's ``k`` (in the
    low byte of its lane) and the top bit of each byte coded 3 (``r`` before its shift)."""
    h, l7, ones, seven_d, low2, spread = (
        ir.Constant(d.type, [int(v)] * d.type.count) for v in (_H, _L7, _ONES, _SEVEN_D, _LOW2, _SPREAD)
    )
    e = builder.xor(builder.add(builder.and_(d, l7), ones), builder.and_(d, h))  # byte-wise d + 1
    top = builder.and_(builder.or_(builder.add(builder.and_(e, l7), seven_d), e), h)
    r = builder.lshr(top, ir.Constant(d.type, [7] * d.type.count))
    c = builder.or_(builder.and_(e, low2), builder.or_(r, builder.shl(r, ir.Constant(d.type, [1] * d.type.count))))
    # (the product's bits 18-25, k, are the same in 32 bits as in 64)
    return builder.lshr(builder.mul(c, spread), ir.Constant(d.type, [18] * d.type.count)), top


@intrinsic
def _pack8(typingctx, a, b, base, lanes, at, diffs, n):
    """Compares pairs ``base .. base + 7`` of ``a`` and ``b`` (uint32 arrays) as one vector each
    and stores, for the changed ones in order, their indices at ``at[n]`` on and their byte
    differences at ``diffs[n]`` on, each moved to the front by one ``vpermd`` (``lanes``:
    ``_PACK_LANES``); eight of each are stored, whatever changed. Returns the mask of changed
    pairs (bit ``j``: pair ``base + j``)."""
    width = at.dtype.bitwidth

    def codegen(context, builder, signature, args):
        def data(i):
            return context.make_array(signature.args[i])(context, builder, args[i]).data

        i32, i64, iat = ir.IntType(32), ir.IntType(64), ir.IntType(width)
        v32, vat = ir.VectorType(i32, 8), ir.VectorType(iat, 8)
        x, y = (
            builder.load(_v8(builder, data(0), args[2]), align=4),
            builder.load(_v8(builder, data(1), args[2]), align=4),
        )
        mask = builder.zext(builder.bitcast(builder.icmp_unsigned("!=", x, y), ir.IntType(8)), i64)
        order = builder.load(_v8(builder, data(3), builder.mul(mask, i64(8))), align=4)
        permd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32, v32]), "llvm.x86.avx2.permd")
        picked = builder.call(permd, [ir.Constant(v32, list(range(8))), order])
        picked = builder.zext(picked, vat) if width > 32 else picked
        start = builder.trunc(args[2], iat) if width < 64 else args[2]
        first = builder.insert_element(ir.Constant(vat, ir.Undefined), start, i32(0))
        first = builder.shuffle_vector(first, ir.Constant(vat, ir.Undefined), ir.Constant(v32, [0] * 8))
        builder.store(builder.add(picked, first), _v8(builder, data(4), args[6]), align=1)
        builder.store(
            builder.call(permd, [_vector_diff(builder, x, y), order]), _v8(builder, data(5), args[6]), align=1
        )
        return mask

    return types.uint64(a, b, base, lanes, at, diffs, n), codegen


@intrinsic
def _raw8(typingctx, diffs, i, table, raw, o, keep, ks):
    """Codes the pairs ``diffs[i .. i + 7]`` (their byte differences, uint32): stores their ``k``
    at ``ks[i]`` on, and their raw bytes (the bytes coded 3, in pair then byte order) at ``raw[o]``
    on, the bytes of each two pairs moved to the front by one ``pshufb`` (``table``:
    ``_PACK_BYTES``); only the raw bytes of ``keep`` count (a mask: bit ``4 j + b`` for byte ``b``
    of pair ``i + j``), and 32 bytes are stored whatever. Returns how many count."""

    def codegen(context, builder, signature, args):
        def data(j):
            return context.make_array(signature.args[j])(context, builder, args[j]).data

        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        v16, bytes32, i64x2 = ir.VectorType(i8, 16), ir.VectorType(i8, 32), ir.VectorType(i64, 2)
        d = builder.load(_v8(builder, data(0), args[1]), align=4)
        k, top = _vector_code(builder, d)
        builder.store(builder.trunc(k, ir.VectorType(i8, 8)), _v8(builder, data(6), args[1]), align=1)
        top = builder.icmp_signed("<", builder.bitcast(top, bytes32), ir.Constant(bytes32, [0] * 32))
        raws = builder.and_(builder.zext(builder.bitcast(top, i32), i64), args[5])
        fnty = ir.FunctionType(v16, [v16, v16])
        pshufb = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.ssse3.pshuf.b.128")
        stored = i64(0)
        for h in range(2):  # 16 bytes (four pairs) at a time: each 8 moved by their own row
            src = builder.shuffle_vector(
                builder.bitcast(d, bytes32),
                ir.Constant(bytes32, ir.Undefined),
                ir.Constant(ir.VectorType(i32, 16), list(range(16 * h, 16 * h + 16))),
            )
            masks = [builder.and_(builder.lshr(raws, i64(16 * h + 8 * q)), i64(0xFF)) for q in (0, 1)]
            rows = [
                builder.load(builder.bitcast(builder.gep(data(2), [builder.mul(m, i64(8))]), i64.as_pointer()), align=1)
                for m in masks
            ]
            idx = builder.insert_element(ir.Constant(i64x2, ir.Undefined), rows[0], i32(0))
            idx = builder.insert_element(idx, builder.add(rows[1], i64(0x0808080808080808)), i32(1))  # (bytes 8-15)
            out = builder.bitcast(builder.call(pshufb, [src, builder.bitcast(idx, v16)]), i64x2)
            for q, m in enumerate(masks):
                at = builder.bitcast(builder.gep(data(3), [builder.add(args[4], stored)]), i64.as_pointer())
                builder.store(builder.extract_element(out, i32(q)), at, align=1)
                stored = builder.add(stored, _ctpop(builder, m))
        return stored

    return types.int64(diffs, i, table, raw, o, keep, ks), codegen


@njit(inline="always")
def _coded_packed(diffs, ks, ptab, raw, rtab):
    """``coded`` eight pairs at a time (``_raw8``), chunk by chunk; the last pairs of ``diffs``
    that are fewer than eight, one by one."""
    n = len(diffs)
    o = 0
    for c in range(len(ptab) - 1):
        rtab[c] = o
        i, end = np.int64(ptab[c]), np.int64(ptab[c + 1])
        while i < end and i + 8 <= n:
            keep = (np.int64(1) << (4 * min(end - i, 8))) - 1
            o += _raw8(diffs, i, _PACK_BYTES, raw, o, keep, ks)
            i += 8
        for p in range(i, end):  # (the last few pairs: ``_raw8`` would read past them)
            d = np.uint64(diffs[p])
            k = _code(d)[0]
            ks[p] = k
            for j in range(4):
                raw[o] = (d >> np.uint64(8 * j)) & _FF
                o += np.int64((k >> (2 * j)) & (k >> (2 * j + 1)) & 1)
    rtab[len(rtab) - 1] = o
    return o


@intrinsic
def _compact(typingctx, a, b, base, at, ks, raw, n, o):
    """Compares pairs ``base .. base + LANES - 1`` of ``a`` and ``b`` (uint32 arrays) as one vector
    each and stores, for the changed ones in order, their indices at ``at[n]`` on and their ``k``
    at ``ks[n]`` on, and their raw bytes (the byte differences coded 3) at ``raw[o]`` on
    (``llvm.masked.compressstore``: nothing stored for the rest; ``_diff`` and ``_code`` lane by
    lane). Returns the mask of changed pairs (bit ``j``: pair ``base + j``) plus the raw bytes
    stored times ``2**32``."""
    width = at.dtype.bitwidth

    def codegen(context, builder, signature, args):
        def data(i):
            return context.make_array(signature.args[i])(context, builder, args[i]).data

        i8, i32, iat = ir.IntType(8), ir.IntType(32), ir.IntType(width)
        v32, vat = ir.VectorType(i32, LANES), ir.VectorType(iat, LANES)
        bytes_ = ir.VectorType(i8, 4 * LANES)

        def load(ptr):
            return builder.load(builder.bitcast(builder.gep(ptr, [args[2]]), v32.as_pointer()), align=4)

        def splat(value):
            return ir.Constant(v32, [int(value)] * LANES)

        def compress(value, out, at, mask):
            kind = f"v{value.type.count}i{value.type.element.width}"
            fnty = ir.FunctionType(ir.VoidType(), [value.type, value.type.element.as_pointer(), mask.type])
            fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.masked.compressstore.{kind}")
            builder.call(fn, [value, builder.gep(out, [at]), mask])

        x, y = load(data(0)), load(data(1))
        changed = builder.icmp_unsigned("!=", x, y)
        d = builder.xor(  # _diff
            builder.sub(builder.or_(y, splat(_H)), builder.and_(x, splat(_L7))),
            builder.and_(builder.xor(y, builder.not_(x)), splat(_H)),
        )
        e = builder.xor(builder.add(builder.and_(d, splat(_L7)), splat(_ONES)), builder.and_(d, splat(_H)))  # _code
        r = builder.and_(builder.or_(builder.add(builder.and_(e, splat(_L7)), splat(_SEVEN_D)), e), splat(_H))
        r = builder.lshr(r, splat(7))
        c = builder.or_(builder.and_(e, splat(_LOW2)), builder.mul(r, splat(3)))
        k = builder.trunc(builder.lshr(builder.mul(c, splat(_SPREAD)), splat(18)), ir.VectorType(i8, LANES))
        start = builder.trunc(args[2], iat) if width < 64 else args[2]
        first = builder.insert_element(ir.Constant(vat, ir.Undefined), start, ir.Constant(i32, 0))
        index = builder.add(
            builder.shuffle_vector(first, ir.Constant(vat, ir.Undefined), ir.Constant(v32, [0] * LANES)),
            ir.Constant(vat, list(range(LANES))),
        )
        coded3 = builder.icmp_unsigned("!=", builder.bitcast(r, bytes_), ir.Constant(bytes_, [0] * 4 * LANES))
        compress(index, data(3), args[6], changed)
        compress(k, data(4), args[6], changed)
        compress(builder.bitcast(d, bytes_), data(5), args[7], coded3)
        i64 = ir.IntType(64)
        raws = _ctpop(builder, builder.bitcast(coded3, i64))
        mask = builder.zext(builder.bitcast(changed, ir.IntType(LANES)), i64)
        return builder.or_(mask, builder.shl(raws, ir.Constant(i64, 32)))

    return types.uint64(a, b, base, at, ks, raw, n, o), codegen


def _ctpop(builder, value):
    """The IR of the set bits of the 64-bit ``value`` (``llvm.ctpop``)."""
    i64 = ir.IntType(64)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64]), "llvm.ctpop.i64")
    return builder.call(fn, [value])


@intrinsic
def _popcount(typingctx, x):
    """The set bits of ``x`` (a uint64), as an int64."""

    def codegen(context, builder, signature, args):
        return _ctpop(builder, args[0])

    return types.int64(x), codegen


@njit(inline="always")
def _append(at, ks, raw, n, o, p, d):
    """Appends pair ``p`` with byte differences ``d`` (uint64): its index at ``at[n]``, its ``k``
    at ``ks[n]``, its raw bytes at ``raw[o]`` on (four bytes written, whatever it has). Returns
    the raw bytes after it."""
    k, r = _code(d)
    at[n] = p
    ks[n] = k
    for j in range(4):  # (no branch)
        raw[o] = (d >> np.uint64(8 * j)) & _FF
        o += np.int64((r >> np.uint64(8 * j)) & _U1)
    return o


@_jit
def scan(a, b, tail_a, tail_b, has_tail, most, chunk_words, bitmap, at, ks, diffs, raw, ptab, rtab):
    """Compares the slots ``a`` and ``b`` (uint32 pairs), and a short last pair (``tail_a``,
    ``tail_b``: uint64, padded; ``has_tail``) after them, and codes what changed as it goes:
    writes the bitmap of changed pairs (``bitmap``, uint64 words, zero past the last pair), each
    changed pair's index (``at``) and ``k`` (``ks``, uint8), the raw stream (``raw``), and at
    each chunk start (every ``chunk_words`` words) the changed pairs and raw bytes before it
    (``ptab``, ``rtab``: one entry per chunk, then the totals). 64 pairs make a mask word: where
    the CPU compacts vectors (``COMPRESS``), ``LANES`` pairs at a time are compared, coded and the
    changed ones stored (``_compact``, no branch); where it permutes them (``PERMUTE``), 8 at a
    time are compared and the changed ones' indices and byte differences stored (``_pack8``, no
    branch; ``diffs``), and after the pass their ``k`` and raw bytes and table come from those
    (``coded``); elsewhere the 64 are compared into the word, their
    differences computed alongside (vectorised), then only its set bits are walked. Returns the
    changed pairs, or -1 as soon as a chunk start finds more than ``most``. ``at`` and ``ks`` hold
    room for every pair, ``diffs`` (uint32; used only with ``PERMUTE``) for every pair too, ``raw``
    for 4 bytes a pair and 64 more."""
    full = a.shape[0]
    pairs = full + has_tail
    n = 0
    o = 0
    whole = full // 64
    word = np.empty(64, np.uint32)  # a word's pairs' byte differences
    for w in range(whole):
        base = w * 64
        if w % chunk_words == 0:
            if n > most:
                return -1
            ptab[w // chunk_words] = n
            rtab[w // chunk_words] = o
        if base + AHEAD + 64 <= full:  # (the four cache lines of each slot, 64 pairs ahead)
            for q in range(0, 64, 16):
                _prefetch(a, base + AHEAD + q)
                _prefetch(b, base + AHEAD + q)
        m = _U0
        if COMPRESS:
            for q in range(0, 64, LANES):
                found = _compact(a, b, base + q, at, ks, raw, n, o)
                changed = found & np.uint64(0xFFFFFFFF)
                n += _popcount(changed)
                o += np.int64(found >> np.uint64(32))
                m |= changed << np.uint64(q)
            bitmap[w] = m
            continue
        if PERMUTE:
            for q in range(0, 64, 8):
                changed = _pack8(a, b, base + q, _PACK_LANES, at, diffs, n)
                n += _popcount(changed)
                m |= changed << np.uint64(q)
            bitmap[w] = m
            continue
        for j in range(64):  # (no branch: vectorised)
            x, y = np.uint64(a[base + j]), np.uint64(b[base + j])
            word[j] = _diff(x, y)
            m |= np.uint64(x != y) << np.uint64(j)
        bitmap[w] = m
        while m:
            j = np.int64(trailing_zeros(m))
            m &= m - _U1
            o = _append(at, ks, raw, n, o, base + j, np.uint64(word[j]))
            n += 1
    if pairs > whole * 64:  # the last, partial word (and the short last pair)
        base = whole * 64
        if whole % chunk_words == 0:
            ptab[whole // chunk_words] = n
            rtab[whole // chunk_words] = o
        m = _U0
        for p in range(base, pairs):
            if p < full:
                x, y = np.uint64(a[p]), np.uint64(b[p])
            else:
                x, y = tail_a, tail_b
            if x != y:
                m |= _U1 << np.uint64(p - base)
                if PERMUTE:  # (its code and raw bytes come with the others', below)
                    at[n], diffs[n] = p, _diff(x, y)
                else:
                    o = _append(at, ks, raw, n, o, p, _diff(x, y))
                n += 1
        bitmap[whole] = m
    if n > most:
        return -1
    ptab[len(ptab) - 1] = n
    if PERMUTE:  # the codes and raw bytes, from the changed pairs' differences alone
        coded(diffs[:n], ks[:n], ptab, raw, rtab)
    else:
        rtab[len(rtab) - 1] = o
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


@intrinsic
def _symbols64(typingctx, ks, i, lut, sym, escape):
    """The symbols of ``ks[i .. i + 63]`` (``lut``: 256 bytes, ``k`` -> its symbol) looked up as one
    vector (``vpermi2b`` twice: a 128-byte table each, the top bit of ``k`` choosing), stored two a
    byte at ``sym[i // 2]`` on (``i`` even). Returns the mask of the pairs whose symbol is
    ``escape`` (bit ``j``: pair ``i + j``)."""

    def codegen(context, builder, signature, args):
        def data(j):
            return context.make_array(signature.args[j])(context, builder, args[j]).data

        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        v64, v32 = ir.VectorType(i8, 64), ir.VectorType(i8, 32)

        def load(ptr, at):
            return builder.load(builder.bitcast(builder.gep(ptr, [at]), v64.as_pointer()), align=1)

        k = load(data(0), args[1])
        table = [load(data(2), i64(64 * q)) for q in range(4)]
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v64, [v64, v64, v64]), "llvm.x86.avx512.vpermi2var.qi.512"
        )
        low, high = builder.call(fn, [table[0], k, table[1]]), builder.call(fn, [table[2], k, table[3]])
        s = builder.select(builder.icmp_signed("<", k, ir.Constant(v64, [0] * 64)), high, low)
        first = builder.shuffle_vector(
            s, ir.Constant(v64, ir.Undefined), ir.Constant(ir.VectorType(i32, 32), list(range(0, 64, 2)))
        )
        second = builder.shuffle_vector(
            s, ir.Constant(v64, ir.Undefined), ir.Constant(ir.VectorType(i32, 32), list(range(1, 64, 2)))
        )
        packed = builder.or_(first, builder.shl(second, ir.Constant(v32, [4] * 32)))
        at = builder.gep(data(3), [builder.lshr(args[1], i64(1))])
        builder.store(packed, builder.bitcast(at, v32.as_pointer()), align=1)
        e = builder.trunc(args[4], i8)
        splat = builder.shuffle_vector(
            builder.insert_element(ir.Constant(v64, ir.Undefined), e, i32(0)),
            ir.Constant(v64, ir.Undefined),
            ir.Constant(ir.VectorType(i32, 64), [0] * 64),
        )
        return builder.bitcast(builder.icmp_unsigned("==", s, splat), i64)

    return types.uint64(ks, i, lut, sym, escape), codegen


@_inner
def symbols(ks, lut, escape, ptab, sym, esc, etab):
    """The changed pairs' symbols (``sym``: two a byte, the first in the low half; ``lut``: ``k``
    -> its symbol), escapes (symbol ``escape``; ``esc``: their ``k``) and escape table (``etab``:
    escapes before each chunk's first pair, ``ptab``). Returns the escapes. Where the CPU allows
    (``COMPRESS``), 64 pairs at a time are looked up as one vector (``_symbols64``), and only the
    escapes' bits walked."""
    n = len(ks)
    ne = 0
    c = 0
    start = 0
    if COMPRESS:
        start = n // 64 * 64
        for i in range(0, start, 64):
            m = _symbols64(ks, i, lut, sym, escape)
            while m:  # (few)
                j = i + np.int64(trailing_zeros(m))
                m &= m - _U1
                c = _note(etab, ptab, c, j, ne)
                esc[ne] = ks[j]
                ne += 1
    half = n // 2
    for h in range(start // 2, half):  # (whole bytes: no test of the end inside)
        k0, k1 = ks[2 * h], ks[2 * h + 1]
        s0, s1 = lut[k0], lut[k1]
        sym[h] = s0 | (s1 << 4)
        if (s0 == escape) | (s1 == escape):  # (few)
            if s0 == escape:
                c = _note(etab, ptab, c, 2 * h, ne)
                esc[ne] = k0
                ne += 1
            if s1 == escape:
                c = _note(etab, ptab, c, 2 * h + 1, ne)
                esc[ne] = k1
                ne += 1
    if n % 2:  # the last pair's symbol alone in its byte
        k0 = ks[n - 1]
        sym[half] = lut[k0]
        if lut[k0] == escape:
            c = _note(etab, ptab, c, n - 1, ne)
            esc[ne] = k0
            ne += 1
    _note(etab, ptab, c, n, ne)
    return ne


@_inner
def coded(diffs, ks, ptab, raw, rtab):
    """The changed pairs' ``k`` (``ks``) and raw stream and table (``raws``) from their byte
    differences ``diffs``: where the CPU permutes bytes (``PERMUTE``), both in one pass, eight pairs
    at a time (``_coded_packed``); elsewhere ``codes``, then ``raws``. Returns the raw bytes; ``raw``
    holds room for 32 more than that."""
    if PERMUTE:
        return _coded_packed(diffs, ks, ptab, raw, rtab)
    codes(diffs, ks)
    return raws(ks, diffs, ptab, raw, rtab)


@_inner
def raws(ks, diffs, ptab, raw, rtab):
    """The raw stream (the byte differences of bytes coded 3, pair then byte order) and table
    (``rtab``: raw bytes before each chunk's first pair, ``ptab``): 64 pairs' ``k`` tested into a
    mask word, then only the pairs with a raw byte visited. Returns the raw bytes."""
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
def code(at, diffs, lb, step, same, escape, ks, dictionary, tables, sym, esc, raw, high, low):
    """Codes the changed pairs ``at`` with their byte differences ``diffs`` (uint32) and pair
    table (``tables[0]``), found elsewhere (a GPU's scan): their ``k`` (``ks``), raw bytes
    (``raw``) and raw table (``tables[2]``), then the rest as ``finish`` (``high`` made, a bitmap
    too). Returns ``(escapes, raw bytes)``."""
    nraw = coded(diffs, ks, tables[0], raw, tables[2])
    bitmap = lb == 0  # (a bool, not the constant True: the signature ``encode_slots`` compiled ``finish`` for)
    return finish(at, ks, lb, step, same, escape, dictionary, tables, sym, esc, high, low, bitmap), nraw


@_jit
def finish(at, ks, lb, step, same, escape, dictionary, tables, sym, esc, high, low, make_bitmap):
    """Codes the changed pairs ``at`` with their ``k`` (``ks``) and pair table (``tables[0]``):
    the dictionary (``dictionary``: the 15 most frequent ``k`` of every ``step``-th pair,
    ``same`` never), symbols (``sym``; ``escape`` where not in the dictionary), escapes (``esc``)
    and escape table (``tables[1]``), and positions at low width ``lb`` (``high``, ``low``; a
    bitmap made only ``make_bitmap``). Returns the escapes."""
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
    ne = symbols(ks, lut, escape, tables[0], sym, esc, tables[1])
    positions(at, lb, high, low, make_bitmap)
    return ne


@njit(inline="always")
def _pair_code(k, kdiff, raw, r):
    """A pair's byte differences (uint64 holding 32 bits) from its ``k``: ``kdiff[k]``, with each
    byte coded 3 taken from ``raw`` from ``r`` on; and the raw bytes after it (-1: ``raw`` short)."""
    d = np.uint64(kdiff[k])
    if k & (k >> 1) & 0x55:  # a byte coded 3 (few)
        for j in range(4):
            if (k >> (2 * j)) & 3 == 3:
                if r >= len(raw):
                    return d, -1
                d |= np.uint64(raw[r]) << np.uint64(8 * j)
                r += 1
    return d, r


@njit(inline="always")
def _word(data, w):
    """Bytes ``8 w .. 8 w + 7`` of ``data`` as a little-endian uint64 (zeros past its end)."""
    m = _U0
    for j in range(min(8, len(data) - 8 * w)):
        m |= np.uint64(data[8 * w + j]) << np.uint64(8 * j)
    return m


@_inner
def bitmap_positions(high, first, at):
    """The pairs of a bitmap (``high``, a bit per pair from pair ``first``) into ``at``, 64 bits
    at a time; how many, or -1 where more than ``at`` holds."""
    n = len(at)
    i = 0
    for w in range((len(high) + 7) // 8):
        m = _word(high, w)
        while m:
            if i == n:
                return -1
            at[i] = first + 64 * w + np.int64(trailing_zeros(m))
            m &= m - _U1
            i += 1
    return i


@_inner
def elias_fano_positions(high, low, lb, p0, first, at):
    """The pairs of rank ``p0`` on (``len(at)`` of them) from Elias-Fano ``high`` bits (the first
    at bit ``((first >> lb) + p0) % 8``) and ``low`` fields of ``lb`` bits (from field ``p0 % 8``)
    into ``at``; how many were found before the bits ran out, or -1 where the low fields are short
    or the pairs are not strictly ascending."""
    n = len(at)
    h = (first >> lb) + p0  # the high bit of the run's first pair
    bucket = (h - p0) - (h % 8)  # the bucket of the piece's first bit, less the pairs before it
    f = p0 % 8  # the first pair's low field
    nl = len(low)
    if (f + n + 7) // 8 * lb > nl:
        return -1
    mask = np.int64((1 << lb) - 1)
    prev = np.int64(-1)
    i = 0
    for w in range((len(high) + 7) // 8):
        m = _word(high, w)
        if w == 0:
            m &= ~_U0 << np.uint64(h % 8)
        while m:
            if i == n:
                return i
            q = 64 * w + np.int64(trailing_zeros(m))
            m &= m - _U1
            bit = (f + i) * lb
            o = bit >> 3
            v = np.int64(low[o])
            if o + 1 < nl:
                v |= np.int64(low[o + 1]) << 8
            if o + 2 < nl:
                v |= np.int64(low[o + 2]) << 16
            p = ((q + bucket - i) << lb) | ((v >> (bit & 7)) & mask)
            if p <= prev:
                return -1
            at[i] = prev = p
            i += 1
    return i


@_inner
def pair_diffs(sym, esc, raw, s0, dictionary, escape, same, kdiff, diffs):
    """Each pair's byte differences (``diffs``, uint32) from its symbol (from nibble ``s0`` of
    ``sym``): symbol ``escape`` takes its ``k`` from ``esc`` (in order, never ``same``), the
    others from ``dictionary``; ``kdiff[k]``, its bytes coded 3 taken from ``raw`` (in order).
    True where every escape and raw byte was used, no more."""
    e = 0
    r = 0
    for i in range(len(diffs)):
        t = s0 + i
        s = (sym[t >> 1] >> (4 * (t & 1))) & 15
        if s == escape:  # (few)
            if e >= len(esc) or esc[e] == same:
                return False
            k = np.int64(esc[e])
            e += 1
        else:
            k = np.int64(dictionary[s])
        d, r = _pair_code(k, kdiff, raw, r)
        if r < 0:
            return False
        diffs[i] = d
    return e == len(esc) and r == len(raw)


@_jit
def decode(high, low, sym, esc, raw, lb, p0, first, end, dictionary, escape, same, kdiff, at, diffs):
    """Decodes the changed pairs of a run of chunks (as many as ``at`` holds) from its stream
    pieces: their pair indices (``at``, int64, ascending) and byte differences (``diffs``,
    uint32; ``pair_diffs``). ``high``: with ``lb`` > 0 Elias-Fano high bits and ``low`` fields
    (``elias_fano_positions``: the run's first pair is of rank ``p0``), with ``lb`` 0 the bitmap
    of the run's pairs from pair ``first``. False where the pieces do not make sense: a pair out
    of order or outside ``first .. end - 1``, or a piece too short or too long."""
    n = len(at)
    s0 = p0 % 2
    if len(sym) != (s0 + n + 1) // 2:
        return False
    got = bitmap_positions(high, first, at) if lb == 0 else elias_fano_positions(high, low, lb, p0, first, at)
    if got != n or (n > 0 and (at[0] < first or at[n - 1] >= end)):
        return False
    return pair_diffs(sym, esc, raw, s0, dictionary, escape, same, kdiff, diffs)


@_jit
def changed_bytes(at, diffs, pos, values):
    """The bytes that changed of the pairs ``at`` (int64) with byte differences ``diffs``
    (uint32): their byte offsets (``pos``, ascending where ``at`` is) and differences
    (``values``, uint8, none 0), each with room for four per pair (written without a branch:
    every byte stored, the count advanced by the changed ones). Returns how many."""
    m = 0
    for i in range(len(at)):
        d = np.uint64(diffs[i])
        base = 4 * at[i]
        for j in range(4):
            v = (d >> np.uint64(8 * j)) & _FF
            pos[m] = base + j
            values[m] = v
            m += np.int64(v != _U0)
    return m


@_jit
def tables(values, lo, hi, nchunks, totals, out):
    """A delta's tables from the entries ``values`` (uint32) of the runs of chunks ``lo[i]..hi[i]``
    as ``table_rows`` placed them (table by table, run by run) into ``out`` (int64 ``[3, nchunks +
    1]``, -1 where not read): False where they do not make sense (an entry below the one before
    it, or past its table's total in ``totals``; a table not starting at 0, or not ending at its
    total where the run ends the slot) or do not fill ``values`` exactly."""
    at = 0
    for t in range(3):
        for r in range(len(lo)):
            a, b = lo[r], hi[r]
            n = b - a + 2
            if a < 0 or b >= nchunks or b < a - 1 or at + n > len(values):
                return False
            prev = np.int64(values[at])
            if (a == 0 and prev != 0) or prev > totals[t]:
                return False
            for j in range(n):
                v = np.int64(values[at + j])
                if v < prev:
                    return False
                out[t, a + j] = prev = v
            if prev > totals[t] or (b + 1 == nchunks and prev != totals[t]):
                return False
            at += n
    return at == len(values)


@_jit
def stream_ranges(t, lo, hi, lb, pairs, offsets, chunk_pairs, group, first, length):
    """Per run of chunks ``lo[i]..hi[i]`` the byte range of each of the five streams it uses (from
    the tables ``t``, low width ``lb``, the slot's ``pairs``, the streams' ``offsets``): starts
    into ``first`` and lengths into ``length`` (int64 ``[runs, 5]``); low fields are read in whole
    ``group``s, a bitmap (``lb`` 0) in the chunks' own bytes."""
    for r in range(len(lo)):
        a, b = lo[r], hi[r]
        p0, p1 = t[0, a], t[0, b + 1]
        if lb == 0:
            h0 = a * (chunk_pairs // 8)
            h1 = min((b + 1) * (chunk_pairs // 8), (pairs + 7) // 8)
        else:
            h0 = (((a * chunk_pairs) >> lb) + p0) // 8
            h1 = (min(((b + 1) * chunk_pairs) >> lb, (pairs + (1 << lb) - 1) >> lb) + p1 + 7) // 8
        s0 = (h0, (p0 // group) * lb, p0 // 2, t[1, a], t[2, a])
        s1 = (h1, (p1 + group - 1) // group * lb, (p1 + 1) // 2, t[1, b + 1], t[2, b + 1])
        for k in range(5):
            first[r, k] = s0[k] + offsets[k]
            length[r, k] = s1[k] - s0[k]


@_jit
def decode_whole(delta, head, entries, fields, nchunks, pairs, chunk_pairs, group, max_lb, dict_at, escape, same,
                 kdiff, t, at, diffs):  # fmt: skip
    """``tables``, ``stream_ranges`` and ``decode`` of a delta read whole, over all its ``nchunks``
    chunks, in one call: ``delta`` its bytes up to its extent, ``head`` its header words, ``entries``
    its tables' entries (uint32); ``fields`` the header's low width, three totals and first stream
    offset (their word indices); ``t`` receives the tables (int64 ``[3, nchunks + 1]``), ``at`` and
    ``diffs`` the pairs (exactly as many as the tables say). False where any of it does not make
    sense: a low width past ``max_lb``, a dictionary symbol naming ``same``, the tables (``tables``),
    a stream outside ``delta``, or the streams (``decode``)."""
    lb = np.int64(head[fields[0]])
    if lb < 0 or lb > max_lb:
        return False
    dictionary = delta[dict_at : dict_at + 16]
    for s in range(escape):  # (the symbols in use: no changed pair's ``k`` is ``same``)
        if dictionary[s] == same:
            return False
    totals = np.empty(3, np.int64)
    for j in range(3):
        totals[j] = np.int64(head[fields[1 + j]])
    lo, hi = np.zeros(1, np.int64), np.full(1, nchunks - 1, np.int64)
    if not tables(entries, lo, hi, nchunks, totals, t) or t[0, nchunks] != len(at) or len(diffs) != len(at):
        return False
    offsets = np.empty(5, np.int64)
    for k in range(5):
        offsets[k] = np.int64(head[fields[4] + k])
    first, length = np.empty((1, 5), np.int64), np.empty((1, 5), np.int64)
    stream_ranges(t, lo, hi, lb, pairs, offsets, chunk_pairs, group, first, length)
    size = len(delta)
    for k in range(5):  # (overflow-safe: an offset is any 64 bits the header says)
        if first[0, k] < 0 or first[0, k] > size or length[0, k] < 0 or length[0, k] > size - first[0, k]:
            return False
    f, n = first[0], length[0]
    return decode(delta[f[0] : f[0] + n[0]], delta[f[1] : f[1] + n[1]], delta[f[2] : f[2] + n[2]],
                  delta[f[3] : f[3] + n[3]], delta[f[4] : f[4] + n[4]], lb, 0, 0, pairs, dictionary, escape, same,
                  kdiff, at, diffs)  # fmt: skip


@intrinsic
def _bytes_at(typingctx, address):
    """A ``uint8*`` at ``address`` (an int64): memory the caller checked to be its own."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return types.CPointer(types.uint8)(address), codegen


@intrinsic
def _prefetch_at(typingctx, address):
    """``_prefetch`` of the cache line at host ``address`` (an int64): a hint that never faults."""

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        signature = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, signature, "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, i32(1), i32(3), i32(1)])  # (write, highest locality, data)
        return context.get_dummy_value()

    return types.void(address), codegen


FAR = 64  # changed pairs: how far ahead ``add_pairs`` asks for its destination's cache lines


@_jit
def add_pairs(at, diffs, soff, end, addr):
    """Adds the byte differences ``diffs`` (uint32) of the changed pairs ``at`` (int64, ascending)
    into the destinations of the reads covering their bytes: read ``r`` covers slot bytes
    ``soff[r] .. end[r] - 1`` (ascending, disjoint) and lands at host address ``addr[r]`` (int64,
    memory the caller checked). A pair inside one read is four byte adds; one across a read's
    edge goes byte by byte (a byte no read covers is not this reader's)."""
    r = 0
    nr = len(soff)
    n = len(at)
    ahead = 0  # (the read that pair ``i + FAR`` is in, or the first after it)
    for i in range(n):
        b = 4 * at[i]
        d = np.uint64(diffs[i])
        while r < nr and end[r] <= b:
            r += 1
        if r == nr:
            return
        if i + FAR < n:  # (the destination is in no cache: its lines asked for FAR pairs ahead)
            f = 4 * at[i + FAR]
            while ahead < nr and end[ahead] <= f:
                ahead += 1
            if ahead < nr and f >= soff[ahead]:
                _prefetch_at(addr[ahead] + (f - soff[ahead]))
        if b >= soff[r] and b + 4 <= end[r]:
            p = carray(_bytes_at(addr[r] + (b - soff[r])), 4)
            for j in range(4):  # (no branch: an unchanged byte adds 0)
                p[j] += np.uint8((d >> np.uint64(8 * j)) & _FF)
            continue
        for j in range(4):
            v = np.uint8((d >> np.uint64(8 * j)) & _FF)
            q = b + j
            k = r
            while k < nr and end[k] <= q:
                k += 1
            if v and k < nr and q >= soff[k]:
                p = carray(_bytes_at(addr[k] + (q - soff[k])), 1)
                p[0] += v


@_jit
def add_at(dst, offsets, values):
    """``dst[offsets] += values`` (uint8, mod 256; an offset may repeat), after checking that
    every offset is in ``dst``: returns False, writing nothing, where one is not."""
    for i in range(len(offsets)):
        if offsets[i] < 0 or offsets[i] >= len(dst):
            return False
    n = len(offsets)
    for i in range(n):
        if i + 64 < n:  # (the destination is in no cache: its lines asked for 64 changes ahead)
            _prefetch(dst, offsets[i + 64])
        dst[offsets[i]] += values[i]
    return True
