"""The bounds plans are measured against: the busiest source's least load, the fewest sources."""

from __future__ import annotations

import itertools
import random

import pytest

from planner.bounds import load_bound, min_sources, quick_bound
from planner.errors import PlanError


def brute_force_bound(demand: dict[tuple[int, ...], int], ranks: list[int]) -> float:
    """max over rank sets S of (bytes only S holds) / |S|: the definition, by enumeration."""
    best = 0.0
    for k in range(1, len(ranks) + 1):
        for s in itertools.combinations(ranks, k):
            inside = set(s)
            best = max(best, sum(b for c, b in demand.items() if inside.issuperset(c)) / k)
    return best


def test_bound_is_not_the_fair_share_where_holders_differ():
    # Rank 0 alone holds 10 bytes and shares 10 with rank 1: giving rank 1 all shared bytes
    # balances them at 10 each (a fair split of the shared bytes would load rank 0 with 15).
    assert load_bound({(0,): 10, (0, 1): 10}) == pytest.approx(10.0)
    # Where the shared bytes cannot even it out, the lone bytes decide.
    assert load_bound({(0,): 30, (0, 1): 10}) == pytest.approx(30.0)
    # Ranks holding nothing needed count towards the mean only.
    assert load_bound({(0, 1): 10}, range(4)) == pytest.approx(5.0)


@pytest.mark.parametrize("seed", range(30))
def test_bound_matches_the_definition(seed):
    rng = random.Random(seed)
    ranks = list(range(rng.randint(2, 6)))
    demand: dict[tuple[int, ...], int] = {}
    for _ in range(rng.randint(1, 6)):
        c = tuple(sorted(rng.sample(ranks, rng.randint(1, len(ranks)))))
        demand[c] = demand.get(c, 0) + rng.randint(1, 1000)
    exact = brute_force_bound(demand, ranks)
    assert load_bound(demand, ranks) == pytest.approx(exact, rel=1e-9)
    assert quick_bound(demand, ranks) <= exact * (1 + 1e-12)


def test_min_sources():
    assert min_sources([(0, 1), (1, 2), (2, 3)]) == 2  # 1 and 2 (or 1 and 3...)
    assert min_sources([(0,), (1,), (0, 1)]) == 2
    assert min_sources([(0, 1, 2, 3), (0, 4), (2, 6)]) == 2  # 0 and 2 meet all three
    assert min_sources([(0, 8), (100, 108)]) == 2  # disjoint groups add up
    with pytest.raises(PlanError):
        min_sources([()])
