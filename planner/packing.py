"""Reader-ordered staging: a publisher's staging slot laid out so each reader's bytes are contiguous.

In the staged modes a publisher copies its tensors into a staging slot once per version. Where
trainer and rollout split a tensor differently (row-parallel ``o_proj`` split by columns 8 ways on
one side and 16 on the other, say), reading the rollout's part straight out of the trainer's
layout takes one read per row. ``pack_staging`` instead lays the slot out for the reader layouts
that read from this publisher rank (one per rollout TP rank, typically):

* every source piece is cut along the boundaries of the reader boxes that intersect it; each cut
  (*cell*) is stored dense, row-major, so a reader box is a few contiguous cells, not one run per
  row. A source tensor no reader cuts is stored verbatim (its own internal layout);
* cells and verbatim tensors are placed in the order the first reader needing them holds them
  (its region and address), so neighbours in the reader are neighbours in the slot and coalesce
  into one read (a rollout ``w13`` stack of experts reads as one run per source rank);
* every mapped source byte is stored exactly once, bytes several readers need included, and bytes
  no known reader needs too (after the readers' cells, in source order), so a reader that joins
  later can still plan ordinary reads against the slot;
* when the readers need nothing reordered (a reader layout equal to the trainer's) the slot is the
  plain packed layout and ``identity`` is set: the copy is the ordinary snapshot copy.

The slot is described as a ``RankLayout``, so the ordinary planner plans against it. The
publisher's copy program (``PackedStaging.copies``) and the subscriber's scatter program
(``PackedPlan.scatter``) are ``StridedCopies``: numpy columns of box copies, one strided copy per
cell (never one per row); ``copy_boxes`` executes them on byte buffers.

``build_packed_plans`` plans subscribers against packed slots: a chunk contiguous in the slot
but strided in the subscriber's tensor is read whole into a receive buffer (one region past the
subscriber's own) and scattered locally; everything else is read in place.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .boxes import any_overlap, grid_cells, subtract
from .builder import DEFAULT_MIN_SPLIT_BYTES, _build_plans, build_plans
from .chunks import _chunks_for, _group_identical, _source_classes, _SourceIndex
from .dtypes import itemsize as _itemsize
from .errors import PlanError
from .layout import Box, LocalTensor, Piece, RankLayout, row_major_strides
from .plan import Plan, freeze_columns, frozen_int64
from .runs import box_geometry, box_runs

ALIGN = 64  # byte alignment of every cell and tensor in a slot and a receive buffer

Geometry = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]  # runs.box_geometry's result


@dataclass(frozen=True, eq=False)
class StridedCopies:
    """Box copies between byte buffers, as read-only ``int64`` columns (``n`` copies).

    Copy ``i`` moves, for every index ``j`` of ``shape[i]`` (row-major), ``run[i]`` bytes from byte
    ``src_offset[i] + j . src_strides[i]`` of source buffer ``src_region[i]`` to byte
    ``dst_offset[i] + j . dst_strides[i]`` of destination buffer ``dst_region[i]``. ``shape`` and
    the strides are ``(n, k)`` (padded with size 1, stride 0); strides are in bytes.
    """

    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    run: np.ndarray
    shape: np.ndarray
    src_strides: np.ndarray
    dst_strides: np.ndarray

    def __post_init__(self) -> None:
        n = freeze_columns(self, ("src_region", "src_offset", "dst_region", "dst_offset", "run"), "strided copies")
        for name in ("shape", "src_strides", "dst_strides"):
            a = frozen_int64(getattr(self, name))
            object.__setattr__(self, name, a.reshape(n, -1) if a.size else a.reshape(n, 0))
        if not self.shape.shape == self.src_strides.shape == self.dst_strides.shape:
            raise PlanError("strided copies: columns of different lengths")

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int, int, int, Geometry]]) -> StridedCopies:
        """From ``(src_region, src_offset, dst_region, dst_offset, runs.box_geometry(...))`` rows."""
        k = max((len(g[0]) for *_, g in rows), default=0)
        pad = [(1,) * (k - len(g[0])) for *_, g in rows]
        zero = [(0,) * (k - len(g[0])) for *_, g in rows]
        return cls(
            np.array([r[0] for r in rows], dtype=np.int64),
            np.array([r[1] for r in rows], dtype=np.int64),
            np.array([r[2] for r in rows], dtype=np.int64),
            np.array([r[3] for r in rows], dtype=np.int64),
            np.array([r[4][3] for r in rows], dtype=np.int64),
            np.array([p + r[4][0] for r, p in zip(rows, pad)], dtype=np.int64).reshape(len(rows), k),
            np.array([z + r[4][1] for r, z in zip(rows, zero)], dtype=np.int64).reshape(len(rows), k),
            np.array([z + r[4][2] for r, z in zip(rows, zero)], dtype=np.int64).reshape(len(rows), k),
        )

    def __len__(self) -> int:
        return len(self.run)

    @property
    def total_bytes(self) -> int:
        return int((self.run * self.shape.prod(axis=1)).sum())

    def rows(self):
        """``(src_region, src_offset, dst_region, dst_offset, run, shape, src_strides, dst_strides)``
        per copy as Python values, for an executor's one call per box."""
        return zip(
            self.src_region.tolist(),
            self.src_offset.tolist(),
            self.dst_region.tolist(),
            self.dst_offset.tolist(),
            self.run.tolist(),
            self.shape.tolist(),
            self.src_strides.tolist(),
            self.dst_strides.tolist(),
        )

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        """One past the last byte each copy touches, on the source and on the destination side."""
        top = np.maximum(self.shape - 1, 0)
        return (
            self.src_offset + (top * self.src_strides).sum(axis=1) + self.run,
            self.dst_offset + (top * self.dst_strides).sum(axis=1) + self.run,
        )


def check_boxes(copies: StridedCopies, src_lens: Sequence[int], dst_lens: Sequence[int]) -> None:
    """Raises ``PlanError`` naming the first copy of ``copies`` that would run outside its buffers
    (source buffer ``i`` holding ``src_lens[i]`` bytes, destination buffer ``j`` ``dst_lens[j]``)."""
    if not len(copies):
        return
    s_end, d_end = copies.extents()
    s_len = np.array([src_lens[r] if 0 <= r < len(src_lens) else -1 for r in copies.src_region.tolist()])
    d_len = np.array([dst_lens[r] if 0 <= r < len(dst_lens) else -1 for r in copies.dst_region.tolist()])
    bad = np.flatnonzero((s_end > s_len) | (d_end > d_len) | (copies.src_offset < 0) | (copies.dst_offset < 0))
    if len(bad):
        i = int(bad[0])
        raise PlanError(
            f"box copy {i} (source buffer {int(copies.src_region[i])} bytes {int(copies.src_offset[i])}:"
            f"{int(s_end[i])}, destination buffer {int(copies.dst_region[i])} bytes {int(copies.dst_offset[i])}:"
            f"{int(d_end[i])}) runs outside its buffers"
        )


def copy_boxes(copies: StridedCopies, src: Sequence[np.ndarray], dst: Sequence[np.ndarray]) -> None:
    """Executes ``copies`` on ``uint8`` buffers: one strided numpy copy per box (never per row).

    Raises ``PlanError`` naming the copy if one would run outside its buffers (``check_boxes``).
    """
    check_boxes(copies, [len(b) for b in src], [len(b) for b in dst])
    for sr, so, dr, do, run, shape, ss, ds in copies.rows():
        s = as_strided(src[sr][so:], shape=(*shape, run), strides=(*ss, 1), writeable=False)
        d = as_strided(dst[dr][do:], shape=(*shape, run), strides=(*ds, 1))
        np.copyto(d, s)


@dataclass(frozen=True, eq=False)
class PackedStaging:
    """A publisher rank's staging slot laid out for its readers (see the module docstring).

    ``layout``: the slot as a ``RankLayout`` (the publisher's rank; every tensor in region 0).
    ``copies``: the snapshot copy; source buffer ``i`` is the publisher's local tensor
    ``source.tensors[i]`` (byte offsets from its start), destination buffer 0 is the slot;
    sorted by source tensor.
    ``identity``: the slot is the publisher's own packed layout (nothing reordered).
    """

    layout: RankLayout
    copies: StridedCopies
    identity: bool


class _ReaderIndex:
    """Reader boxes per canonical tensor: ``(lo, hi, reader, region, byte address, strides, itemsize)``."""

    def __init__(self, readers: Sequence[RankLayout]) -> None:
        self.count = len(readers)
        self.by_tensor: dict[str, list[tuple]] = {}
        for ri, lay in enumerate(readers):
            for t in lay.tensors:
                isz = _itemsize(t.dtype)
                for p in t.pieces:
                    if all(p.box.sizes):
                        self.by_tensor.setdefault(p.tensor, []).append(
                            (p.box.offsets, p.box.ends, ri, t.region, t.offset + p.offset * isz, p.strides, isz)
                        )

    def hits(self, name: str, lo: tuple[int, ...], hi: tuple[int, ...]) -> list[tuple]:
        """Reader boxes meeting ``[lo, hi)``: ``(xlo, xhi, reader, region, address of xlo, strides, isz)``."""
        out = []
        for rlo, rhi, ri, region, addr, strides, isz in self.by_tensor.get(name, ()):
            xlo = tuple(map(max, lo, rlo))
            xhi = tuple(map(min, hi, rhi))
            if all(a < b for a, b in zip(xlo, xhi)):
                at = addr + sum((a - b) * s for a, b, s in zip(xlo, rlo, strides)) * isz
                out.append((xlo, xhi, ri, region, at, strides, isz))
        return out


def _cells(lo: tuple[int, ...], hi: tuple[int, ...], hits: list[tuple]) -> list[tuple[tuple, tuple, tuple]]:
    """The cells a source box ``[lo, hi)`` is cut into for the readers ``hits``: ``(lo, hi, key)``,
    ``key`` being the first reader holding the cell and the cell's address there."""
    first: dict[tuple, tuple] = {}  # distinct reader boxes -> the hit of the first reader
    for h in hits:
        k = (h[0], h[1])
        if k not in first or h[2:5] < first[k][2:5]:
            first[k] = h
    boxes = list(first.values())
    out = []
    xlo = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), len(lo))
    xhi = np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), len(lo))
    if any_overlap(xlo, xhi):  # reader boxes overlap partially: store their common cells once
        for c_lo, c_hi, covers in grid_cells(xlo, xhi):
            keys = []
            for i in covers.tolist():
                b = boxes[i]
                at = b[4] + int(np.dot(c_lo - xlo[i], b[5])) * b[6]
                keys.append((b[2], b[3], at))
            out.append((tuple(c_lo.tolist()), tuple(c_hi.tolist()), min(keys)))
    else:
        out = [(b[0], b[1], (b[2], b[3], b[4])) for b in boxes]
    return out


def _pack(source: RankLayout, index: _ReaderIndex, align: int) -> PackedStaging:
    hits_of = []  # per tensor, per piece: the reader boxes meeting it
    need: dict[int, int] = {}  # bytes each reader needs from this rank
    for t in source.tensors:
        isz = _itemsize(t.dtype)
        per_piece = []
        for p in t.pieces:
            hits = index.hits(p.tensor, p.box.offsets, p.box.ends) if all(p.box.sizes) else []
            per_piece.append(hits)
            for h in hits:
                need[h[2]] = need.get(h[2], 0) + math.prod(b - a for a, b in zip(h[0], h[1])) * isz
        hits_of.append(per_piece)
    # Bytes several readers need follow the order of the one needing most from this rank (a
    # reader equal to this rank's layout keeps it in place: ``identity``).
    prio = {r: i for i, r in enumerate(sorted(need, key=lambda r: (-need[r], r)))}
    items = []  # (key, tensor index, piece index or -1 for verbatim, cell lo, cell hi)
    for ti, (t, per_piece) in enumerate(zip(source.tensors, hits_of)):
        isz = _itemsize(t.dtype)
        cut = False
        tkey = None
        for p, hits in zip(t.pieces, per_piece):
            for h in hits:
                cut |= h[0] != p.box.offsets or h[1] != p.box.ends
                key = (prio[h[2]], h[3], h[4] - p.offset * isz)  # the reader's address of the tensor start
                tkey = key if tkey is None or key < tkey else tkey
        if not cut:
            items.append((tkey if tkey is not None else (index.count, t.region, t.offset), ti, -1, (), ()))
            continue
        for pi, (p, hits) in enumerate(zip(t.pieces, per_piece)):
            lo, hi = p.box.offsets, p.box.ends
            if not all(p.box.sizes):
                continue
            cells = _cells(lo, hi, [(*h[:2], prio[h[2]], *h[3:]) for h in hits]) if hits else []
            for clo, chi, key in cells:
                items.append((key, ti, pi, clo, chi))
            for blo, bhi in subtract(lo, hi, [(c[0], c[1]) for c in cells]):
                at = t.offset + (p.offset + sum((a - b) * s for a, b, s in zip(blo, lo, p.strides))) * isz
                items.append(((index.count, t.region, at), ti, pi, blo, bhi))
    items.sort(key=lambda x: (x[0], x[1], x[2], x[3]))
    tensors: list[LocalTensor] = []
    rows = []
    pos = 0
    follows = None  # the key an item continuing the previous one in its reader would have
    for key, ti, pi, clo, chi in items:
        t = source.tensors[ti]
        isz = _itemsize(t.dtype)
        if key != follows:  # neighbours in the reader stay neighbours here: no alignment gap
            pos = -(-pos // align) * align
        if pi < 0:
            tensors.append(LocalTensor(t.name, t.shape, t.dtype, 0, pos, t.pieces))
            rows.append((ti, 0, 0, pos, ((), (), (), t.nbytes)))
            pos += t.nbytes
            follows = (*key[:2], key[2] + t.nbytes)
            continue
        p = t.pieces[pi]
        sizes = tuple(b - a for a, b in zip(clo, chi))
        dense = row_major_strides(sizes)
        piece = Piece(p.tensor, Box(clo, sizes), 0, dense)
        tensors.append(LocalTensor(f"{t.name}#{p.tensor}{clo}", sizes, t.dtype, 0, pos, (piece,)))
        src = (p.offset + sum((a - b) * s for a, b, s in zip(clo, p.box.offsets, p.strides))) * isz
        rows.append((ti, src, 0, pos, box_geometry(sizes, p.strides, dense, isz)))
        pos += math.prod(sizes) * isz
        follows = (*key[:2], key[2] + math.prod(sizes) * isz)
    rows.sort(key=lambda r: (r[0], r[3]))
    layout = RankLayout(source.rank, tuple(tensors), source.specs, (pos,) if tensors else ())
    identity = layout.tensors == source.tensors and layout.region_sizes == source.region_sizes
    return PackedStaging(layout, StridedCopies.of(rows), identity)


def pack_staging(source: RankLayout, readers: Sequence[RankLayout], *, align: int = ALIGN) -> PackedStaging:
    """The staging slot of publisher layout ``source`` laid out for the distinct reader layouts
    ``readers`` (their order sets whose order shared bytes follow)."""
    return _pack(source, _ReaderIndex(readers), align)


def pack_stagings(
    sources: Sequence[RankLayout], readers: Sequence[RankLayout], *, align: int = ALIGN
) -> dict[int, PackedStaging]:
    """``pack_staging`` for many publisher ranks; identical layouts (DP replicas) are packed once
    and share the result, so their slots stay identical and the planner still balances over them."""
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as build_plans does: many small acyclic objects
    try:
        index = _ReaderIndex(readers)
        out: dict[int, PackedStaging] = {}
        for same in _group_identical(sources):
            ps = _pack(same[0], index, align)
            for s in same:
                lay = RankLayout(s.rank, ps.layout.tensors, ps.layout.specs, ps.layout.region_sizes)
                out[s.rank] = PackedStaging(lay, ps.copies, ps.identity)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {r: out[r] for r in sorted(out)}


@dataclass(frozen=True, eq=False)
class PackedPlan:
    """A subscriber's reads against packed staging slots, and its local scatter.

    ``plan``: the reads; destination region ``recv_region`` is the receive buffer.
    ``recv_region``: one past the subscriber's own regions.
    ``recv_bytes``: size of the receive buffer (0: every read lands in place).
    ``scatter``: box copies from buffer ``recv_region`` into the subscriber's regions, run after
    the reads (execute with ``copy_boxes(scatter, regions + [recv], regions)``).
    """

    plan: Plan
    recv_region: int
    recv_bytes: int
    scatter: StridedCopies


def _receive_layout(
    index: _SourceIndex, dest: RankLayout, transforms: Mapping[str, str]
) -> tuple[RankLayout, StridedCopies] | None:
    """``(receiving layout, scatter)`` of ``dest``: ``dest`` with the chunks that are contiguous in
    a slot but strided in ``dest`` moved to a dense receive region; None if ``dest`` has errors."""
    missing: dict[str, list[int]] = {}
    partial: list[str] = []
    ch = _chunks_for(index, dest, transforms, missing, partial)
    if missing or partial:
        return None
    recv_region = len(dest.region_sizes)
    direct: dict[tuple[int, int], list[int]] = {}
    indirect: list[tuple[tuple, int]] = []
    for i, g in enumerate(ch.group):
        region, base, strides = g.addrs[0]
        sizes, isz = ch.sizes[i], ch.itemsize[i]
        if len(box_runs(sizes, strides, ch.dst_strides[i], isz)[0]) > 1:
            if len(box_runs(sizes, strides, row_major_strides(sizes), isz)[0]) == 1:
                at = base + sum(d * s for d, s in zip(ch.delta[i], strides)) * isz
                indirect.append(((g.ranks[0], region, at), i))
                continue
        direct.setdefault(ch.piece[i], []).append(i)
    if not indirect:
        return dest, StridedCopies.of([])
    indirect.sort()
    recv: dict[tuple[int, int], list[LocalTensor]] = {}
    rows = []
    pos = 0
    moved = set()
    follows = None
    for key, i in indirect:
        ti, pi = ch.piece[i]
        moved.add((ti, pi))
        t = dest.tensors[ti]
        p = t.pieces[pi]
        sizes, isz = ch.sizes[i], ch.itemsize[i]
        lo = tuple(a + d for a, d in zip(ch.group[i].offsets, ch.delta[i]))
        dense = row_major_strides(sizes)
        if key != follows:  # chunks back to back in a slot stay back to back: one read
            pos = -(-pos // ALIGN) * ALIGN
        follows = (*key[:2], key[2] + ch.nbytes[i])
        rt = LocalTensor(
            f"{t.name}#recv{p.tensor}{lo}",
            sizes,
            t.dtype,
            recv_region,
            pos,
            (Piece(p.tensor, Box(lo, sizes), 0, dense),),
        )
        recv.setdefault((ti, pi), []).append(rt)
        rows.append((recv_region, pos, t.region, ch.dst_base[i], box_geometry(sizes, dense, p.strides, isz)))
        pos += math.prod(sizes) * isz
    tensors: list[LocalTensor] = []
    for ti, t in enumerate(dest.tensors):
        if not any((ti, pi) in moved for pi in range(len(t.pieces))):
            tensors.append(t)
            continue
        pieces = []
        for pi, p in enumerate(t.pieces):
            if (ti, pi) not in moved:
                pieces.append(p)
                continue
            for i in direct.get((ti, pi), ()):
                lo = tuple(a + d for a, d in zip(ch.group[i].offsets, ch.delta[i]))
                off = p.offset + sum((a - b) * s for a, b, s in zip(lo, p.box.offsets, p.strides))
                pieces.append(Piece(p.tensor, Box(lo, ch.sizes[i]), off, p.strides))
        tensors.append(LocalTensor(t.name, t.shape, t.dtype, t.region, t.offset, tuple(pieces)))
    tensors += [rt for ti in sorted(recv) for rt in recv[ti]]
    lay = RankLayout(dest.rank, tuple(tensors), dest.specs, (*dest.region_sizes, pos))
    return lay, StridedCopies.of(rows)


def build_packed_plans(
    stagings: Sequence[PackedStaging | RankLayout],
    dests: Sequence[RankLayout],
    *,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
    transforms: Mapping[str, str] | None = None,
) -> dict[int, PackedPlan]:
    """Plans every rank in ``dests`` against the slots ``stagings`` (packed or plain layouts):
    ``build_plans`` on receiving layouts (see ``PackedPlan``), so every mapped destination byte is
    read exactly once, into place or into the receive buffer, balanced over identical slots.
    Raises ``PlanError`` as ``build_plans`` does."""
    sources = sorted((s.layout if isinstance(s, PackedStaging) else s for s in stagings), key=lambda s: s.rank)
    transforms = dict(transforms or {})
    classes = _source_classes(sources)
    index = _SourceIndex(sources, sorted(set(classes.values())))
    receivers: list[RankLayout] = []
    extra: dict[int, tuple[int, int, StridedCopies]] = {}
    for same in _group_identical(list(dests)):
        got = _receive_layout(index, same[0], transforms)
        if got is None:  # missing bytes or bad specs: let the ordinary planner name them
            build_plans(sources, dests, min_split_bytes=min_split_bytes, transforms=transforms)
            raise PlanError("destination bytes without a source")  # build_plans raised already
        lay, scatter = got
        recv_bytes = lay.region_sizes[-1] if lay is not same[0] else 0
        for d in same:
            receivers.append(RankLayout(d.rank, lay.tensors, lay.specs, lay.region_sizes))
            extra[d.rank] = (len(d.region_sizes), recv_bytes, scatter)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as build_plans does: millions of acyclic objects
    try:
        plans = _build_plans(
            sources,
            receivers,
            min_split_bytes=min_split_bytes,
            transforms=transforms,
            lone=False,
            indexed=(classes, index),
        )
    finally:
        if gc_was_enabled:
            gc.enable()
    return {r: PackedPlan(p, *extra[r]) for r, p in plans.items()}
