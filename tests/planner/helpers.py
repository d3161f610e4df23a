"""Reusable plan executor for tests: real numpy byte buffers, one copy per ReadOp.

Typical use::

    canon = random_canonical(specs_of_layouts(sources))
    src = {s.rank: fill_layout(s, canon) for s in sources}
    check_plans(plans, sources, dests, canon)    # bit-exact, padding untouched, zero redundancy

Canonical tensors are random bytes (``uint8`` arrays of ``numel * itemsize``), so any dtype works
and a misplaced byte is caught.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from planner.dtypes import itemsize
from planner.layout import RankLayout, TensorSpec
from planner.plan import Plan

SENTINEL = 0xA5


def specs_of_layouts(layouts: Iterable[RankLayout]) -> dict[str, TensorSpec]:
    out: dict[str, TensorSpec] = {}
    for lay in layouts:
        for s in lay.specs:
            out.setdefault(s.name, s)
    return out


def random_canonical(specs: Mapping[str, TensorSpec] | Iterable[TensorSpec], seed: int = 0) -> dict[str, np.ndarray]:
    """Random bytes for every canonical tensor (flat ``uint8``, row-major element order)."""
    rng = np.random.default_rng(seed)
    items = specs.values() if isinstance(specs, Mapping) else specs
    return {s.name: rng.integers(0, 256, s.numel * itemsize(s.dtype), dtype=np.uint8) for s in items}


def _piece_indices(piece, spec_shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(local element index, canonical flat element index) of every element of a piece."""
    loc = np.array([piece.offset], dtype=np.int64)
    can = np.zeros(1, dtype=np.int64)
    cstrides = [math.prod(spec_shape[i + 1 :]) for i in range(len(spec_shape))]
    for o, n, st, cs in zip(piece.box.offsets, piece.box.sizes, piece.strides, cstrides):
        idx = np.arange(n, dtype=np.int64)
        loc = (loc[:, None] + idx * st).ravel()
        can = (can[:, None] + (idx + o) * cs).ravel()
    return loc, can


def _byte_indices(elems: np.ndarray, isz: int) -> np.ndarray:
    return (elems[:, None] * isz + np.arange(isz, dtype=np.int64)).ravel()


def fill_layout(
    layout: RankLayout, canon: Mapping[str, np.ndarray], *, fill: int | None = None, seed: int = 1
) -> list[np.ndarray]:
    """Regions of ``layout`` holding ``canon`` where pieces map, ``fill`` (or random junk) elsewhere."""
    rng = np.random.default_rng(seed)
    regions = [
        np.full(n, fill, dtype=np.uint8) if fill is not None else rng.integers(0, 256, n, dtype=np.uint8)
        for n in layout.region_sizes
    ]
    specs = layout.spec_map()
    for t in layout.tensors:
        isz = itemsize(t.dtype)
        for p in t.pieces:
            if not p.box.numel:
                continue
            loc, can = _piece_indices(p, specs[p.tensor].shape)
            regions[t.region][t.offset + _byte_indices(loc, isz)] = canon[p.tensor][_byte_indices(can, isz)]
    return regions


def mapped_mask(layout: RankLayout) -> list[np.ndarray]:
    """Per region, True where a piece maps the byte."""
    masks = [np.zeros(n, dtype=bool) for n in layout.region_sizes]
    specs = layout.spec_map()
    for t in layout.tensors:
        isz = itemsize(t.dtype)
        for p in t.pieces:
            if p.box.numel:
                loc, _ = _piece_indices(p, specs[p.tensor].shape)
                masks[t.region][t.offset + _byte_indices(loc, isz)] = True
    return masks


def execute(
    plan: Plan,
    src_regions: Mapping[int, Sequence[np.ndarray]],
    dst_regions: Sequence[np.ndarray],
    write_count: Sequence[np.ndarray] | None = None,
) -> None:
    """Copies the bytes of every ReadOp; counts writes per destination byte if asked."""
    for op in plan.ops():
        src = src_regions[op.src_rank][op.src_region]
        dst_regions[op.dst_region][op.dst_offset : op.dst_offset + op.nbytes] = src[
            op.src_offset : op.src_offset + op.nbytes
        ]
        if write_count is not None:
            write_count[op.dst_region][op.dst_offset : op.dst_offset + op.nbytes] += 1


def check_plans(
    plans: Mapping[int, Plan],
    sources: Sequence[RankLayout],
    dests: Sequence[RankLayout],
    canon: Mapping[str, np.ndarray] | None = None,
) -> dict[int, list[np.ndarray]]:
    """Executes every plan and asserts: bit-exact mapped bytes, untouched padding (sentinel), every
    mapped byte written exactly once, and ``sum(op bytes) == needed_bytes == mapped bytes``.

    Returns the destination regions after the copy.
    """
    if canon is None:
        canon = random_canonical(specs_of_layouts(list(sources) + list(dests)))
    src = {s.rank: fill_layout(s, canon, seed=1000 + s.rank) for s in sources}
    assert set(plans) == {d.rank for d in dests}, (sorted(plans), [d.rank for d in dests])
    out = {}
    for d in dests:
        plan = plans[d.rank]
        regions = [np.full(n, SENTINEL, dtype=np.uint8) for n in d.region_sizes]
        counts = [np.zeros(n, dtype=np.int32) for n in d.region_sizes]
        execute(plan, src, regions, counts)
        expected = fill_layout(d, canon, fill=SENTINEL)
        masks = mapped_mask(d)
        mapped = sum(int(m.sum()) for m in masks)
        assert plan.total_bytes == plan.needed_bytes == mapped, (
            f"rank {d.rank}: read {plan.total_bytes}, needed {plan.needed_bytes}, mapped {mapped}"
        )
        for r, (got, want, cnt, m) in enumerate(zip(regions, expected, counts, masks)):
            assert np.array_equal(cnt[m], np.ones(int(m.sum()), dtype=np.int32)), (
                f"rank {d.rank} region {r}: mapped bytes not written exactly once"
            )
            assert not cnt[~m].any(), f"rank {d.rank} region {r}: unmapped bytes were written"
            bad = np.flatnonzero(got != want)
            assert not len(bad), f"rank {d.rank} region {r}: {len(bad)} wrong bytes, first at {bad[:5]}"
        out[d.rank] = regions
    return out
