"""Assigning reads to source ranks: rotation per destination, or joint longest-first balancing.

``choose_sources`` (what every destination gets first, alone or in a joint plan): one member of
each candidate set per destination, by ``rotation`` of its rank; see there.

``assign`` (the joint fallback of ``builder.build_plans``): each *item* is a block of bytes (one
source/destination box intersection) that any of its *candidate* ranks (replicas holding
identical bytes) can serve. ``assign`` returns, per item, the parts ``(rank, start, stop)`` (byte
ranges of the item) and updates the per-rank loads.

1. Items with one candidate go to it. The others, longest first, go whole to the least-loaded
   candidate (ties rotate with ``rotate``, so destinations planned one at a time spread over
   replicas).
2. Rebalancing, per candidate class (items with the same candidate set), largest class first:
   while the class's busiest rank holding a part of the class can give ``delta`` bytes of one of
   them to the class's least-loaded rank ``c`` (``delta <= (load_max - load_c) / 2``, a whole
   part only if smaller than the gap, split parts never below ``min_split`` bytes), do so. Each
   move strictly lowers the sum of squared loads, so it terminates (and is capped anyway);
   overlapping classes get a few sweeps.

Bound: a class stops when its busiest holder ``r`` has no move towards its least-loaded rank
``c``, which implies ``load[r] - load[c] < 2 * (min_split + align)`` (otherwise moving
``delta = gap / 2`` rounded down to ``align`` is a valid split, or the part is smaller than the
gap and moves whole). So when the candidate sets form disjoint classes (DP replica groups),
within every class the ranks holding its items differ from the class minimum by less than
``2 * (min_split + align)``: the busiest serves less than ``mean(class) + 2 * (min_split +
align)`` bytes. Splits happen only on the way. (With ``max_moves`` exhausted the last state is
returned; the cap only bounds planning time.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence

Part = list  # [rank, start, stop] (mutable while balancing)


def rotation(rank: int, m: int) -> int:
    """Which of ``m`` replicas destination ``rank`` reads from: the sum of ``rank``'s base-``m``
    digits, modulo ``m``; a rank knows it without knowing the other ranks.

    Ranks that differ in one base-``m`` digit only get ``m`` distinct answers (``m`` consecutive
    ranks from a multiple of ``m``, say), and so do the copies of a rank in replicas numbered one
    after another (rank ``t + 16 * j`` for ``j = 0..7`` and ``m`` = 2, 4 or 8, as in
    ``benchmarks/plan_scale.py``): their reads of a replicated box spread evenly over its replicas.
    """
    if m <= 1:
        return 0
    total = 0
    while rank:
        rank, digit = divmod(rank, m)
        total += digit
    return total % m


def choose_sources(rank: int, need: Mapping[tuple[int, ...], int], *, follow: float) -> dict[tuple[int, ...], int]:
    """The member of each candidate set (sorted source ranks holding the same bytes) that
    destination ``rank``, needing ``need[c]`` bytes of set ``c``, reads the whole set from.

    Sets go largest first (ties by the set). A set of at most ``follow`` times the largest set's
    bytes that holds a rank already chosen reads from the first such rank (small replicated
    tensors, norms say, add no source); any other set reads from ``c[rotation(rank, len(c))]``.
    Depends on nothing but ``rank`` and ``need``: a rank planning alone chooses what it would in a
    joint plan.
    """
    order = sorted(need, key=lambda c: (-need[c], c))
    small = need[order[0]] * follow if order else 0
    chosen: dict[tuple[int, ...], int] = {}
    used: list[int] = []
    for c in order:
        r = None
        if need[c] <= small:
            members = set(c)
            r = next((x for x in used if x in members), None)
        if r is None:
            r = c[rotation(rank, len(c))]
            if r not in used:
                used.append(r)
        chosen[c] = r
    return chosen


def assign(
    weights: Sequence[int],
    candidates: Sequence[Sequence[int]],
    loads: MutableMapping[int, int],
    *,
    min_split: int,
    align: int = 4096,
    rotate: int = 0,
    max_moves: int | None = None,
) -> list[list[Part]]:
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
        _rebalance(
            parts,
            multi,
            candidates,
            loads,
            min_split,
            align,
            max_moves if max_moves is not None else 8 * len(multi) + 64,
        )
    return parts


def _rebalance(
    parts: list[list[Part]],
    multi: list[int],
    candidates: Sequence[Sequence[int]],
    loads: MutableMapping[int, int],
    min_split: int,
    align: int,
    max_moves: int,
) -> None:
    by_class: dict[tuple[int, ...], list[int]] = {}
    for i in multi:
        by_class.setdefault(tuple(candidates[i]), []).append(i)
    order = sorted(by_class.items(), key=lambda kv: (-sum(parts[i][0][2] for i in kv[1]), kv[0]))
    budget = max_moves
    for _sweep in range(3):  # overlapping classes disturb each other; a few sweeps settle them
        moved = False
        for cls, items in order:
            n = _rebalance_class(cls, items, parts, loads, min_split, align, budget)
            budget -= n
            moved |= n > 0
        if not moved or budget <= 0:
            return


def _rebalance_class(
    cls: tuple[int, ...],
    items: list[int],
    parts: list[list[Part]],
    loads: MutableMapping[int, int],
    min_split: int,
    align: int,
    budget: int,
) -> int:
    """Moves bytes of this class's items from its busiest holder to its least-loaded rank."""
    held: dict[int, dict[int, Part]] = {r: {} for r in cls}
    for i in items:
        for p in parts[i]:
            held[p[0]][id(p)] = p
    index_of = {id(p): i for i in items for p in parts[i]}
    moves = 0
    while moves < budget:
        r = max((x for x in cls if held[x]), key=lambda x: (loads.get(x, 0), -x), default=None)
        if r is None:
            return moves
        c = min((x for x in cls if x != r), key=lambda x: (loads.get(x, 0), x))
        gap = loads.get(r, 0) - loads.get(c, 0)
        if gap <= 0:
            return moves
        move = _find_move(held[r].values(), gap, min_split, align)
        if move is None:
            return moves
        p, delta = move
        if delta == p[2] - p[1]:
            del held[r][id(p)]
            p[0] = c
            held[c][id(p)] = p
        else:
            q = [c, p[2] - delta, p[2]]
            p[2] -= delta
            i = index_of[id(p)]
            parts[i].append(q)
            index_of[id(q)] = i
            held[c][id(q)] = q
        loads[r] -= delta
        loads[c] = loads.get(c, 0) + delta
        moves += 1
    return moves


def _find_move(held: Iterable[Part], gap: int, min_split: int, align: int) -> tuple[Part, int] | None:
    """A part (largest first) and how many of its bytes to move across a load ``gap``."""
    delta = (gap // 2) // align * align
    for p in sorted(held, key=lambda p: p[1] - p[2]):
        size = p[2] - p[1]
        if delta >= size:
            return p, size
        if delta >= min_split and size - delta >= min_split:
            return p, delta
        if size < gap:
            return p, size
    return None
