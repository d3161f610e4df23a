"""Balancing across replicas: the assignment bound, split floors, rotation for lone planners."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner import build_plan, build_plans, summarize
from planner.balance import assign

from .cases import sharded
from .helpers import check_plans

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=80, deadline=None)
@given(
    weights=st.lists(st.integers(1, 5000), min_size=1, max_size=60),
    classes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    min_split=st.sampled_from([16, 64, 1024]),
    seed=st.integers(0, 1000),
)
def test_assign_parts_cover_items_and_meet_the_bound(weights, classes, min_split, seed):
    rng = random.Random(seed)
    ranks, groups = 0, []
    for size in classes:
        groups.append(tuple(range(ranks, ranks + size)))
        ranks += size
    cands = [rng.choice(groups) for _ in weights]
    loads: dict[int, int] = {}
    parts = assign(weights, cands, loads, min_split=min_split, align=16)
    for w, c, ps in zip(weights, cands, parts):
        spans = sorted((a, b) for _, a, b in ps)
        assert spans[0][0] == 0 and spans[-1][1] == w
        assert all(b1 == a2 for (_, b1), (a2, _) in itertools.pairwise(spans)), "parts must tile the item"
        assert all(r in c for r, _, _ in ps)
        if len(ps) > 1:
            assert all(b - a >= min_split for _, a, b in ps), "never split below the floor"
    assert sum(loads.values()) == sum(weights)
    # Bound for disjoint candidate classes: max - min < 2 * (floor + align) inside every class.
    for g in groups:
        got = [loads.get(r, 0) for r in g]
        assert max(got) - min(got) < 2 * (min_split + 16), (g, got)


def test_split_only_above_the_floor():
    """One destination planned jointly against two replicas: rotation would leave one idle, so
    the joint plan splits, but never below the floor. Alone it reads from one replica."""
    src = sharded({"w": ((1024, 1024), None)}, tp=1, dp=2)  # 4 MiB float32, two replicas
    dst = sharded({"w": ((1024, 1024), None)}, tp=1, rank0=10)[0]
    halves = build_plans(src, [dst], min_split_bytes=1 << 20)[dst.rank]
    assert halves.bytes_per_source() == {0: 2 << 20, 1: 2 << 20}
    assert len(halves) == 2
    whole = build_plans(src, [dst], min_split_bytes=4 << 20)[dst.rank]
    assert list(whole.bytes_per_source().values()) == [4 << 20] and len(whole) == 1
    alone = build_plan(src, dst, min_split_bytes=1 << 20)
    assert len(alone.bytes_per_source()) == 1 and len(alone) == 1


def test_joint_planning_balances_replicas():
    tensors = {f"w{i}": ((64 + 8 * i, 32), 0) for i in range(6)} | {"n": ((32,), None)}
    src = sharded(tensors, tp=2, dp=4)  # 8 source ranks, 4 replicas of each shard
    dst = [d for k in range(6) for d in sharded(tensors, tp=4, rank0=100 + 4 * k)]
    plans = build_plans(src, dst, min_split_bytes=256)
    check_plans(plans, src, dst)
    s = summarize(plans)
    assert len(s["bytes_per_source"]) == 8
    assert s["balance_max_over_mean"] < 1.02, s


def test_lone_planners_spread_over_replicas():
    """Each subscriber plans alone; rotation by destination rank spreads them over replicas."""
    tensors = {"w": ((16, 16), None)}  # one small tensor: nothing to split
    src = sharded(tensors, tp=1, dp=4)
    dst = [d for k in range(8) for d in sharded(tensors, tp=1, rank0=40 + k)]
    plans = {d.rank: build_plan(src, d, min_split_bytes=1 << 20) for d in dst}
    s = summarize(plans)
    assert sorted(s["bytes_per_source"].values()) == [2 * 1024] * 4, s


def test_balance_reported_in_summary():
    src = sharded({"w": ((8, 8), 0)}, tp=2, dp=1)
    p = build_plan(src, sharded({"w": ((8, 8), 0)}, tp=1, rank0=5)[0])
    s = p.summary()
    assert s["bytes"] == s["needed_bytes"] == 256 and s["bytes_per_source"] == {0: 128, 1: 128}
    assert s["balance_max_over_mean"] == 1.0


def test_sort_order_matches_a_plain_stable_sort():
    import numpy as np

    from planner.runs import sort_order

    rng = np.random.default_rng(0)
    for case in range(200):
        runs = [
            np.sort(rng.integers(0, 50 if case % 2 else 10**9, rng.integers(1, 20))) for _ in range(rng.integers(1, 12))
        ]
        keys = np.concatenate(runs).astype(np.int64)
        order = sort_order(keys)
        got = keys if order is None else keys[order]
        assert np.array_equal(got, np.sort(keys, kind="stable"))
