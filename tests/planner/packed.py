"""Executes packed staging end to end on byte buffers, next to the ordinary plan (for tests).

``run_packed(sources, dests, readers)``: packs every source's slot for ``readers`` (default: the
distinct destination layouts), runs each copy program from the live tensors into its slot, plans
every destination against the slots, executes reads and scatter, and asserts that every
destination ends up with exactly the bytes the ordinary plan delivers (bit-exact, padding
untouched) and that every slot holds the canonical bytes where it maps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner import build_plans
from planner.layout import RankLayout
from planner.packing import PackedPlan, PackedStaging, build_packed_plans, copy_boxes, pack_stagings

from .helpers import SENTINEL, execute, fill_layout, mapped_mask, random_canonical, specs_of_layouts


def distinct(layouts: Sequence[RankLayout]) -> list[RankLayout]:
    seen, out = set(), []
    for lay in layouts:
        key = (lay.tensors, lay.region_sizes)
        if key not in seen:
            seen.add(key)
            out.append(lay)
    return out


def run_packed(
    sources: Sequence[RankLayout],
    dests: Sequence[RankLayout],
    readers: Sequence[RankLayout] | None = None,
    *,
    seed: int = 0,
    min_split_bytes: int = 1 << 20,
) -> tuple[dict[int, PackedStaging], dict[int, PackedPlan], dict]:
    sources, dests = list(sources), list(dests)
    readers = distinct(dests) if readers is None else list(readers)
    canon = random_canonical(specs_of_layouts(sources + dests), seed)
    stagings = pack_stagings(sources, readers)
    live_regions = {s.rank: fill_layout(s, canon, seed=1000 + s.rank) for s in sources}
    slots = {}
    for s in sources:
        st = stagings[s.rank]
        regions = live_regions[s.rank]
        live = [regions[t.region][t.offset : t.offset + t.nbytes] for t in s.tensors]
        slot = np.full(st.layout.region_sizes[0] if st.layout.region_sizes else 0, SENTINEL, dtype=np.uint8)
        copy_boxes(st.copies, live, [slot])
        if st.layout.region_sizes:
            m = mapped_mask(st.layout)[0]
            want = fill_layout(st.layout, canon, fill=SENTINEL)[0]
            assert np.array_equal(slot[m], want[m]), f"source rank {s.rank}: slot differs from canonical bytes"
        slots[s.rank] = [slot]
    packed = build_packed_plans(list(stagings.values()), dests, min_split_bytes=min_split_bytes)
    ordinary = build_plans(sources, dests, min_split_bytes=min_split_bytes)
    for d in dests:
        pp = packed[d.rank]
        assert pp.recv_region == len(d.region_sizes)
        regions = [np.full(n, SENTINEL, dtype=np.uint8) for n in d.region_sizes]
        regions.append(np.full(pp.recv_bytes, SENTINEL, dtype=np.uint8))
        execute(pp.plan, slots, regions)
        copy_boxes(pp.scatter, regions, regions[: pp.recv_region])
        want = [np.full(n, SENTINEL, dtype=np.uint8) for n in d.region_sizes]
        execute(ordinary[d.rank], live_regions, want)
        expected = fill_layout(d, canon, fill=SENTINEL)
        for r, (got, w, e) in enumerate(zip(regions, want, expected)):
            bad = np.flatnonzero(got != w)
            assert not len(bad), f"rank {d.rank} region {r}: {len(bad)} bytes differ from the ordinary plan's"
            assert np.array_equal(w, e), f"rank {d.rank} region {r}: ordinary plan wrong"
    return stagings, packed, ordinary
