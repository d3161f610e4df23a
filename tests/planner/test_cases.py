"""Table-driven planner tests: every layout kind, executed on real byte buffers."""

from __future__ import annotations

import pytest

from planner import build_plan, build_plans

from .cases import CASES
from .helpers import check_plans

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("min_split", [1 << 20, 64])
def test_case_joint(name, min_split):
    sources, dests = CASES[name]()
    plans = build_plans(sources, dests, min_split_bytes=min_split)
    check_plans(plans, sources, dests)


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_one_destination_at_a_time(name):
    sources, dests = CASES[name]()
    plans = {d.rank: build_plan(sources, d, min_split_bytes=64) for d in dests}
    check_plans(plans, sources, dests)
