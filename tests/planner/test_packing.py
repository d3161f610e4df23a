"""Reader-ordered staging: slots packed for reader layouts, reads against them, local scatter.

Every test runs the whole path on byte buffers (``packed.run_packed``): the publisher's copy
program from its live tensors into the slot, the subscriber's plan against the slots, its reads
and its scatter, and checks that the result is bit-exact the bytes the ordinary plan delivers.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import Fused, LayoutBuilder, PlanError, Shard
from planner.packing import StridedCopies, build_packed_plans, copy_boxes, pack_staging, pack_stagings
from planner.runs import box_geometry, merge_intervals

from .cases import CASES, megatron_fc1, sharded
from .packed import distinct, run_packed
from .test_properties import _replicate, _specs, _world

pytestmark = pytest.mark.timeout(120)


def _reads(packed) -> dict[int, int]:
    return {r: len(p.plan) for r, p in packed.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cases_round_trip(name):
    sources, dests = CASES[name]()
    for split in (64, 1 << 20):
        stagings, packed, ordinary = run_packed(sources, dests, min_split_bytes=split)
        assert sum(_reads(packed).values()) <= sum(len(p) for p in ordinary.values())


def test_reader_equal_to_trainer_needs_no_packing():
    t = {"w": ((96, 40), 0), "o": ((40, 96), 1), "norm": ((40,), None)}
    sources = sharded(t, tp=2, dp=2)
    dests = sharded(t, tp=2, rank0=100) + sharded(t, tp=2, rank0=102)
    stagings, packed, ordinary = run_packed(sources, dests)
    for s in sources:
        st_ = stagings[s.rank]
        assert st_.identity
        assert st_.layout.tensors == s.tensors and st_.layout.region_sizes == s.region_sizes
        # the ordinary snapshot copy: one whole-tensor copy per tensor, to its usual offset
        assert len(st_.copies) == len(s.tensors)
        assert st_.copies.src_offset.tolist() == [0] * len(s.tensors)
        assert st_.copies.dst_offset.tolist() == [x.offset for x in s.tensors]
        assert st_.copies.run.tolist() == [x.nbytes for x in s.tensors]
    for d in dests:
        assert packed[d.rank].recv_bytes == 0 and not len(packed[d.rank].scatter)
        assert packed[d.rank].plan == ordinary[d.rank]


def _row_trainers():
    return sharded({"w": ((64, 48), 0), "b": ((48,), None)}, tp=2, dtype="bfloat16")


def test_reader_that_joins_later_is_packed_for_from_the_next_snapshot():
    sources = _row_trainers()
    a = sharded({"w": ((64, 48), 0), "b": ((48,), None)}, tp=2, dtype="bfloat16", rank0=100)
    b = sharded({"w": ((64, 48), 1), "b": ((48,), None)}, tp=4, dtype="bfloat16", rank0=200)
    # Version 1: only A is known. B reads the A-packed slots with the ordinary plan: correct, but
    # one read per row of each source's part of its column slice.
    _, before, _ = run_packed(sources, a + b, readers=distinct(a))
    # Version 2: B announced itself; the slots now hold B's column slices as dense cells.
    stagings, after, _ = run_packed(sources, a + b, readers=distinct(a + b))
    for d in b:
        assert _reads(before)[d.rank] >= 64
        assert _reads(after)[d.rank] <= 4  # one cell per source, plus the replicated bias
    for d in a:
        assert _reads(after)[d.rank] <= _reads(before)[d.rank]
    for s in sources:  # every mapped byte once, B's cells included
        assert stagings[s.rank].layout.region_sizes[0] <= 1.25 * s.region_sizes[0]


def test_two_readers_sharing_most_bytes_store_them_once():
    # A large replicated embedding both reader layouts need, and a small tensor they split.
    t_src = {"embed": ((512, 64), None), "small": ((8, 16), None)}
    t_dst = {"embed": ((512, 64), None), "small": ((8, 16), 0)}
    sources = sharded(t_src, tp=1, dp=2)
    dests = sharded(t_dst, tp=2, rank0=10)
    assert len(distinct(dests)) == 2
    stagings, packed, _ = run_packed(sources, dests)
    for s in sources:
        slot = stagings[s.rank].layout
        assert slot.region_sizes[0] <= 1.25 * s.region_sizes[0]
        embed = [p for x in slot.tensors for p in x.pieces if p.tensor == "embed"]
        assert sum(p.box.numel for p in embed) == 512 * 64  # stored once, not once per reader
    assert max(_reads(packed).values()) <= 3


def test_fused_rollout_tensor_from_column_split_trainer():
    """Trainer: q, k, v split by columns (TP=2). Rollout: one fused [q; k; v], TP=1.

    Each source's half of a tensor is a strided box in the fused tensor: the slot stores it dense,
    the subscriber reads it whole into its receive buffer and scatters it with one strided copy.
    """
    shapes = {"q": (32, 24), "k": (8, 24), "v": (8, 24)}
    sources = sharded({n: (s, 1) for n, s in shapes.items()}, tp=2, dp=2)
    b = LayoutBuilder(50)
    b.add("qkv_proj", (48, 24), "float32", Fused(0, tuple(Shard(n, s) for n, s in shapes.items())))
    dests = [b.build()]
    _, packed, ordinary = run_packed(sources, dests, min_split_bytes=64)
    pp = packed[50]
    assert len(ordinary[50]) == 2 * 48  # one read per row of each source's column half
    assert len(pp.plan) <= 6 and pp.recv_bytes >= 48 * 24 * 4
    assert len(pp.scatter) == 6 and pp.scatter.total_bytes == 48 * 24 * 4


def test_fused_rollout_tensor_from_megatron_fc1():
    sources = megatron_fc1(2, 64, 16)
    dests = megatron_fc1(4, 64, 16, rank0=8) + megatron_fc1(1, 64, 16, rank0=20)
    stagings, packed, ordinary = run_packed(sources, dests, min_split_bytes=64)
    assert sum(_reads(packed).values()) <= sum(len(p) for p in ordinary.values())
    assert max(_reads(packed).values()) <= 4  # [gate; up] rows: one cell per part per source


def test_replicas_pack_identically_and_share_the_load():
    sources = _replicate(_row_trainers(), 3, 0)
    dests = _replicate(sharded({"w": ((64, 48), 1), "b": ((48,), None)}, tp=4, dtype="bfloat16"), 3, 100)
    stagings, packed, _ = run_packed(sources, dests, min_split_bytes=64)
    assert len({id(s.layout.tensors) for s in stagings.values()}) == 2  # one per trainer TP rank
    served = {r for p in packed.values() for r in p.plan.bytes_per_source()}
    assert served == {s.rank for s in sources}


def test_pack_staging_is_pack_stagings_for_one_rank():
    sources = _row_trainers()
    readers = sharded({"w": ((64, 48), 1), "b": ((48,), None)}, tp=4, dtype="bfloat16", rank0=9)
    one = pack_staging(sources[1], readers)
    many = pack_stagings(sources, readers)[1]
    assert one.layout == many.layout and one.identity == many.identity
    assert all(np.array_equal(getattr(one.copies, c), getattr(many.copies, c)) for c in ("src_offset", "shape"))


def test_missing_tensor_is_a_plan_error_naming_it():
    sources = _row_trainers()
    dests = sharded({"w": ((64, 48), 1), "extra": ((4,), None)}, tp=2, dtype="bfloat16", rank0=9)
    stagings = pack_stagings(sources, dests)
    with pytest.raises(PlanError, match="'extra'"):
        build_packed_plans(list(stagings.values()), dests)


def test_copy_boxes_refuses_copies_outside_buffers():
    geo = box_geometry((4, 4), (8, 1), (4, 1), 1)
    copies = StridedCopies.of([(0, 0, 0, 0, geo)])
    copy_boxes(copies, [np.arange(32, dtype=np.uint8)], [np.zeros(16, dtype=np.uint8)])
    with pytest.raises(PlanError, match="box copy 0"):
        copy_boxes(copies, [np.arange(20, dtype=np.uint8)], [np.zeros(16, dtype=np.uint8)])


def test_merge_intervals_keeps_regions_apart():
    # Region 0 ends at 276; region 1 has [0, 60) and [64, 84): the gap must stay a gap.
    r, a, b = merge_intervals(np.array([0, 0, 1, 1]), np.array([0, 256, 0, 64]), np.array([112, 20, 60, 20]))
    assert list(zip(r.tolist(), a.tolist(), b.tolist())) == [(0, 0, 112), (0, 256, 276), (1, 0, 60), (1, 64, 84)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_layouts_round_trip(data):
    """Gather into packed slots, plan reads, scatter: bit-exact the ordinary plan's bytes, for
    random layouts on both sides, some destinations packed for and some not (late joiners)."""
    dtype = data.draw(st.sampled_from(["float32", "bfloat16", "int8"]))
    specs = _specs(data, dtype)
    sources = _replicate(_world(data, specs, dtype, 0, 2), data.draw(st.integers(1, 2)), 0)
    dests = _world(data, specs, dtype, 100, 2)
    pool = distinct(dests + _world(data, specs, dtype, 500, 1))
    readers = data.draw(st.lists(st.sampled_from(pool), max_size=len(pool), unique_by=id))
    stagings, packed, _ = run_packed(sources, dests, readers, seed=data.draw(st.integers(0, 9)), min_split_bytes=16)
    for s in sources:  # every mapped source element stored exactly once
        slot = stagings[s.rank].layout
        mapped = sum(p.box.numel for t in s.tensors for p in t.pieces)
        assert sum(p.box.numel for t in slot.tensors for p in t.pieces) == mapped
    for d in dests:  # the receive buffer holds only what is scattered from it
        assert packed[d.rank].scatter.total_bytes <= packed[d.rank].recv_bytes


def test_strided_copies_columns_are_read_only():
    c = StridedCopies.of([(0, 0, 0, 0, box_geometry((2, 3), (3, 1), (3, 1), 4))])
    with pytest.raises(ValueError):
        c.run[0] = 1
