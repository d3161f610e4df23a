"""Chunks: source and destination layouts intersected into boxes with their candidate sources.

1. *Source index* (``_SourceIndex``). Source pieces are grouped per canonical tensor by identical
   box: a group is one box and every rank holding it (DP replicas), each with its address (region,
   byte base, element strides). If distinct boxes of one tensor partially overlap, that tensor's
   boxes are cut along all their boundaries into disjoint cells first, each cell held by the union
   of its covers.
2. *Chunks* (``_chunks_for``). Each destination piece is intersected with the groups of its
   tensor; an intersection is a chunk (a box with its destination address and its candidate
   source ranks, the group's ranks). Bad specs and bytes no source holds are collected for the
   caller to report.
3. *Reads* (``_emit``). Chunk byte ranges assigned to source ranks turn into byte runs with
   ``runs.box_runs`` (whole rows collapse into one run), coalesced per source rank.

Layouts identical but for their rank (``_group_identical``: DP replicas among sources, rollout
replicas among destinations) are indexed and intersected once. ``builder`` decides which source
serves which chunk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .boxes import any_overlap, grid_cells
from .dtypes import itemsize as _itemsize
from .errors import PlanError
from .layout import LocalTensor, RankLayout, TensorSpec
from .plan import SourceOps
from .runs import box_runs, coalesce

Addr = tuple[int, int, tuple[int, ...]]  # (region, byte offset of the box origin, element strides)


class _Group:
    """One disjoint box of a canonical tensor and the source ranks holding exactly its bytes."""

    __slots__ = ("_entries", "addrs", "offsets", "rank_addr", "ranks", "sizes")

    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        self.offsets = offsets
        self.sizes = sizes
        self.addrs: list[Addr] = []
        self.rank_addr: dict[int, int] | None = None  # None: every rank uses addrs[0]
        self.ranks: tuple[int, ...] = ()
        self._entries: list[tuple[tuple[int, ...], Addr]] = []

    def add(self, ranks: tuple[int, ...], addr: Addr) -> None:
        """``ranks`` (sorted) hold the box at ``addr``; call ``finish`` after the last ``add``."""
        self._entries.append((ranks, addr))

    def finish(self) -> None:
        entries, self._entries = self._entries, []
        if len(entries) == 1:
            self.ranks, addr = entries[0]
            self.addrs = [addr]
            return
        rank_addr: dict[int, int] = {}
        addrs: list[Addr] = []
        for ranks, addr in entries:
            try:
                k = addrs.index(addr)
            except ValueError:
                k = len(addrs)
                addrs.append(addr)
            for r in ranks:
                rank_addr.setdefault(r, k)  # a rank holding the same box twice: either copy will do
        self.addrs = addrs
        self.rank_addr = rank_addr if len(addrs) > 1 else None
        self.ranks = tuple(sorted(rank_addr))

    def addr_of(self, rank: int) -> Addr:
        return self.addrs[0] if self.rank_addr is None else self.addrs[self.rank_addr[rank]]


@dataclass
class _TensorIndex:
    spec: TensorSpec
    owner: int  # a source rank that declared the spec (for error messages)
    itemsize: int
    groups: list[_Group]
    lo: np.ndarray | None  # (groups, ndim) box starts, for tensors with many groups
    hi: np.ndarray | None  # (groups, ndim) box ends


def _local_spec(side: str, rank: int, smap: Mapping[str, TensorSpec], t: LocalTensor, name: str) -> TensorSpec:
    sp = smap.get(name)
    if sp is None:
        raise PlanError(f"{side} rank {rank}: local tensor {t.name!r} holds {name!r} but the layout has no spec for it")
    if sp.dtype != t.dtype:
        raise PlanError(
            f"{side} rank {rank}: local tensor {t.name!r} is {t.dtype} but holds {name!r} of dtype {sp.dtype}"
        )
    return sp


class _SourceIndex:
    def __init__(self, sources: Sequence[RankLayout], classes: Sequence[tuple[int, ...]]) -> None:
        self.layouts = {s.rank: s for s in sources}
        specs: dict[str, tuple[TensorSpec, int]] = {}
        boxes: dict[str, dict[tuple, _Group]] = {}
        for ranks in classes:  # identical layouts: index one, add every rank of the class
            lay = self.layouts[ranks[0]]
            for sp in lay.specs:
                prev = specs.get(sp.name)
                if prev is None:
                    specs[sp.name] = (sp, lay.rank)
                elif prev[0] != sp:
                    raise PlanError(
                        f"canonical {sp.name!r} is {prev[0].shape}/{prev[0].dtype} on source "
                        f"rank {prev[1]} but {sp.shape}/{sp.dtype} on source rank {lay.rank}"
                    )
            smap = lay.spec_map()
            for t in lay.tensors:
                isz = _itemsize(t.dtype)
                for p in t.pieces:
                    sp = smap.get(p.tensor)
                    if sp is None or sp.dtype != t.dtype:
                        _local_spec("source", lay.rank, smap, t, p.tensor)
                    box = p.box
                    if not all(box.sizes):
                        continue
                    key = (box.offsets, box.sizes)
                    per = boxes.get(p.tensor)
                    if per is None:
                        per = boxes[p.tensor] = {}
                    g = per.get(key)
                    if g is None:
                        g = per[key] = _Group(box.offsets, box.sizes)
                    g.add(ranks, (t.region, t.offset + p.offset * isz, p.strides))
        self.tensors: dict[str, _TensorIndex] = {}
        for name, (sp, owner) in specs.items():
            groups = list(boxes.get(name, {}).values())
            for g in groups:
                g.finish()
            isz = _itemsize(sp.dtype)
            lo = hi = None
            if len(groups) > 1:
                groups.sort(key=lambda g: (g.offsets, g.sizes))
                lo, hi = _bounds(groups, len(sp.shape))
                if any_overlap(lo, hi):
                    groups = _refine(groups, lo, hi, isz)
                    lo, hi = _bounds(groups, len(sp.shape))
            self.tensors[name] = _TensorIndex(sp, owner, isz, groups, lo, hi)


def _bounds(groups: list[_Group], nd: int) -> tuple[np.ndarray, np.ndarray]:
    lo = np.array([g.offsets for g in groups], dtype=np.int64).reshape(len(groups), nd)
    return lo, lo + np.array([g.sizes for g in groups], dtype=np.int64).reshape(len(groups), nd)


def _refine(groups: list[_Group], lo: np.ndarray, hi: np.ndarray, isz: int) -> list[_Group]:
    """Cuts partially overlapping boxes along all their boundaries into disjoint cells."""
    out: list[_Group] = []
    for c_lo, c_hi, covers in grid_cells(lo, hi):
        ng = _Group(tuple(int(x) for x in c_lo), tuple(int(x) for x in c_hi - c_lo))
        for gi in covers:
            g = groups[gi]
            delta = c_lo - lo[gi]
            for rank in g.ranks:
                region, base, strides = g.addr_of(rank)
                ng.add((rank,), (region, base + int(np.dot(delta, strides)) * isz, strides))
        ng.finish()
        out.append(ng)
    return out


@dataclass
class _Chunks:
    """The intersections of one destination layout with the source groups, column-wise."""

    nbytes: list[int] = field(default_factory=list)
    group: list[_Group] = field(default_factory=list)
    delta: list[tuple[int, ...]] = field(default_factory=list)  # chunk origin - group origin
    sizes: list[tuple[int, ...]] = field(default_factory=list)
    dst_region: list[int] = field(default_factory=list)
    dst_base: list[int] = field(default_factory=list)
    dst_strides: list[tuple[int, ...]] = field(default_factory=list)
    itemsize: list[int] = field(default_factory=list)
    piece: list[tuple[int, int]] = field(default_factory=list)  # (local tensor, piece) of the destination
    needed: int = 0


def _check_dest_spec(
    index: _SourceIndex, dest: RankLayout, sp: TensorSpec, transforms: Mapping[str, str], missing: dict[str, list[int]]
) -> _TensorIndex | None:
    ti = index.tensors.get(sp.name)
    if ti is None or not ti.groups:
        missing.setdefault(sp.name, []).append(dest.rank)
        return None
    if ti.spec.shape != sp.shape:
        raise PlanError(
            f"{sp.name!r}: shape {sp.shape} on destination rank {dest.rank} but "
            f"{ti.spec.shape} on source rank {ti.owner}"
        )
    if ti.spec.dtype != sp.dtype:
        if sp.name in transforms:
            raise PlanError(
                f"{sp.name!r}: transform {transforms[sp.name]!r} ({ti.spec.dtype} on source rank "
                f"{ti.owner} -> {sp.dtype} on destination rank {dest.rank}) is named, but the "
                f"planner cannot execute dtype transforms yet"
            )
        raise PlanError(
            f"{sp.name!r}: dtype {ti.spec.dtype} on source rank {ti.owner} but {sp.dtype} on "
            f"destination rank {dest.rank}; a dtype change must be a named transform"
        )
    return ti


def _chunks_for(
    index: _SourceIndex,
    dest: RankLayout,
    transforms: Mapping[str, str],
    missing: dict[str, list[int]],
    partial: list[str],
) -> _Chunks:
    ch = _Chunks()
    smap = dest.spec_map()
    checked: dict[str, _TensorIndex | None] = {}
    for li, t in enumerate(dest.tensors):
        isz = _itemsize(t.dtype)
        for pi, p in enumerate(t.pieces):
            if not all(p.box.sizes):
                continue
            ti = checked.get(p.tensor, False)
            sp = smap.get(p.tensor)
            if ti is False or sp is None or sp.dtype != t.dtype:
                sp = _local_spec("destination", dest.rank, smap, t, p.tensor)
                ti = checked[p.tensor] = _check_dest_spec(index, dest, sp, transforms, missing)
            if ti is None:
                continue
            numel = p.box.numel
            ch.needed += numel * isz
            bo, bs = p.box.offsets, p.box.sizes
            if len(ti.groups) == 1 and ti.groups[0].offsets == bo and ti.groups[0].sizes == bs:
                ch.nbytes.append(numel * isz)  # the common case: the source holds exactly this box
                ch.group.append(ti.groups[0])
                ch.delta.append((0,) * len(bo))
                ch.sizes.append(bs)
                ch.dst_region.append(t.region)
                ch.dst_base.append(t.offset + p.offset * isz)
                ch.dst_strides.append(p.strides)
                ch.itemsize.append(isz)
                ch.piece.append((li, pi))
                continue
            if ti.lo is None or len(ti.groups) <= 16:
                hits = ti.groups
            else:
                dlo = np.asarray(bo, dtype=np.int64)
                dhi = dlo + np.asarray(bs, dtype=np.int64)
                hits = [ti.groups[i] for i in np.flatnonzero(np.all((ti.lo < dhi) & (ti.hi > dlo), axis=1))]
            covered = 0
            for g in hits:
                ilo = tuple(map(max, bo, g.offsets))
                sizes = tuple(min(a + s, b + z) - l for a, s, b, z, l in zip(bo, bs, g.offsets, g.sizes, ilo))
                if min(sizes, default=1) <= 0:
                    continue
                n = math.prod(sizes)
                covered += n
                ch.nbytes.append(n * isz)
                ch.group.append(g)
                ch.delta.append(tuple(a - b for a, b in zip(ilo, g.offsets)))
                ch.sizes.append(sizes)
                ch.dst_region.append(t.region)
                ch.dst_base.append(
                    t.offset + (p.offset + sum((a - b) * s for a, b, s in zip(ilo, bo, p.strides))) * isz
                )
                ch.dst_strides.append(p.strides)
                ch.itemsize.append(isz)
                ch.piece.append((li, pi))
            if covered != p.box.numel:
                partial.append(
                    f"{p.tensor!r} box offsets={bo} sizes={bs} on destination rank {dest.rank} "
                    f"(local {t.name!r}): {p.box.numel - covered} of {p.box.numel} elements "
                    f"held by no source"
                )
    return ch


class _Emitter:
    """Collects runs per source rank, in the order given, and turns them into ``SourceOps``.

    Runs should arrive in source-address order per rank (``_emit`` sorts its parts): coalescing
    then finds them sorted and skips the sort.
    """

    def __init__(self) -> None:
        self.pending: dict[int, list[list[int]]] = {}  # single runs not yet put in a block
        self.blocks: dict[int, list[tuple[np.ndarray, ...]]] = {}

    def add_one(self, rank: int, src_region: int, so: int, dst_region: int, do: int, nb: int) -> None:
        cols = self.pending.get(rank)
        if cols is None:
            cols = self.pending[rank] = [[], [], [], [], []]
        cols[0].append(src_region)
        cols[1].append(so)
        cols[2].append(dst_region)
        cols[3].append(do)
        cols[4].append(nb)

    def _flush(self, rank: int) -> None:
        cols = self.pending.pop(rank, None)
        if cols:
            self.blocks.setdefault(rank, []).append(tuple(np.asarray(c, dtype=np.int64) for c in cols))

    def add(
        self, rank: int, src_region: int, so: np.ndarray, dst_region: int, do: np.ndarray, nb: np.ndarray | int
    ) -> None:
        self._flush(rank)
        n = len(so)
        self.blocks.setdefault(rank, []).append(
            (
                np.full(n, src_region, dtype=np.int64),
                so,
                np.full(n, dst_region, dtype=np.int64),
                do,
                np.full(n, nb, dtype=np.int64) if isinstance(nb, int) else nb,
            )
        )

    def finish(self) -> tuple[SourceOps, ...]:
        out = []
        for rank in sorted(set(self.pending) | set(self.blocks)):
            self._flush(rank)
            blocks = self.blocks[rank]
            cols = blocks[0] if len(blocks) == 1 else [np.concatenate([b[i] for b in blocks]) for i in range(5)]
            out.append(SourceOps(rank, *coalesce(*cols)))
        return tuple(out)


def _emit(ch: _Chunks, parts: list[list[list[int]]], items: Sequence[int] | None = None) -> tuple[SourceOps, ...]:
    """The reads of ``parts[k]`` (``[rank, start, stop]`` byte ranges) of chunk ``items[k]`` (of
    chunk ``k`` without ``items``), coalesced per source rank."""
    todo = []
    for i, plist in zip(items, parts) if items is not None else enumerate(parts):
        g = ch.group[i]
        delta = ch.delta[i]
        for rank, a, b in plist:
            if b <= a:
                continue
            region, base, strides = g.addr_of(rank)
            src_base = base + sum(d * s for d, s in zip(delta, strides)) * ch.itemsize[i] if any(delta) else base
            todo.append((rank, region, src_base, a, b, i, strides))
    todo.sort(key=lambda x: x[:4])  # source-address order per rank: coalescing needs no sort
    em = _Emitter()
    for rank, region, src_base, a, b, i, strides in todo:
        rs, rd, run = box_runs(ch.sizes[i], strides, ch.dst_strides[i], ch.itemsize[i])
        if len(rs) == 1:  # one contiguous run (most chunks): stay in Python ints
            em.add_one(rank, region, src_base + a, ch.dst_region[i], ch.dst_base[i] + a, b - a)
        elif a == 0 and b == ch.nbytes[i]:
            em.add(rank, region, rs + src_base, ch.dst_region[i], rd + ch.dst_base[i], run)
        else:
            js = np.arange(a // run, -(-b // run), dtype=np.int64)
            st = np.maximum(js * run, a)
            en = np.minimum(js * run + run, b)
            shift = st - js * run
            em.add(rank, region, rs[js] + src_base + shift, ch.dst_region[i], rd[js] + ch.dst_base[i] + shift, en - st)
    return em.finish()


def _layout_key(lay: RankLayout) -> tuple:
    return (lay.tensors, lay.region_sizes, tuple(sorted(lay.specs, key=lambda s: s.name)))


def _group_identical(layouts: Sequence[RankLayout]) -> list[list[RankLayout]]:
    """Layouts grouped by identical content (rank aside), in order of first appearance.

    Layouts sharing their tuples (built once, as replicas usually are) are grouped by identity
    first, so equal but distinct tuples are hashed once per distinct object, not once per rank.
    """
    by_id: dict[tuple[int, int, int], list[RankLayout]] = {}
    for lay in layouts:
        by_id.setdefault((id(lay.tensors), id(lay.region_sizes), id(lay.specs)), []).append(lay)
    by_key: dict[tuple, list[RankLayout]] = {}
    for same in by_id.values():
        by_key.setdefault(_layout_key(same[0]), []).extend(same)
    return list(by_key.values())


def _source_classes(sources: Sequence[RankLayout]) -> dict[int, tuple[int, ...]]:
    """Maps each source rank to the sorted ranks whose layouts are identical to its own."""
    out: dict[int, tuple[int, ...]] = {}
    for same in _group_identical(sources):
        cls = tuple(sorted(s.rank for s in same))
        for r in cls:
            out[r] = cls
    return out
