"""MoE-sized layouts: tens of thousands of local tensors register and plan without O(n^2) checks.

Bounded by the test timeout, not by a timed assertion: a quadratic duplicate-name check on
50,000 tensors takes minutes, the linear one well under a second.
"""

from __future__ import annotations

import pytest

from planner import LayoutBuilder, LayoutError, Shard, build_plans

pytestmark = pytest.mark.timeout(90)  # (4 s alone; over 30 s once, the suite's engines on both cores)

N = 50_000


def _experts(rank: int, n: int = N) -> LayoutBuilder:
    b = LayoutBuilder(rank)
    for e in range(n):
        b.add(f"experts.{e}.w", (4, 8), "bfloat16", Shard(f"experts.{e}.w", (4, 8)))
    return b


@pytest.mark.slow
def test_fifty_thousand_tensors_register_and_plan():
    src = _experts(0).build()
    assert len(src.tensors) == N and len(src.specs) == N
    dst = _experts(1, N).build()
    plan = build_plans([src], [dst])[1]
    assert plan.total_bytes == plan.needed_bytes == N * 64
    assert len(plan) == 1  # back-to-back tensors on both sides: one read


def test_duplicate_name_still_refused_at_scale():
    b = _experts(0)
    with pytest.raises(LayoutError, match="experts.49999.w"):
        b.add("experts.49999.w", (4, 8), "bfloat16", Shard("x", (4, 8)))
