"""Property tests: random shapes, TP/DP/EP sizes, uneven cuts on both sides, random fused groups.

Every example executes its plans on byte buffers with the three checks of ``helpers.check_plans``.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import (
    Flat,
    Fused,
    LayoutBuilder,
    Shard,
    Stack,
    TensorSpec,
    build_plan,
    build_plans,
)

from .helpers import check_plans

pytestmark = pytest.mark.timeout(120)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cuts(data, n: int, k: int) -> list[tuple[int, int]]:
    pts = sorted(data.draw(st.lists(st.integers(0, n), min_size=k - 1, max_size=k - 1)))
    edges = [0] + pts + [n]
    return [(a, b - a) for a, b in itertools.pairwise(edges)]


def _shard_side(data, specs, ranks, dtype):
    """Every tensor split along a random dim at random cuts, one part per rank."""
    builders = [LayoutBuilder(r, pack=data.draw(st.booleans())) for r in ranks]
    for sp in specs:
        dim = data.draw(st.integers(0, len(sp.shape) - 1))
        for b, (o, s) in zip(builders, _cuts(data, sp.shape[dim], len(ranks))):
            if s:
                local = tuple(s if i == dim else n for i, n in enumerate(sp.shape))
                b.add(
                    sp.name,
                    local,
                    dtype,
                    Shard(sp.name, sp.shape, tuple(o if i == dim else 0 for i in range(len(sp.shape)))),
                )
    return [b.build() for b in builders]


def _fused_side(data, specs, ranks, dtype):
    """Random groups of tensors with equal trailing dims fused along dim 0, each part cut per rank."""
    builders = [LayoutBuilder(r) for r in ranks]
    by_tail: dict[tuple, list[TensorSpec]] = {}
    for sp in specs:
        by_tail.setdefault(sp.shape[1:], []).append(sp)
    gi = 0
    for tail, group in by_tail.items():
        group = data.draw(st.permutations(group))
        while group:
            take = data.draw(st.integers(1, len(group)))
            members, group = group[:take], group[take:]
            cuts = [_cuts(data, sp.shape[0], len(ranks)) for sp in members]
            for ri, b in enumerate(builders):
                parts = [
                    Shard(sp.name, sp.shape, (c[ri][0],) + (0,) * len(tail), (c[ri][1],) + tail)
                    for sp, c in zip(members, cuts)
                    if c[ri][1]
                ]
                if parts:
                    rows = sum(p.sizes[0] for p in parts)
                    b.add(f"fused{gi}", (rows,) + tail, dtype, Fused(0, tuple(parts)))
            gi += 1
    return [b.build() for b in builders]


def _flat_side(data, specs, ranks, dtype):
    """FSDP1-style: all tensors concatenated and cut at random points (mid-row), padded shards."""
    total = sum(sp.numel for sp in specs)
    cuts = _cuts(data, total, len(ranks))
    pad = data.draw(st.integers(0, 3))
    out = []
    for r, (lo, n) in zip(ranks, cuts):
        segs, pos = [], 0
        for sp in specs:
            a, b = max(lo, pos), min(lo + n, pos + sp.numel)
            if a < b:
                segs.append((sp.name, sp.shape, a - pos, b - pos))
            pos += sp.numel
        lb = LayoutBuilder(r)
        if segs:
            lb.add("flat", (n + pad,), dtype, Flat(tuple(segs)))
        out.append(lb.build())
    return out


def _ep_side(data, specs, ranks, dtype):
    """Whole tensors placed on ranks (expert parallel); same-shape tensors on a rank are stacked."""
    builders = [LayoutBuilder(r, pack=data.draw(st.booleans())) for r in ranks]
    placed: dict[int, list[TensorSpec]] = {}
    for sp in specs:
        homes = data.draw(st.sets(st.integers(0, len(ranks) - 1), min_size=1, max_size=min(2, len(ranks))))
        for h in homes:
            placed.setdefault(h, []).append(sp)
    for h, sps in placed.items():
        by_shape: dict[tuple, list[TensorSpec]] = {}
        for sp in sps:
            by_shape.setdefault(sp.shape, []).append(sp)
        for shape, group in by_shape.items():
            if len(group) > 1 and data.draw(st.booleans()):
                builders[h].add(
                    "stack_" + "_".join(g.name for g in group),
                    (len(group),) + shape,
                    dtype,
                    Stack(tuple(Shard(g.name, g.shape) for g in group)),
                )
            else:
                for g in group:
                    builders[h].add(g.name, shape, dtype, Shard(g.name, shape))
    return [b.build() for b in builders]


KINDS = {"shard": _shard_side, "fused": _fused_side, "flat": _flat_side, "ep": _ep_side}


def _specs(data, dtype):
    n = data.draw(st.integers(1, 4))
    tail = data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=2))
    out = []
    for i in range(n):
        if data.draw(st.booleans()):  # share a tail so fused groups and stacks happen
            shape = (data.draw(st.integers(1, 9)),) + tuple(tail)
        else:
            shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
        out.append(TensorSpec(f"t{i}", shape, dtype))
    if data.draw(st.booleans()) and len(out) > 1:  # same-shape tensors (experts)
        out[1] = TensorSpec("t1", out[0].shape, dtype)
    return out


def _world(data, specs, dtype, rank0, max_replicas):
    layouts = []
    rank = rank0
    for _ in range(data.draw(st.integers(1, max_replicas))):
        kind = data.draw(st.sampled_from(sorted(KINDS)))
        k = data.draw(st.integers(1, 4))
        layouts += KINDS[kind](data, specs, list(range(rank, rank + k)), dtype)
        rank += k
    return layouts


@SETTINGS
@given(data=st.data())
def test_random_layouts_joint(data):
    dtype = data.draw(st.sampled_from(["float32", "bfloat16", "int8", "float64"]))
    specs = _specs(data, dtype)
    sources = _world(data, specs, dtype, 0, 3)
    dests = _world(data, specs, dtype, 100, 2)
    min_split = data.draw(st.sampled_from([16, 64, 1 << 20]))
    plans = build_plans(sources, dests, min_split_bytes=min_split)
    check_plans(plans, sources, dests)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_layouts_one_at_a_time(data):
    dtype = data.draw(st.sampled_from(["float32", "uint8"]))
    specs = _specs(data, dtype)
    sources = _world(data, specs, dtype, 0, 3)
    dests = _world(data, specs, dtype, 50, 2)
    plans = {d.rank: build_plan(sources, d, min_split_bytes=16) for d in dests}
    check_plans(plans, sources, dests)


def _replicate(layouts, copies: int, rank0: int):
    """``copies`` identical replicas of a world (same tensors, new ranks), as trainers/rollouts are."""
    from planner import RankLayout

    n = len(layouts)
    return [
        RankLayout(rank0 + c * n + i, lay.tensors, lay.specs, lay.region_sizes)
        for c in range(copies)
        for i, lay in enumerate(layouts)
    ]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_replicated_worlds_share_plans_and_balance(data):
    """Identical destination replicas are planned once and rotated over identical source replicas."""
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
    specs = _specs(data, dtype)
    base_src = _world(data, specs, dtype, 0, 1)
    base_dst = _world(data, specs, dtype, 0, 1)
    dp = data.draw(st.integers(1, 3))
    sources = _replicate(base_src, dp, 0)
    dests = _replicate(base_dst, data.draw(st.integers(1, 4)), 1000)
    plans = build_plans(sources, dests, min_split_bytes=16)
    check_plans(plans, sources, dests)
