"""Assigning reads to source ranks: longest-first greedy, then splitting only where it helps.

Each *item* is a block of bytes (one source/destination box intersection) that any of its
*candidate* ranks (replicas holding identical bytes) can serve. ``assign`` returns, per item, the
parts ``(rank, start, stop)`` (byte ranges of the item) and updates the per-rank loads.

1. Items with one candidate go to it. The others, longest first, go whole to the least-loaded
   candidate (ties rotate with ``rotate``, so destinations planned one at a time spread over
   replicas).
2. Rebalancing: while the busiest rank that holds a movable part can give ``delta`` bytes of one
   of its parts to a less-loaded candidate ``c`` (``delta <= (load_max - load_c) / 2``, whole
   parts only if smaller than the gap, split parts never below ``min_split`` bytes), do so. Each
   move strictly lowers the sum of squared loads, so it terminates (and is capped anyway).

Bound: when it stops, the busiest rank ``r`` that holds movable parts satisfies, for every
candidate ``c`` of every part on ``r``: ``load[c] > load[r] - 2 * (min_split + align)``. So when
the items' candidate sets form disjoint classes (DP replica groups), the busiest rank of a class
serves at most ``mean(class) + 2 * (min_split + align)`` bytes; splits happen only on the way.
"""
from __future__ import annotations

from typing import MutableMapping, Sequence

Part = list  # [rank, start, stop] (mutable while balancing)


def assign(weights: Sequence[int], candidates: Sequence[Sequence[int]],
           loads: MutableMapping[int, int], *, min_split: int, align: int = 4096,
           rotate: int = 0, max_moves: int | None = None) -> list[list[Part]]:
    """Assigns every item (``weights[i]`` bytes, served by any rank of ``candidates[i]``)."""
    parts: list[list[Part]] = [None] * len(weights)  # type: ignore[list-item]
    multi: list[int] = []
    for i, (w, cand) in enumerate(zip(weights, candidates)):
        if len(cand) == 1:
            r = cand[0]
            parts[i] = [[r, 0, w]]
            loads[r] = loads.get(r, 0) + w
        else:
            multi.append(i)
    multi.sort(key=lambda i: -weights[i])
    for i in multi:
        cand = candidates[i]
        m = len(cand)
        best = min(range(m), key=lambda j: (loads.get(cand[j], 0), (j - rotate) % m))
        r = cand[best]
        w = weights[i]
        parts[i] = [[r, 0, w]]
        loads[r] = loads.get(r, 0) + w
    if multi:
        _rebalance(parts, multi, candidates, loads, min_split, align,
                   max_moves if max_moves is not None else 8 * len(multi) + 64)
    return parts


def _rebalance(parts: list[list[Part]], multi: list[int], candidates: Sequence[Sequence[int]],
               loads: MutableMapping[int, int], min_split: int, align: int, max_moves: int) -> None:
    held: dict[int, dict[int, tuple[int, Part]]] = {}
    for i in multi:
        for p in parts[i]:
            held.setdefault(p[0], {})[id(p)] = (i, p)
    for _ in range(max_moves):
        movable = [r for r, h in held.items() if h]
        if not movable:
            return
        r = max(movable, key=lambda x: (loads[x], -x))
        lr = loads[r]
        move = None
        for i, p in sorted(held[r].values(), key=lambda ip: ip[1][1] - ip[1][2]):
            size = p[2] - p[1]
            c = min((x for x in candidates[i] if x != r), key=lambda x: (loads.get(x, 0), x))
            gap = lr - loads.get(c, 0)
            if gap <= 0:
                continue
            delta = (gap // 2) // align * align
            if delta >= size:
                move = (i, p, c, size)
                break
            if delta >= min_split and size - delta >= min_split:
                move = (i, p, c, delta)
                break
            if size < gap:
                move = (i, p, c, size)
                break
        if move is None:
            return
        i, p, c, delta = move
        size = p[2] - p[1]
        if delta == size:
            del held[r][id(p)]
            p[0] = c
            held.setdefault(c, {})[id(p)] = (i, p)
        else:
            q = [c, p[2] - delta, p[2]]
            p[2] -= delta
            parts[i].append(q)
            held.setdefault(c, {})[id(q)] = (i, q)
        loads[r] -= delta
        loads[c] = loads.get(c, 0) + delta
