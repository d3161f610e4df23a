"""Lower bounds a plan is measured against: the busiest source's bytes, and sources per reader.

``load_bound(demand)``: every byte a destination needs can come from any rank of its *candidate
set* (the source ranks holding it: DP replicas); ``demand`` maps each candidate set to the bytes
all destinations together need from it. Bytes are divisible (a read may be split anywhere), so the
least possible load of the busiest source is the fractional optimum, which equals the largest
*density* ``D(S) / |S|`` over source sets ``S``, ``D(S)`` being the bytes only ranks of ``S`` can
serve (no plan does better: those bytes must land on ``S``; max-flow/min-cut says some plan
reaches it). It is found with Dinkelbach's iteration: start at the mean; while a max flow with
every rank capped at ``T`` cannot carry all bytes, the ranks its minimum cut leaves saturated
form a set denser than ``T``: move ``T`` to that density. Where every rank of a replicated box
holds the same other bytes (DP replicas), the bound is what the simpler rule gives: per source,
the bytes it alone holds plus its fair share of each replicated set, maximised.

``min_sources(sets)``: the fewest source ranks one destination can read all its bytes from: the
smallest set of ranks meeting every candidate set (a minimum hitting set; exact search over
minimal sets, per group of sets that share ranks, which stays small for DP replicas).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from .errors import PlanError


def load_bound(demand: Mapping[tuple[int, ...], int], sources: Iterable[int] = ()) -> float:
    """The least bytes the busiest source must serve (see the module docstring); ``sources`` adds
    ranks that hold nothing needed (they count towards no set but lower nothing either)."""
    sets = [(tuple(c), int(b)) for c, b in demand.items() if b > 0]
    if not sets:
        return 0.0
    ranks = sorted({r for c, _ in sets for r in c} | set(sources))
    total = sum(b for _, b in sets)
    t = total / len(ranks)
    for _ in range(len(ranks) + 1):  # each step strictly raises T to a set's density
        dense = _saturated(sets, ranks, t)
        if dense is None:
            return t
        inside = set(dense)
        t_new = sum(b for c, b in sets if inside.issuperset(c)) / len(dense)
        if t_new <= t * (1 + 1e-12):
            return t
        t = t_new
    return t


def quick_bound(demand: Mapping[tuple[int, ...], int], sources: Iterable[int] = ()) -> float:
    """A lower bound of ``load_bound`` without a flow: the density of the set of all ranks (the
    mean) and of every candidate set (the bytes of the sets inside it over its size); equal to
    ``load_bound`` when the densest set of ranks is one of those (a pipeline stage whose
    replicated norms every rank of the stage holds, say)."""
    sets = [(frozenset(c), int(b)) for c, b in demand.items() if b > 0]
    if not sets:
        return 0.0
    ranks = {r for c, _ in sets for r in c} | set(sources)
    best = sum(b for _, b in sets) / len(ranks)
    for c, _ in sets:
        best = max(best, sum(b for d, b in sets if d <= c) / len(c))
    return best


def _saturated(sets: list[tuple[tuple[int, ...], int]], ranks: list[int], cap: float) -> list[int] | None:
    """None if a flow with every rank capped at ``cap`` serves every set; else the ranks on the
    source side of a minimum cut (a set of ranks denser than ``cap``)."""
    n_sets = len(sets)
    idx = {r: n_sets + i for i, r in enumerate(ranks)}
    s, t = n_sets + len(ranks), n_sets + len(ranks) + 1
    graph: list[list[list]] = [[] for _ in range(t + 1)]  # edge: [to, capacity, reverse edge]

    def edge(a: int, b: int, c: float) -> None:
        fwd = [b, c, None]
        rev = [a, 0.0, fwd]
        fwd[2] = rev
        graph[a].append(fwd)
        graph[b].append(rev)

    total = 0.0
    for i, (c, b) in enumerate(sets):
        edge(s, i, float(b))
        total += b
        for r in c:
            edge(i, idx[r], float("inf"))
    for r in ranks:
        edge(idx[r], t, cap)
    eps = 1e-9 * total
    flow = 0.0
    while True:  # Dinic: level graph by BFS, blocking flow by DFS
        level = [-1] * (t + 1)
        level[s] = 0
        q = deque([s])
        while q:
            u = q.popleft()
            for v, c, _ in graph[u]:
                if c > eps and level[v] < 0:
                    level[v] = level[u] + 1
                    q.append(v)
        if level[t] < 0:
            break
        it = [0] * (t + 1)
        while True:
            f = _push(graph, level, it, s, t, float("inf"), eps)
            if f <= 0:
                break
            flow += f
    if flow >= total - eps * 10:
        return None
    seen = [False] * (t + 1)
    seen[s] = True
    q = deque([s])
    while q:
        u = q.popleft()
        for v, c, _ in graph[u]:
            if c > eps and not seen[v]:
                seen[v] = True
                q.append(v)
    return [r for r in ranks if seen[idx[r]]]


def _push(graph: list[list[list]], level: list[int], it: list[int], u: int, t: int, f: float, eps: float) -> float:
    """One augmenting path of Dinic's blocking flow from ``u`` (paths are 3 edges long here)."""
    if u == t:
        return f
    while it[u] < len(graph[u]):
        e = graph[u][it[u]]
        v, c = e[0], e[1]
        if c > eps and level[v] == level[u] + 1:
            got = _push(graph, level, it, v, t, min(f, c), eps)
            if got > 0:
                e[1] -= got
                e[2][1] += got
                return got
        it[u] += 1
    return 0.0


def min_sources(sets: Iterable[Iterable[int]], *, max_nodes: int = 200_000) -> int:
    """The fewest ranks meeting every set of ``sets`` (see the module docstring); ``PlanError``
    if the exact search would visit more than ``max_nodes`` branches."""
    uniq = {frozenset(s) for s in sets}
    if frozenset() in uniq:
        raise PlanError("a candidate set without ranks cannot be met")
    minimal = [a for a in uniq if not any(b < a for b in uniq)]
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a in minimal:
        first = next(iter(a))
        for r in a:
            parent[find(r)] = find(first)
    parts: dict[int, list[frozenset[int]]] = {}
    for a in minimal:
        parts.setdefault(find(next(iter(a))), []).append(a)
    budget = [max_nodes]
    return sum(_hitting(sorted(p, key=len), budget) for p in parts.values())


def _hitting(sets: list[frozenset[int]], budget: list[int]) -> int:
    best = [len(sets)]  # one rank per set always works

    def search(chosen: frozenset[int], depth: int) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise PlanError("minimum source count: search too large")
        open_ = [a for a in sets if not (a & chosen)]
        if not open_:
            best[0] = min(best[0], depth)
            return
        if depth + 1 >= best[0]:
            return
        pick = min(open_, key=len)
        for r in sorted(pick):
            search(chosen | {r}, depth + 1)

    search(frozenset(), 0)
    return best[0]
