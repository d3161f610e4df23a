"""Plan validation: run before any byte moves. Every failure is a ``PlanError`` naming ranks/tensors.

Checks, for one destination's plan:

* every source rank exists, every op is non-empty and in bounds of its source and destination
  regions;
* no two ops write the same destination byte, every op writes only mapped destination bytes
  (never padding) and the ops write exactly ``needed_bytes``, which must equal the bytes the
  destination's pieces map: so every mapped byte is written exactly once;
* every op reads only mapped source bytes;
* (``check_data``) on a deterministic sample of ops, the first and last byte of the source range
  and of the destination range are the same byte of the same element of the same canonical tensor,
  whose spec (shape, dtype) agrees on both sides. (``build_plans`` checks every spec up front.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from .dtypes import itemsize as _itemsize
from .errors import PlanError
from .layout import LocalTensor, Piece, RankLayout
from .plan import Plan
from .runs import KEY_SHIFT, piece_intervals, sort_order

_SHIFT = KEY_SHIFT


def mapped_intervals(layout: RankLayout) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, merged ``(start_key, stop_key)`` of the bytes a layout's pieces map."""
    items = []
    for t in layout.tensors:
        isz = _itemsize(t.dtype)
        if len(t.pieces) > 1 and t.unmapped_numel == 0:
            # Disjoint pieces (a LayoutError otherwise) covering every element: the whole tensor.
            items.append((t.region, t.offset, (t.numel,), (1,), isz))
            continue
        for p in t.pieces:
            items.append((t.region, t.offset + p.offset * isz, p.box.sizes, p.strides, isz))
    r, a, b = piece_intervals(items)
    return (r << _SHIFT) + a, (r << _SHIFT) + b


def _uncovered(keys: np.ndarray, nbytes: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Indices of intervals ``[key, key+n)`` not inside one of the merged ``[starts, stops)``."""
    idx = np.searchsorted(starts, keys, side="right") - 1
    ok = idx >= 0
    ok[ok] &= keys[ok] + nbytes[ok] <= stops[idx[ok]]
    return np.flatnonzero(~ok)


class _Info:
    """Per-layout lookups, built once per validation run."""

    def __init__(self, layout: RankLayout) -> None:
        self.layout = layout
        self._mapped: tuple[np.ndarray, np.ndarray] | None = None
        self._index: tuple[list[LocalTensor], np.ndarray] | None = None
        self.specs = layout.spec_map()
        self.region_sizes = np.asarray(layout.region_sizes, dtype=np.int64)
        for t in layout.tensors:
            if not (
                0 <= t.region < len(layout.region_sizes)
                and t.offset >= 0
                and t.offset + t.nbytes <= layout.region_sizes[t.region]
            ):
                raise PlanError(
                    f"rank {layout.rank}: local tensor {t.name!r} ({t.nbytes} bytes at offset "
                    f"{t.offset} of region {t.region}) lies outside its region "
                    f"(region sizes {list(layout.region_sizes)[:8]})"
                )

    def _tensor_index(self) -> tuple[list[LocalTensor], np.ndarray]:
        if self._index is None:
            ts = sorted((t for t in self.layout.tensors if all(t.shape)), key=lambda t: (t.region, t.offset))
            self._index = ts, np.array([(t.region << _SHIFT) + t.offset for t in ts], dtype=np.int64)
        return self._index

    @property
    def mapped(self) -> tuple[np.ndarray, np.ndarray]:
        if self._mapped is None:
            self._mapped = mapped_intervals(self.layout)
        return self._mapped

    def share(self, other: _Info) -> None:
        """Reuses ``other``'s mapped intervals and tensor index (same tensors object, so same
        bytes mapped at the same places)."""
        if other.layout.tensors is self.layout.tensors:
            self._mapped = self._mapped if self._mapped is not None else other._mapped
            self._index = self._index if self._index is not None else other._index

    def tensor_at(self, region: int, offset: int) -> LocalTensor | None:
        tensors, keys = self._tensor_index()
        i = int(np.searchsorted(keys, (region << _SHIFT) + offset, side="right")) - 1
        if i < 0:
            return None
        t = tensors[i]
        return t if t.region == region and offset < t.offset + t.nbytes else None


def _info(layout: RankLayout, cache: dict | None) -> _Info:
    if cache is None:
        return _Info(layout)
    got = cache.get(id(layout))
    if got is None or got.layout is not layout:
        got = cache[id(layout)] = _Info(layout)
        twin = cache.setdefault(("tensors", id(layout.tensors)), got)
        if twin is not got:
            if twin._mapped is None:
                twin.mapped  # noqa: B018  (compute once, share with every layout built on these tensors)
            twin._tensor_index()
            got.share(twin)
    return got


def _describe(info: _Info, region: int, offset: int) -> str:
    t = info.tensor_at(region, offset)
    return f"region {region} offset {offset}" + (f" (local tensor {t.name!r})" if t else "")


def _decode(p: Piece, elem: int) -> tuple[int, ...] | None:
    """Canonical index of local element ``elem`` if piece ``p`` maps it."""
    rel = elem - p.offset
    if rel < 0:
        return None
    coords = list(p.box.offsets)
    for d in sorted((d for d in range(p.box.ndim) if p.box.sizes[d] > 1), key=lambda d: -p.strides[d]):
        q, rel = divmod(rel, p.strides[d])
        if q >= p.box.sizes[d]:
            return None
        coords[d] += q
    return tuple(coords) if rel == 0 else None


def canonical_byte(layout: RankLayout | _Info, region: int, offset: int) -> tuple[str, int, int] | None:
    """``(tensor, flat canonical element, byte within element)`` held at a byte of a layout."""
    info = layout if isinstance(layout, _Info) else _Info(layout)
    t = info.tensor_at(region, offset)
    if t is None:
        return None
    isz = t.itemsize
    elem, byte = divmod(offset - t.offset, isz)
    specs = info.specs
    for p in t.pieces:
        c = _decode(p, elem)
        if c is not None:
            shape = specs[p.tensor].shape
            flat = sum(ci * si for ci, si in zip(c, _row_major(shape)))
            return p.tensor, flat, byte
    return None


def _row_major(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def validate_plan(
    plan: Plan,
    sources: Sequence[RankLayout] | Mapping[int, RankLayout],
    dest: RankLayout,
    *,
    check_data: bool = True,
    samples: int = 256,
    cache: dict | None = None,
) -> None:
    """Raises ``PlanError`` unless ``plan`` correctly fills ``dest`` from ``sources`` (see module doc).

    ``cache`` (a dict the caller keeps while its layouts live) reuses per-layout lookups across
    calls that validate many plans against the same layouts.
    """
    src_map = dict(sources) if isinstance(sources, Mapping) else {s.rank: s for s in sources}
    d = dest.rank
    if plan.dst_rank != d:
        raise PlanError(f"plan is for destination rank {plan.dst_rank}, validated against rank {d}")
    ranks = [s.src_rank for s in plan.sources]
    if ranks != sorted(set(ranks)):
        raise PlanError(f"destination rank {d}: source groups not sorted/unique: {ranks}")
    dst_sizes = np.asarray(dest.region_sizes, dtype=np.int64)
    dkeys, dlens = [], []
    for s in plan.sources:
        lay = src_map.get(s.src_rank)
        if lay is None:
            raise PlanError(f"destination rank {d}: plan reads from unknown source rank {s.src_rank}")
        if not len(s):
            continue
        if s.nbytes.min() <= 0:
            raise PlanError(f"destination rank {d}: empty read from source rank {s.src_rank}")
        what = f"destination rank {d} reading source rank {s.src_rank}"
        info = _info(lay, cache)
        # In bounds follows from "inside mapped bytes" (inside tensors, inside regions: checked per
        # layout); the explicit bounds checks only run to word the error when that fails.
        if not _key_safe(s.src_region, s.src_offset, s.nbytes):
            _check_bounds(what + ": source", s.src_region, s.src_offset, s.nbytes, info.region_sizes)
        if not _key_safe(s.dst_region, s.dst_offset, s.nbytes):
            _check_bounds(what + ": destination", s.dst_region, s.dst_offset, s.nbytes, dst_sizes)
        starts, stops = info.mapped
        skeys = (s.src_region << _SHIFT) + s.src_offset
        bad = _uncovered(skeys, s.nbytes, starts, stops)
        if len(bad):
            _check_bounds(what + ": source", s.src_region, s.src_offset, s.nbytes, info.region_sizes)
            i = int(bad[0])
            raise PlanError(
                f"destination rank {d}: {len(bad)} reads from source rank {s.src_rank} touch "
                f"unmapped source bytes, e.g. {int(s.nbytes[i])} bytes at "
                f"{_describe(info, int(s.src_region[i]), int(s.src_offset[i]))}"
            )
        # Rows that continue each other in the destination (a strided source box landing in a
        # dense destination slice) merge first: same union, same overlaps, far fewer to sort.
        k, n = _touching_merged((s.dst_region << _SHIFT) + s.dst_offset, s.nbytes)
        dkeys.append(k)
        dlens.append(n)
    total = plan.total_bytes
    dinfo = _info(dest, cache)
    starts, stops = dinfo.mapped
    mapped = int((stops - starts).sum())
    if plan.needed_bytes != mapped:
        raise PlanError(f"destination rank {d}: plan says {plan.needed_bytes} bytes needed, layout maps {mapped}")
    if total != mapped:
        raise PlanError(f"destination rank {d}: plan reads {total} bytes but {mapped} are needed")
    if not dkeys:
        return
    keys = np.concatenate(dkeys)
    lens = np.concatenate(dlens)
    order = sort_order(keys)
    k, n = (keys, lens) if order is None else (keys[order], lens[order])
    over = np.flatnonzero(k[1:] < k[:-1] + n[:-1])
    if len(over):
        key = int(k[over[0] + 1])
        raise PlanError(
            f"destination rank {d}: {len(over)} reads overlap in the destination, e.g. at "
            f"{_describe(dinfo, key >> _SHIFT, key & ((1 << _SHIFT) - 1))}"
        )
    bad = _uncovered(keys, lens, starts, stops)
    if len(bad):
        for s in plan.sources:
            if len(s):
                _check_bounds(
                    f"destination rank {d} reading source rank {s.src_rank}: destination",
                    s.dst_region,
                    s.dst_offset,
                    s.nbytes,
                    dst_sizes,
                )
        key = int(keys[bad[0]])
        raise PlanError(
            f"destination rank {d}: {len(bad)} reads write unmapped destination bytes, e.g. at "
            f"{_describe(dinfo, key >> _SHIFT, key & ((1 << _SHIFT) - 1))}"
        )
    if check_data:
        used = {s.src_rank for s in plan.sources}
        _check_sample(plan, {r: _info(lay, cache) for r, lay in src_map.items() if r in used}, dinfo, samples)


def _touching_merged(keys: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merges consecutive intervals where one ends exactly where the next starts."""
    if len(keys) < 2:
        return keys, nbytes
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1] + nbytes[:-1])))
    if len(starts) == len(keys):
        return keys, nbytes
    return keys[starts], np.add.reduceat(nbytes, starts)


def _key_safe(region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> bool:
    """Whether ``region << 48 | offset`` keys are exact: ``0 <= region < 2**14`` and
    ``0 <= offset < 2**48`` (an OR over non-negative values stays below a power of two only if
    each does; a negative value sets the sign bit). A read running past ``2**48`` then fails
    the mapped-bytes check."""
    return 0 <= int(np.bitwise_or.reduce(region)) < (1 << 14) and 0 <= int(np.bitwise_or.reduce(offset)) < (1 << _SHIFT)


def _check_bounds(what: str, region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, sizes: np.ndarray) -> None:
    bad_region = (region < 0) | (region >= len(sizes))
    if bad_region.any():
        raise PlanError(f"{what} region {int(region[bad_region][0])} does not exist ({len(sizes)} regions)")
    bad = (offset < 0) | (offset + nbytes > sizes[region])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(
            f"{what} bytes [{int(offset[i])}, {int(offset[i] + nbytes[i])}) outside region "
            f"{int(region[i])} of {int(sizes[region[i]])} bytes"
        )


def _check_sample(plan: Plan, src_map: Mapping[int, _Info], dest: _Info, samples: int) -> None:
    n = len(plan)
    if not n:
        return
    picks = np.unique(np.linspace(0, n - 1, min(n, samples)).astype(np.int64))
    pos = 0
    for s in plan.sources:
        lay = src_map[s.src_rank]
        m = len(s)
        for i in (picks[(picks >= pos) & (picks < pos + m)] - pos).tolist():
            for delta in (0, int(s.nbytes[i]) - 1):
                a = canonical_byte(lay, int(s.src_region[i]), int(s.src_offset[i]) + delta)
                b = canonical_byte(dest, int(s.dst_region[i]), int(s.dst_offset[i]) + delta)
                if a is None or a != b:
                    raise PlanError(
                        f"destination rank {plan.dst_rank}: read from source rank {s.src_rank} copies {a} into {b}"
                    )
                sa, sb = lay.specs[a[0]], dest.specs[a[0]]
                if sa != sb:
                    raise PlanError(
                        f"{a[0]!r}: {sa.shape}/{sa.dtype} on source rank {s.src_rank} but "
                        f"{sb.shape}/{sb.dtype} on destination rank {plan.dst_rank}"
                    )
        pos += m
