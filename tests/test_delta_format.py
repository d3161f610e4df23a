"""The delta format's codec (``wbridge.protocol.delta``) on its own: every change is decoded back
exactly, from the whole buffer or from any run of chunks alone, at every density (every
Elias-Fano width and the bitmap), with short last pairs, escapes and raw bytes, whatever a reused
workspace held before, whether the compiled encoder scanned the slots itself or coded pairs found
elsewhere (the two write the same buffer), and so is what the independent numpy reference encoder
(``tests/delta_reference.py``) writes; tables or streams that do not make sense are refused, never
decoded into wrong writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wbridge.protocol import _delta_kernels as kernels
from wbridge.protocol import delta as F
from wbridge.publish.delta import scan

from . import delta_reference as R

PATHS = ("slots", "pairs", "reference")  # encode_slots, encode (a GPU scan's pairs), the numpy reference


def changed(size: int, frac: float, seed: int, ulp: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Two slots of ``size`` bytes; ``frac`` of the 2-byte words differ (by +-1 in the low byte,
    as Adam steps move bf16 words, or by anything)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, size, dtype=np.uint8)
    b = a.copy()
    words = size // 2
    hit = np.flatnonzero(rng.random(words) < frac)
    if ulp:
        step = rng.choice(np.array([1, 255, 2, 254], dtype=np.uint8), len(hit), p=[0.45, 0.45, 0.05, 0.05])
        b[2 * hit] += step
        big = hit[rng.random(len(hit)) < 0.05]  # some words move in both bytes
        b[2 * big + 1] += np.uint8(1)
    else:
        b[2 * hit] = rng.integers(0, 256, len(hit), dtype=np.uint8)
        b[2 * hit + 1] = rng.integers(0, 256, len(hit), dtype=np.uint8)
    if size % 2 and rng.random() < 0.5:
        b[-1] ^= 0x40  # the odd last byte too
    return a, b


def dirty() -> F.Workspace:
    """A workspace that coded another delta before (its arrays hold that one's bytes), as the
    publisher's does from version to version."""
    ws = F.Workspace()
    a, b = changed(1 << 20, 0.9, 99, ulp=False)
    assert F.encode_slots(a, b, F.geometry(len(a)), 1 << 40, ws) is not None
    return ws


def truth(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The changed pairs of ``a`` -> ``b`` and their byte differences, found by the torch scan (a
    GPU's) on the host."""
    found = scan(torch.from_numpy(a), torch.from_numpy(b), 1 << 40)
    assert found is not None
    return found.at.copy(), found.diffs.copy()


def coded(
    a: np.ndarray, b: np.ndarray, path: str = "slots", ws: F.Workspace | None = None
) -> tuple[F.Geometry, np.ndarray, np.ndarray, np.ndarray, F.Parsed]:
    geo = F.geometry(len(a))
    ws = ws or dirty()
    at, diffs = truth(a, b)
    if path == "slots":
        e = F.encode_slots(a, b, geo, 1 << 40, ws)
    elif path == "pairs":
        e = F.encode(at, diffs, geo, ws)
    else:
        e = R.encode(at, diffs, geo, R.Workspace())
    assert e is not None
    # (a publisher declines a delta larger than its buffer; the codec itself has no such limit)
    buf = np.zeros(max(geo.buffer_bytes, F.table_bytes(geo.nchunks) + e.nbytes), np.uint8)
    F.write(buf, e)
    p = F.parse_buffer(buf, geo.nchunks, geo.pairs)
    assert p is not None and p.low_bits == e.low_bits
    return geo, at, diffs, buf, p


def decoded(p: F.Parsed, buf: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Chunks ``lo..hi`` decoded by the library (``decode``, and byte by byte: ``changes``), each
    checked against the numpy reference decoder's result."""
    offsets, lengths = F.ranges(p, np.array([lo]), np.array([hi]))
    pieces = [buf[o : o + n] for o, n in zip(offsets[0], lengths[0])]
    want = R.decode(p, lo, hi, pieces)
    got = F.decode(p, lo, hi, pieces, dirty())
    assert (got is None) == (want is None)
    if got is None:
        return None
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    n = len(got[0])
    pos, values = np.full(4 * n, -1, np.int64), np.zeros(4 * n, np.uint8)
    m = F.changes(p, lo, hi, pieces, pos, values, dirty())
    moved = np.flatnonzero(want[1].reshape(-1))
    assert m == len(moved)
    assert np.array_equal(pos[:m], 4 * want[0][moved // 4] + moved % 4)
    assert np.array_equal(values[:m], want[1].reshape(-1)[moved])
    return want[0].copy(), want[1].copy()


def applied(a: np.ndarray, at: np.ndarray, diffs: np.ndarray) -> np.ndarray:
    out = np.concatenate([a, np.zeros(-len(a) % 4, np.uint8)])
    out.reshape(-1, 4)[at] += diffs
    return out[: len(a)]


@pytest.mark.parametrize("frac", [0.0, 1e-5, 3e-4, 0.003, 0.015, 0.1, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("size", [1, 6, 4093, 300_001, 300_003])
def test_every_change_decodes_back_exactly(size: int, frac: float) -> None:
    for seed, ulp in ((1, True), (2, False)):  # (not ulp: raw bytes and escapes throughout)
        a, b = changed(size, frac, seed, ulp)
        bufs = {}
        for path in PATHS:
            geo, at, diffs, buf, p = coded(a, b, path)
            got = decoded(p, buf, 0, geo.nchunks - 1)
            assert got is not None
            assert np.array_equal(got[0], at) and np.array_equal(got[1], diffs)
            assert np.array_equal(applied(a, *got), b)
            bufs[path] = buf
        # the slot encoder and the pair encoder write the same buffer
        assert np.array_equal(bufs["slots"], bufs["pairs"])


def test_every_elias_fano_width_and_the_bitmap_decode_back_exactly() -> None:
    """Densities from one changed pair in 2**13 to all of them: each low width the encoders choose,
    and the bitmap, decoded back (pairs anywhere: no structure for the positions to exploit)."""
    widths = set()
    for i, frac in enumerate(np.geomspace(1e-4, 1.0, 24)):
        rng = np.random.default_rng(30 + i)
        size = 64 * 8192 + int(rng.integers(0, 4))
        a = rng.integers(0, 256, size, dtype=np.uint8)
        b = a.copy()
        hit = rng.random(size) < frac / 4  # (a pair of four bytes changes at about frac)
        b[hit] += rng.integers(1, 256, int(hit.sum()), dtype=np.uint8)
        for path in PATHS:
            geo, at, diffs, buf, p = coded(a, b, path, ws=F.Workspace())
            got = decoded(p, buf, 0, geo.nchunks - 1)
            assert got is not None and np.array_equal(got[0], at) and np.array_equal(got[1], diffs)
            widths.add(p.low_bits)
    assert 0 in widths and len(widths) >= 8, widths


_KERNEL_RUN = '''
import numpy as np


def kernel_run(kernels, a, b, chunk_pairs):
    """What ``kernels.scan`` and ``kernels.symbols`` (the steps ``kernels.COMPRESS`` and
    ``kernels.PERMUTE`` change) write for slots ``a`` and ``b``, by name (the symbols with a
    dictionary of the 15 most frequent ``k``)."""
    size = len(a)
    pairs, whole = -(-size // 4), size // 4 * 4
    tails = [np.uint64(int.from_bytes(x[whole:].tobytes(), "little")) for x in (a, b)]
    nchunks = -(-pairs // chunk_pairs)
    at, ks = np.zeros(pairs, np.uint32), np.zeros(pairs, np.uint8)
    raw, bitmap = np.zeros(4 * pairs + 64, np.uint8), np.zeros(-(-pairs // 64), np.uint64)
    ptab, rtab = np.zeros(nchunks + 1, np.uint32), np.zeros(nchunks + 1, np.uint32)
    x, y, diffs = a[:whole].view(np.uint32), b[:whole].view(np.uint32), np.zeros(pairs, np.uint32)
    n = kernels.scan(x, y, *tails, int(whole < size), pairs, chunk_pairs // 64, bitmap, at, ks, diffs, raw, ptab, rtab)
    counts = np.bincount(ks[:n], minlength=256)
    lut = np.full(256, 15, np.uint8)
    lut[np.argsort(-counts, kind="stable")[:15]] = np.arange(15)
    sym, esc, etab = np.zeros((n + 1) // 2, np.uint8), np.zeros(n, np.uint8), np.zeros(nchunks + 1, np.uint32)
    ne = kernels.symbols(ks[:n], lut, 15, ptab, sym, esc, etab)
    return {"bitmap": bitmap, "at": at[:n], "ks": ks[:n], "raw": raw[: rtab[-1]], "ptab": ptab, "rtab": rtab,
            "sym": sym, "esc": esc[:ne], "etab": etab}
'''

_OTHER_CPU = '''
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("other_cpu_kernels", sys.argv[1])
kernels = importlib.util.module_from_spec(spec)  # (alone: no wbridge, no torch to import)
spec.loader.exec_module(kernels)
assert not kernels.COMPRESS and kernels.PERMUTE == (sys.argv[5] == "permute"), sys.argv[5]
cases = np.load(sys.argv[2])
out = {}
for i in range(len(cases.files) // 2):
    got = kernel_run(kernels, cases[f"a{i}"], cases[f"b{i}"], int(sys.argv[4]))
    out.update({f"{name}{i}": v for name, v in got.items()})
np.savez(sys.argv[3], **out)
'''


#: What the child processes compile the kernels for: a CPU without vector extensions (the scan
#: walks mask words' set bits) and, where this one has AVX2, an AVX2 one without AVX-512 (the scan
#: packs eight pairs at a time with ``vpermd``). ``NUMBA_CPU_FEATURES`` is what the kernels test.
_CPUS = {
    "walk": ("generic", ""),
    "permute": ("haswell", "+avx,+avx2,+bmi,+bmi2,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sse4.1,+sse4.2,+ssse3"),
}


@pytest.mark.parametrize("cpu", sorted(_CPUS))
def test_the_scans_of_every_cpu_code_alike(tmp_path, cpu: str) -> None:
    """``scan`` compacts vectors of changed pairs and ``symbols`` looks up 64 at a time where the
    CPU has AVX-512 VBMI2 (``kernels.COMPRESS``); with AVX2 alone ``scan`` packs eight at a time
    (``kernels.PERMUTE``); elsewhere they walk mask words' set bits and look up one ``k`` at a
    time. The kernels compiled for another CPU than this one (numba's ``NUMBA_CPU_NAME`` /
    ``NUMBA_CPU_FEATURES``, in a second process: they compile there, the x86 intrinsics left out
    where that CPU lacks them) write what this process's write, array for array."""
    import os
    import subprocess
    import sys

    from numba.core.codegen import get_host_cpu_features

    name, features = _CPUS[cpu]
    if features and not set(features.split(",")) <= set(get_host_cpu_features().split(",")):
        pytest.skip(f"this CPU cannot run code compiled for {name}")
    namespace: dict = {}
    exec(_KERNEL_RUN, namespace)  # (the same code in both processes)
    cases = {}
    for i, (size, frac, ulp) in enumerate(
        [(1, 1.0, True), (4093, 0.3, False), (300_003, 0.015, True), (300_001, 0.1, False), (1 << 18, 0.9, True)]
        + [(70_001, 0.0, True)]
    ):
        cases[f"a{i}"], cases[f"b{i}"] = changed(size, frac, 40 + i, ulp)
    np.savez(tmp_path / "cases.npz", **cases)
    # (a cache of its own: one the child wrote in an earlier run names a module numba cannot import)
    env = dict(os.environ, NUMBA_CPU_NAME=name, NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    argv = [kernels.__file__, str(tmp_path / "cases.npz"), str(tmp_path / "out.npz"), str(F.CHUNK_PAIRS), cpu]
    subprocess.run([sys.executable, "-c", _KERNEL_RUN + _OTHER_CPU, *argv], env=env, check=True, timeout=120)
    other = np.load(tmp_path / "out.npz")
    for i in range(len(cases) // 2):
        got = namespace["kernel_run"](kernels, cases[f"a{i}"], cases[f"b{i}"], F.CHUNK_PAIRS)
        for name, v in got.items():
            assert np.array_equal(v, other[f"{name}{i}"]), (i, name)
        assert np.array_equal(got["at"], truth(cases[f"a{i}"], cases[f"b{i}"])[0])


def test_the_scan_stores_64_bit_indices_as_it_stores_32_bit_ones() -> None:
    """A slot of more than ``2**32`` pairs has its indices held in int64 (``delta._index_dtype``):
    ``scan`` compiled for them (the vector paths widen their lanes) finds what it finds in
    uint32."""
    for i, (size, frac, ulp) in enumerate([(300_003, 0.015, True), (300_001, 0.3, False), (4096, 1.0, True)]):
        a, b = changed(size, frac, 60 + i, ulp)
        pairs, whole = -(-size // 4), size // 4 * 4
        tails = [np.uint64(int.from_bytes(x[whole:].tobytes(), "little")) for x in (a, b)]
        got = []
        for dtype in (np.uint32, np.int64):
            at, ks = np.zeros(pairs, dtype), np.zeros(pairs, np.uint8)
            raw, bitmap = np.zeros(4 * pairs + 64, np.uint8), np.zeros(-(-pairs // 64), np.uint64)
            nchunks = -(-pairs // F.CHUNK_PAIRS)
            ptab, rtab = np.zeros(nchunks + 1, np.uint32), np.zeros(nchunks + 1, np.uint32)
            x, y, diffs = a[:whole].view(np.uint32), b[:whole].view(np.uint32), np.zeros(pairs, np.uint32)
            tail = int(whole < size)
            n = kernels.scan(x, y, *tails, tail, pairs, F.CHUNK_PAIRS // 64, bitmap, at, ks, diffs, raw, ptab, rtab)
            got.append((at[:n].astype(np.int64), ks[:n].copy(), raw[: rtab[-1]].copy(), bitmap.copy()))
        for u, v in zip(*got):
            assert np.array_equal(u, v)
        assert np.array_equal(got[1][0], truth(a, b)[0])


def test_more_changed_pairs_than_allowed_make_no_delta() -> None:
    a, b = changed(300_001, 0.1, 6)
    geo = F.geometry(len(a))
    n = len(truth(a, b)[0])
    assert F.encode_slots(a, b, geo, n - 1) is None
    e = F.encode_slots(a, b, geo, n)
    assert e is not None and e.pairs == n


def test_a_reused_workspace_codes_every_version_alike() -> None:
    """The publisher's workspace holds the last version's arrays: what it codes next does not
    depend on them (a short last pair's bitmap byte, padding, escapes)."""
    ws = dirty()
    for i, (size, frac) in enumerate([(300_001, 0.1), (300_001, 0.3), (300_001, 0.001), (64_005, 0.9)]):
        a, b = changed(size, frac, 10 + i, ulp=i % 2 == 0)
        for path in ("slots", "pairs"):
            _, _, _, buf, p = coded(a, b, path, ws=ws)
            _, _, _, fresh, q = coded(a, b, path, ws=F.Workspace())
            assert np.array_equal(buf, fresh)


def position_bits(n: int, pairs: int, lb: int) -> int:
    """Bits of the positions of ``n`` changed pairs of ``pairs`` at width ``lb`` (0: the bitmap)."""
    return pairs if lb == 0 else -(-pairs // (1 << lb)) + n + 8 * lb * -(-n // F.GROUP)


def test_every_elias_fano_width_is_used_and_chosen_by_size() -> None:
    pairs = 1 << 20
    widths = {F.low_bits_for(n, pairs) for n in (1, 100, 1000, 10_000, 100_000, 200_000, 500_000, pairs)}
    assert {0, 2, F.MAX_LOW_BITS} <= widths and len(widths) >= 6, widths  # (width 1 never beats both)
    for n in (10, 5000, 200_000, 400_000, 700_000):  # the width chosen makes high + low smallest
        sizes = [position_bits(n, pairs, lb) for lb in range(F.MAX_LOW_BITS + 1)]
        assert sizes[F.low_bits_for(n, pairs)] == min(sizes)
    # with slack the bitmap is taken up to that factor over the best width, never beyond
    for n in range(10_000, pairs, 10_000):
        lb = F.low_bits_for(n, pairs, F.BITMAP_SLACK)
        best = min(position_bits(n, pairs, w) for w in range(1, F.MAX_LOW_BITS + 1))
        assert (lb == 0) == (pairs <= F.BITMAP_SLACK * best), n
    assert F.low_bits_for(170_000, pairs, F.BITMAP_SLACK) == 0 and F.low_bits_for(170_000, pairs) != 0


@pytest.mark.parametrize("width", range(1, F.MAX_LOW_BITS + 1))
def test_fields_of_every_width_unpack_from_any_entry(width: int) -> None:
    rng = np.random.default_rng(width)
    values = rng.integers(0, 1 << width, 1001).astype(np.int64)
    packed = R.pack_bits(values, width, dirty())
    assert len(packed) == -(-1001 // F.GROUP) * width  # whole groups of fields
    bits = np.unpackbits(values.astype("<u2").view(np.uint8), bitorder="little").reshape(1001, 16)[:, :width]
    assert np.array_equal(np.unpackbits(packed, bitorder="little")[: 1001 * width], bits.reshape(-1))
    for first in (0, 1, 7, 8, 333, 1000):
        group = first // F.GROUP
        got = R.unpack_bits(packed[group * width :], first % F.GROUP, 1001 - first, width)
        assert np.array_equal(got, values[first:])
    with pytest.raises(ValueError):
        R.unpack_bits(packed[:-1], 0, 1001, width)
    # the compiled encoder's positions at this width: the reference's high bits and low fields
    pairs = 1 << 16
    for n in (1, 7, 8, 1001):
        at = np.sort(rng.choice(pairs, n, replace=False)).astype(np.int64)
        want_high, want_low = R._positions(at, width, pairs, None, R.Workspace())
        high, low = np.full(len(want_high), 0xA5, np.uint8), np.full(len(want_low), 0xA5, np.uint8)
        kernels.positions(at, width, high, low, False)
        assert np.array_equal(high, want_high) and np.array_equal(low, want_low)


def test_a_run_of_chunks_decodes_alone_from_its_own_ranges() -> None:
    a, b = changed(9 * F.CHUNK_BYTES + 1234, 0.02, 3)
    geo, at, diffs, buf, p = coded(a, b)
    for lo, hi in ((0, 0), (2, 4), (5, 5), (8, 9), (3, 9)):
        keep = (at >= lo * F.CHUNK_PAIRS) & (at < (hi + 1) * F.CHUNK_PAIRS)
        got = decoded(p, buf, lo, hi)
        assert got is not None and np.array_equal(got[0], at[keep]) and np.array_equal(got[1], diffs[keep])
    # the ranges of a run stay inside the streams its chunks use
    offsets, lengths = F.ranges(p, np.array([2]), np.array([4]))
    whole_o, whole_n = F.ranges(p, np.array([0]), np.array([geo.nchunks - 1]))
    assert np.all(lengths[0] < whole_n[0]) and np.all(offsets[0] >= whole_o[0])


def test_adam_like_changes_cost_under_two_bytes_per_changed_word() -> None:
    a, b = changed(4 << 20, 0.015, 4)
    geo, at, diffs, buf, p = coded(a, b)
    words = int((a.view(np.uint16) != b.view(np.uint16)).sum())
    e = F.encode(at, diffs, geo)
    assert (e.nbytes + F.table_bytes(geo.nchunks)) / words < 2.0
    assert e.low_bits != 0  # (Elias-Fano at this density; the bitmap where most pairs change)


def test_malformed_tables_and_streams_are_refused() -> None:
    a, b = changed(3 * F.CHUNK_BYTES, 0.05, 5, ulp=False)
    geo, at, diffs, buf, p = coded(a, b)
    bad = buf.copy()
    bad[F.HEADER_BYTES + 4 : F.HEADER_BYTES + 8] = 0xFF  # the second chunk's first pair: past the total
    assert F.parse_buffer(bad, geo.nchunks, geo.pairs) is None
    bad = buf.copy()
    bad[8 * F.LOW_BITS] = 14  # low width 14: beyond what any delta uses
    assert F.parse_buffer(bad, geo.nchunks, geo.pairs) is None
    # a run's own table entries are enough, and a run's entries that decrease are refused
    lo, hi = np.array([1]), np.array([1])
    offsets, lengths = F.table_rows(geo.nchunks, lo, hi)
    entries = np.concatenate([buf[o : o + n] for o, n in zip(offsets, lengths)])
    part = F.parse(buf[: F.HEADER_BYTES], entries, lo, hi, geo.nchunks, geo.pairs)
    assert part is not None and np.array_equal(part.tables[:, 1:3], p.tables[:, 1:3])
    assert np.all(part.tables[:, 0] == -1) and np.all(part.tables[:, 3:] == -1)
    entries[:4] = 0xFF
    assert F.parse(buf[: F.HEADER_BYTES], entries, lo, hi, geo.nchunks, geo.pairs) is None
    # streams that do not make sense, refused by the library's decoder and the reference alike
    deltas = (coded(a, b), coded(*changed(3 * F.CHUNK_BYTES, 0.4, 6, ulp=False)), coded(*changed(1 << 20, 0.05, 7)))
    assert [d[4].low_bits > 0 for d in deltas] == [True, False, True]  # (Elias-Fano, and a bitmap)
    unchanged = 0
    cases = {
        "an escape short": (3, lambda x: x[:-1]),
        "a raw byte short": (4, lambda x: x[:-1]),
        "an escape too many": (3, lambda x: np.append(x, x[:1])),
        "a raw byte too many": (4, lambda x: np.append(x, x[:1])),
        "a symbol byte short": (2, lambda x: x[:-1]),
        "no pair at all in the high bits": (0, np.zeros_like),
        "a pair too many in the high bits": (0, lambda x: np.full_like(x, 0xFF)),
    }
    for geo, _, _, buf, p in deltas:
        offsets, lengths = F.ranges(p, np.array([0]), np.array([geo.nchunks - 1]))
        pieces = [buf[o : o + n].copy() for o, n in zip(offsets[0], lengths[0])]
        assert len(pieces[3]) and len(pieces[4])
        bad = dict(cases)
        if p.low_bits:
            bad["pairs out of order (low fields)"] = (1, np.zeros_like)
            bad["a low field short"] = (1, lambda x: x[:-1])
        plain = np.flatnonzero(pieces[3] & (pieces[3] >> 1) & 0x55 == 0)  # escapes without a raw byte
        if len(plain):  # (one made an unchanged pair: every other stream still adds up)
            unchanged += 1
            bad["an escape of an unchanged pair"] = (
                3,
                lambda x, i=plain[0]: np.where(np.arange(len(x)) == i, F.SAME, x),
            )
        for why, (stream, spoil) in bad.items():
            broken = [x.copy() for x in pieces]
            broken[stream] = spoil(broken[stream])
            assert F.decode(p, 0, geo.nchunks - 1, broken) is None, why
            assert R.decode(p, 0, geo.nchunks - 1, broken) is None, why
    assert unchanged


def test_adding_changes_checks_every_offset_before_writing() -> None:
    dst = np.arange(64, dtype=np.uint8)
    assert F.add(dst, np.array([3, 3, 60], np.int64), np.array([1, 255, 7], np.uint8))
    assert dst[3] == 3 and dst[60] == 67  # (an offset may repeat: both added, mod 256)
    before = dst.copy()
    for bad in (64, -1):
        assert not F.add(dst, np.array([0, 1, bad], np.int64), np.array([1, 1, 1], np.uint8))
        assert np.array_equal(dst, before)  # nothing written
    with pytest.raises(ValueError, match="2 values for 3 offsets"):
        F.add(dst, np.array([0, 1, 2], np.int64), np.array([1, 1], np.uint8))
    assert np.array_equal(dst, before)


def test_changed_bytes_need_room_for_every_pair() -> None:
    a, b = changed(3 * F.CHUNK_BYTES, 0.05, 8)
    geo, at, diffs, buf, p = coded(a, b)
    offsets, lengths = F.ranges(p, np.array([0]), np.array([geo.nchunks - 1]))
    pieces = [buf[o : o + n] for o, n in zip(offsets[0], lengths[0])]
    room = 4 * len(at)
    assert F.changes(p, 0, geo.nchunks - 1, pieces, np.zeros(room, np.int64), np.zeros(room, np.uint8), dirty())
    with pytest.raises(ValueError, match="room for"):
        F.changes(p, 0, geo.nchunks - 1, pieces, np.zeros(room - 1, np.int64), np.zeros(room, np.uint8), dirty())


def test_a_delta_read_whole_is_the_bytes_write_returns() -> None:
    # what a version record carries per ring buffer: a reader of whole slots reads that many bytes
    a, b = changed(5 * F.CHUNK_BYTES + 3, 0.02, 11)
    geo = F.geometry(len(a))
    e = F.encode_slots(a, b, geo, 1 << 40, dirty())
    assert e is not None
    buf = np.full(geo.buffer_bytes, 0xEE, np.uint8)  # (bytes past the extent are not the delta's)
    extent = F.write(buf, e)
    assert extent == F.table_bytes(geo.nchunks) + e.nbytes
    held = buf[:extent].copy()
    lo, hi = np.array([0]), np.array([geo.nchunks - 1])
    per = F.HEADER_BYTES + 12 * (geo.nchunks + 1)
    p = F.parse(held[: F.HEADER_BYTES], held[F.HEADER_BYTES : per], lo, hi, geo.nchunks, geo.pairs)
    assert p is not None
    offsets, lengths = F.ranges(p, lo, hi)
    assert (offsets + lengths).max() <= extent
    at, diffs = F.decode(p, 0, geo.nchunks - 1, [held[o : o + n] for o, n in zip(offsets[0], lengths[0])])
    want_at, want_diffs = truth(a, b)
    assert np.array_equal(at, want_at) and np.array_equal(diffs, want_diffs)


def test_a_delta_read_whole_is_checked_by_its_digest() -> None:
    """What a reader of whole slots reads in one read stands for the delta its publisher wrote only
    where the digest matches: a byte that differs from header word 4 on, or in ``v`` (its seed), fails
    it (a rewrite for a newer version under the read, torn anywhere, or a bit flipped). The magic,
    ``v - 1`` and the state are not in it: the reader checks them as they are, and the state changes
    after the digest is written."""
    from wbridge.protocol import checksum

    a, b = changed(5 * F.CHUNK_BYTES + 3, 0.02, 13)
    geo = F.geometry(len(a))
    buf = np.zeros(geo.buffer_bytes, np.uint8)
    head = buf[: F.HEADER_BYTES].view(np.uint64)
    head[:8] = (F.DELTA_MAGIC, 7, 6, F.DELTA_WRITING, 3, 0, geo.nchunks, 0)
    extent = F.write(buf, F.encode_slots(a, b, geo, 1 << 40, dirty()))
    head[F.STATE] = F.DELTA_STABLE
    assert F.intact(buf[:extent]) is True
    rng = np.random.default_rng(5)
    for at in [8, 32, F.DICT_AT, 8 * F.DIGEST_ALGO, 8 * F.DIGEST, F.HEADER_BYTES + 1, extent - 1]:
        at = int(at) + int(rng.integers(0, 8)) * (at < F.HEADER_BYTES)
        torn = buf[:extent].copy()
        torn[at] ^= 0x10
        assert not F.intact(torn), at
    newer = np.zeros_like(buf)  # the buffer rewritten for v + 2 (other changes): torn between the two
    newer[: F.HEADER_BYTES].view(np.uint64)[:8] = (F.DELTA_MAGIC, 9, 8, F.DELTA_WRITING, 3, 0, geo.nchunks, 0)
    F.write(newer, F.encode_slots(*changed(len(a), 0.02, 14), geo, 1 << 40, dirty()))
    for cut in (32, F.HEADER_BYTES, extent // 2):
        assert not F.intact(np.concatenate((buf[:cut], newer[cut:extent])))
        assert not F.intact(np.concatenate((newer[:cut], buf[cut:extent])))
    settled = buf[:extent].copy()
    settled[: F.HEADER_BYTES].view(np.uint64)[F.STATE] = F.DELTA_NONE
    assert F.intact(settled) is True
    other = buf[:extent].copy()  # a publisher hashing with the other algorithm: not this reader's call
    mine = checksum.ALGOS.index(checksum.ALGO) + 1
    other[: F.HEADER_BYTES].view(np.uint64)[F.DIGEST_ALGO] = 3 - mine
    assert F.intact(other) is None


def _decoded_in_steps(held: np.ndarray, nchunks: int, pairs: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A delta read whole decoded as a reader of some chunks decodes it (``parse``, ``ranges``, the
    streams checked to lie within what was read, ``decode``); None where that refuses it."""
    lo, hi = np.array([0]), np.array([nchunks - 1])
    if len(held) < F.table_bytes(nchunks):
        return None
    p = F.parse(held[: F.HEADER_BYTES], held[F.HEADER_BYTES : F.HEADER_BYTES + 12 * (nchunks + 1)], lo, hi, nchunks,
                pairs)  # fmt: skip
    if p is None:
        return None
    offsets, lengths = F.ranges(p, lo, hi)
    if np.any(offsets < 0) or np.any(lengths < 0) or np.any(offsets + lengths > len(held)):
        return None
    got = F.decode(p, 0, nchunks - 1, [held[o : o + n] for o, n in zip(offsets[0], lengths[0])])
    return None if got is None else (got[0].copy(), got[1].reshape(-1).view(np.uint32).copy())


def test_a_delta_read_whole_decodes_in_one_call_as_in_steps() -> None:
    """``decode_whole`` (what a reader of whole slots calls) takes what the reader of some chunks'
    steps take and refuses what they refuse: deltas of Elias-Fano positions and of a bitmap, a
    short last pair, no change at all; then each with a byte spoiled at 400 places (header fields,
    dictionary, tables, streams) or cut short."""
    rng = np.random.default_rng(21)
    cases = [(5 * F.CHUNK_BYTES + 3, 0.02, True), (3 * F.CHUNK_BYTES, 0.4, False), (70_001, 0.0, True)]
    refused = 0
    for i, (size, frac, ulp) in enumerate(cases):
        a, b = changed(size, frac, 30 + i, ulp)
        geo = F.geometry(size)
        e = F.encode_slots(a, b, geo, 1 << 40, dirty())
        buf = np.zeros(F.table_bytes(geo.nchunks) + e.nbytes, np.uint8)
        extent = F.write(buf, e)
        want_at, want_diffs = truth(a, b)
        variants = [buf[:extent].copy()]
        for _ in range(400):
            v = buf[:extent].copy()
            at = int(rng.integers(0, F.table_bytes(geo.nchunks) if rng.random() < 0.5 else extent))
            v[at] ^= np.uint8(1 << int(rng.integers(0, 8)))
            variants.append(v)
        variants += [buf[: extent - 8].copy(), buf[: F.table_bytes(geo.nchunks) - 8].copy()]
        variants.append(buf[:extent].copy())
        variants[-1][F.DICT_AT + 3] = F.SAME  # (a symbol for the pairs that did not change)
        for j, held in enumerate(variants):
            steps = _decoded_in_steps(held, geo.nchunks, geo.pairs)
            n = F.pairs_of(held) if len(held) >= F.HEADER_BYTES else 0
            if not 0 <= n <= geo.pairs:
                assert steps is None, j
                refused += 1
                continue
            at, diffs = np.zeros(n, np.int64), np.zeros(n, np.uint32)
            ok = F.decode_whole(held, geo.nchunks, geo.pairs, at, diffs, dirty())
            assert ok == (steps is not None), (i, j)
            refused += not ok
            if ok:
                assert np.array_equal(at, steps[0]) and np.array_equal(diffs, steps[1]), (i, j)
            if j == 0:
                assert ok and np.array_equal(at, want_at)
                assert np.array_equal(diffs.view(np.uint8).reshape(-1, 4), want_diffs)
    assert refused > 100  # (the spoiled bytes in the streams' payload decode, as they do in steps)


def test_pairs_are_added_where_each_read_lands() -> None:
    # reads that start and end on odd bytes, a gap no read covers, destinations anywhere in memory
    a, b = changed(3 * F.CHUNK_BYTES + 1, 0.1, 12, ulp=False)
    cuts = np.array([0, 7, 40_001, 40_002, 70_001, 90_000, len(a)], np.int64)
    for c in cuts[1:-1]:
        b[c - 2 : c + 2] += np.uint8(1)  # every byte of the pairs across the reads' edges changes
    at, diffs = truth(a, b)
    soff, end = cuts[:-1].copy(), cuts[1:].copy()
    end[2] -= 1  # slot byte 40_001 is no read's: it stays as it was
    rng = np.random.default_rng(5)
    dests = [rng.integers(0, 256, e - s, dtype=np.uint8) for s, e in zip(soff, end)]
    want = [d.copy() for d in dests]
    for d, s, e in zip(want, soff, end):
        d += b[s:e] - a[s:e]  # (mod 256)
    addr = np.array([d.ctypes.data for d in dests], np.int64)
    F.add_pairs(at, diffs.reshape(-1).view(np.uint32), soff, end, addr)
    assert all(np.array_equal(d, w) for d, w in zip(dests, want))
    F.add_pairs(at[:0], diffs.reshape(-1).view(np.uint32)[:0], soff, end, addr)  # nothing to add
    assert all(np.array_equal(d, w) for d, w in zip(dests, want))
