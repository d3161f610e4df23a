"""Plans and layouts are plain data: JSON round trips, deterministic builds, summaries."""

from __future__ import annotations

import json
import random

import pytest

from planner import Plan, RankLayout, build_plans, format_summary, summarize

from .cases import CASES
from .helpers import check_plans

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", sorted(CASES))
def test_json_round_trips(name):
    sources, dests = CASES[name]()
    plans = build_plans(sources, dests, min_split_bytes=64)
    for p in plans.values():
        again = Plan.from_json(p.to_json())
        assert again == p and again.to_json() == p.to_json()
        assert list(again.ops()) == list(p.ops())
    # Layouts survive JSON too, and plan the same.
    src2 = [RankLayout.from_json(s.to_json()) for s in sources]
    dst2 = [RankLayout.from_json(d.to_json()) for d in dests]
    assert src2 == sources and dst2 == dests
    assert build_plans(src2, dst2, min_split_bytes=64) == plans


@pytest.mark.parametrize("name", ["gqa_kv_replicated", "moe_separate_to_stacked", "tp_row", "flat_fsdp1"])
def test_deterministic_whatever_the_input_order(name):
    sources, dests = CASES[name]()
    ref = build_plans(sources, dests, min_split_bytes=64)
    for seed in range(3):
        rng = random.Random(seed)
        s2, d2 = list(sources), list(dests)
        rng.shuffle(s2)
        rng.shuffle(d2)
        assert build_plans(s2, d2, min_split_bytes=64) == ref


def test_summaries():
    sources, dests = CASES["fused_qkv"]()
    plans = build_plans(sources, dests)
    check_plans(plans, sources, dests)
    one = plans[dests[0].rank].summary()
    assert one["bytes"] == one["needed_bytes"] > 0 and one["ops"] == len(plans[dests[0].rank])
    total = summarize(plans)
    assert total["bytes"] == total["needed_bytes"] == sum(p.needed_bytes for p in plans.values())
    assert set(total["bytes_per_destination"]) == {d.rank for d in dests}
    assert total["balance_max_over_mean"] >= 1.0
    json.dumps(total)  # plain data
    text = format_summary(total)
    assert "destinations" in text and "source rank" in text
