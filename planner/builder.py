"""Plan builder: assigns the chunks of ``planner.chunks`` to source ranks and returns validated plans.

How it works
------------
1. *Chunks.* ``chunks._SourceIndex`` and ``chunks._chunks_for`` intersect the layouts: each chunk
   is a box a destination needs, with the source ranks holding it (its *candidate set*: DP
   replicas). Destinations with identical layouts (rollout replicas) are intersected once.
2. *Sources.* Each destination reads every candidate set whole from one member,
   ``balance.choose_sources``: rotation by its rank over the replicas, following a source it
   reads anyway for small sets. That depends on nothing but the rank and its layout, so a rank
   planning alone (``build_plan``) gets exactly its part of a joint plan, and rollout ranks
   numbered replica by replica spread evenly over the trainer replicas.
3. *Reads.* The reads of one candidate set served by one class of identical source layouts are
   emitted once per destination layout and relabelled for every member of the class (same
   addresses); a destination's reads from one rank are its blocks for that rank, coalesced.
4. *Joint balance.* ``build_plans`` checks the busiest source against ``bounds.load_bound``; where
   rotation leaves it more than ``ROTATION_SLACK`` above (fewer destinations than replicas, or
   ranks numbered otherwise), it balances jointly instead: ``balance.assign`` (longest-first to
   the least-loaded candidate, then splitting parts, never below ``min_split_bytes``) per
   destination layout, copies permuted inside source classes.
5. *Validation.* Plans go through ``validate.validate_plan`` before they are returned: per
   destination layout, every copy reading a candidate set no validated copy read.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from .balance import assign, choose_sources
from .bounds import load_bound, quick_bound
from .chunks import _Chunks, _chunks_for, _emit, _group_identical, _source_classes, _SourceIndex
from .errors import PlanError
from .layout import RankLayout
from .plan import COLUMNS, Plan, SourceOps
from .runs import coalesce

DEFAULT_MIN_SPLIT_BYTES = 1 << 20
#: How far above the lower bound of the busiest source's bytes rotation may leave a joint plan.
ROTATION_SLACK = 0.005
#: Candidate sets this small against a destination's largest read from a source it reads anyway.
FOLLOW = 1 / 64


def _rotation(
    base_loads: Mapping[int, int], loads: dict[int, int], classes: Mapping[int, tuple[int, ...]], copy: int
) -> dict[int, int]:
    """Rank permutation for one copy: rotate each class so its busiest source stays lowest."""
    perm: dict[int, int] = {}
    seen: set[tuple[int, ...]] = set()
    for r in sorted(base_loads):
        cls = classes[r]
        if cls in seen:
            continue
        seen.add(cls)
        m = len(cls)
        vals = [base_loads.get(x, 0) for x in cls]
        best, best_key = 0, None
        for j in range(m):
            o = (copy + j) % m
            key = max(loads.get(cls[(i + o) % m], 0) + vals[i] for i in range(m) if vals[i])
            if best_key is None or key < best_key:
                best, best_key = o, key
        for i, x in enumerate(cls):
            if vals[i]:
                y = cls[(i + best) % m]
                perm[x] = y
                loads[y] = loads.get(y, 0) + vals[i]
    return perm


def build_plans(
    sources: Sequence[RankLayout],
    dests: Sequence[RankLayout],
    *,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
    transforms: Mapping[str, str] | None = None,
) -> dict[int, Plan]:
    """Plans every rank in ``dests`` together against ``sources``; returns ``{dst_rank: Plan}``.

    Every destination byte that maps to canonical data is read exactly once. Among sources that
    hold the same bytes (replicas) each destination reads all bytes of one candidate set from one
    member (``balance.choose_sources``: by rotation over the replicas, following a source it reads
    anyway for small sets), which depends on its rank and layout only: what ``build_plan`` gives
    the rank alone, so a rank joining later plans its own part of this plan. Where that leaves
    the busiest source more than ``ROTATION_SLACK`` above the lower bound for these destinations
    (fewer destination copies than source replicas, say), the reads are balanced jointly
    instead, splitting reads (never below ``min_split_bytes``) where that lowers the busiest
    source. Raises ``PlanError`` (naming tensors and ranks) if the result would not validate.
    ``transforms`` names, per canonical tensor, an allowed dtype change.
    """
    return _without_gc(sources, dests, min_split_bytes=min_split_bytes, transforms=transforms, lone=False)


def _without_gc(sources: Sequence[RankLayout], dests: Sequence[RankLayout], **kwargs) -> dict[int, Plan]:
    """``_build_plans`` with the cyclic GC paused: planning allocates millions of small objects
    while the layouts hold millions more, and the GC would rescan them all again and again (2-3x
    the planning time). Nothing here makes cycles."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_plans(sources, dests, **kwargs)
    finally:
        if gc_was_enabled:
            gc.enable()


def _build_plans(
    sources: Sequence[RankLayout],
    dests: Sequence[RankLayout],
    *,
    min_split_bytes: int,
    transforms: Mapping[str, str] | None,
    lone: bool,
    indexed: tuple[dict[int, tuple[int, ...]], _SourceIndex] | None = None,
) -> dict[int, Plan]:
    """``build_plans`` (``build_plan`` with ``lone``: rotation only); ``indexed`` is
    ``(_source_classes(sources), its _SourceIndex)`` when the caller has built them already
    (``packing.build_packed_plans``)."""
    transforms = dict(transforms or {})
    if min_split_bytes < 1:
        raise PlanError(f"min_split_bytes must be positive, got {min_split_bytes}")
    sources = sorted(sources, key=lambda s: s.rank)
    for a, b in itertools.pairwise(sources):
        if a.rank == b.rank:
            raise PlanError(f"source rank {a.rank} given twice")
    dests = list(dests)
    seen_dst: set[int] = set()
    for d in dests:
        if d.rank in seen_dst:
            raise PlanError(f"destination rank {d.rank} given twice")
        seen_dst.add(d.rank)

    if indexed is None:
        classes = _source_classes(sources)
        index = _SourceIndex(sources, sorted(set(classes.values())))
    else:
        classes, index = indexed
    align = 4096 if min_split_bytes >= 4096 else 16

    groups = [sorted(same, key=lambda d: d.rank) for same in _group_identical(sorted(dests, key=lambda d: d.rank))]

    missing: dict[str, list[int]] = {}
    partial: list[str] = []
    chunked = []
    for copies in groups:
        ch = _chunks_for(index, copies[0], transforms, missing, partial)
        chunked.append((copies, ch))
    if missing or partial:
        same = {copies[0].rank: [d.rank for d in copies] for copies, _ in chunked}
        lines = [
            f"{name!r} (destination ranks {sorted(x for r in ranks for x in same[r])}; no source rank holds it)"
            for name, ranks in sorted(missing.items())
        ]
        lines += partial[:20] + ([f"... and {len(partial) - 20} more"] if len(partial) > 20 else [])
        raise PlanError("destination bytes without a source: " + "; ".join(lines))

    by_cands = [_by_candidates(ch) for _, ch in chunked]
    if lone or _rotation_balances(chunked, by_cands, sources):
        return _rotated_plans(chunked, by_cands, sources, classes)
    return _joint_plans(chunked, sources, classes, min_split_bytes, align)


def _by_candidates(ch: _Chunks) -> dict[tuple[int, ...], list[int]]:
    """The chunks of ``ch`` per candidate set (the source ranks holding their bytes)."""
    out: dict[tuple[int, ...], list[int]] = {}
    for i, g in enumerate(ch.group):
        out.setdefault(g.ranks, []).append(i)
    return out


def candidate_demand(
    sources: Sequence[RankLayout], dests: Sequence[RankLayout], *, transforms: Mapping[str, str] | None = None
) -> dict[int, dict[tuple[int, ...], int]]:
    """Per destination rank, the bytes it needs from each candidate set (the sorted source ranks
    holding them), as the planner sees them; the input of ``bounds.load_bound`` (summed over
    destinations) and ``bounds.min_sources`` (one destination's sets). Raises ``PlanError`` for
    bytes no source holds."""
    sources = sorted(sources, key=lambda s: s.rank)
    classes = _source_classes(sources)
    index = _SourceIndex(sources, sorted(set(classes.values())))
    missing: dict[str, list[int]] = {}
    partial: list[str] = []
    out: dict[int, dict[tuple[int, ...], int]] = {}
    for same in _group_identical(list(dests)):
        ch = _chunks_for(index, same[0], dict(transforms or {}), missing, partial)
        if missing or partial:
            raise PlanError(f"destination rank {same[0].rank}: bytes without a source")
        need = {c: sum(ch.nbytes[i] for i in items) for c, items in _by_candidates(ch).items()}
        for d in same:
            out[d.rank] = need
    return out


def _rotation_balances(
    chunked: list[tuple[list[RankLayout], _Chunks]],
    by_cands: list[dict[tuple[int, ...], list[int]]],
    sources: Sequence[RankLayout],
) -> bool:
    """Whether reading each candidate set whole from its member ``choose_sources`` picks leaves the
    busiest source within ``ROTATION_SLACK`` of the lower bound for these destinations."""
    loads: dict[int, int] = {}
    demand: dict[tuple[int, ...], int] = {}
    for (copies, ch), byc in zip(chunked, by_cands):
        need = {c: sum(ch.nbytes[i] for i in items) for c, items in byc.items()}
        for c, b in need.items():
            demand[c] = demand.get(c, 0) + b * len(copies)
        for d in copies:
            for c, r in choose_sources(d.rank, need, follow=FOLLOW).items():
                loads[r] = loads.get(r, 0) + need[c]
    if not loads:
        return True
    busiest = max(loads.values()) / (1 + ROTATION_SLACK)
    ranks = [s.rank for s in sources]
    return busiest <= quick_bound(demand, ranks) or busiest <= load_bound(demand, ranks)


def _rotated_plans(
    chunked: list[tuple[list[RankLayout], _Chunks]],
    by_cands: list[dict[tuple[int, ...], list[int]]],
    sources: Sequence[RankLayout],
    classes: Mapping[int, tuple[int, ...]],
) -> dict[int, Plan]:
    """Every destination reads each candidate set whole from the member ``choose_sources`` picks.

    The reads of one candidate set served by one source class are emitted once per destination
    layout (*blocks*) and relabelled for every member of the class (identical layouts: same
    addresses); a destination's reads from one rank are its blocks for that rank, coalesced. A copy
    reading a candidate set that no validated copy of its layout read is validated; the blocks of
    a set for other classes differ only by the source addresses each class declared (as the
    rotated copies of a joint plan differ from their validated base).
    """
    # Imported here: validate.py needs nothing from this module, but keep the graph acyclic.
    from .validate import validate_plan

    out: dict[int, Plan] = {}
    vcache: dict = {}
    for (copies, ch), byc in zip(chunked, by_cands):
        blocks: dict[tuple[tuple[int, ...], tuple[int, ...]], SourceOps] = {}
        checked: set[tuple[int, ...]] = set()
        need = {c: sum(ch.nbytes[i] for i in items) for c, items in byc.items()}
        for d in copies:
            per_rank: dict[int, list[SourceOps]] = {}
            keys = []
            chosen = choose_sources(d.rank, need, follow=FOLLOW)
            for c, items in byc.items():
                r = chosen[c]
                key = (c, classes[r])
                blk = blocks.get(key)
                if blk is None:
                    blk = blocks[key] = _emit(ch, [[[r, 0, ch.nbytes[i]]] for i in items], items)[0]
                per_rank.setdefault(r, []).append(blk)
                keys.append(c)
            ops = []
            for r in sorted(per_rank):
                bl = per_rank[r]
                cols = (
                    [getattr(bl[0], c) for c in COLUMNS]
                    if len(bl) == 1
                    else coalesce(*(np.concatenate([getattr(b, c) for b in bl]) for c in COLUMNS))
                )
                ops.append(SourceOps(r, *cols))
            plan = out[d.rank] = Plan(d.rank, tuple(ops), ch.needed)
            if not checked.issuperset(keys):
                validate_plan(plan, sources, d, cache=vcache, samples=64)
                checked.update(keys)
    return {r: out[r] for r in sorted(out)}


def _joint_plans(
    chunked: list[tuple[list[RankLayout], _Chunks]],
    sources: Sequence[RankLayout],
    classes: Mapping[int, tuple[int, ...]],
    min_split_bytes: int,
    align: int,
) -> dict[int, Plan]:
    """Balances the destinations jointly where rotation alone does not (see ``build_plans``):
    longest-first and splitting (``balance.assign``) per destination layout against the load so
    far, copies rotated over identical source replicas."""
    from .validate import validate_plan

    loads: dict[int, int] = {}
    out: dict[int, Plan] = {}
    vcache: dict = {}
    for copies, ch in chunked:
        # The base plan balances against the load so far, scaled to one copy's share.
        base_loads = {r: v // len(copies) for r, v in loads.items()}
        parts = assign(
            ch.nbytes,
            [g.ranks for g in ch.group],
            base_loads,
            min_split=min_split_bytes,
            align=align,
            rotate=copies[0].rank,
        )
        srcs = _emit(ch, parts)
        own = {s.src_rank: s.total_bytes for s in srcs}
        base = Plan(copies[0].rank, srcs, ch.needed)
        validate_plan(base, sources, copies[0], cache=vcache, samples=64)
        for j, d in enumerate(copies):
            perm = _rotation(own, loads, classes, j)
            ops = sorted(
                (
                    SourceOps(
                        perm.get(s.src_rank, s.src_rank),
                        s.src_region,
                        s.src_offset,
                        s.dst_region,
                        s.dst_offset,
                        s.nbytes,
                    )
                    for s in srcs
                ),
                key=lambda s: s.src_rank,
            )
            out[d.rank] = Plan(d.rank, tuple(ops), ch.needed)
    return {r: out[r] for r in sorted(out)}


def build_plan(
    sources: Sequence[RankLayout],
    dest: RankLayout,
    *,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
    transforms: Mapping[str, str] | None = None,
) -> Plan:
    """The plan of one rank planning alone (a subscriber): its part of any ``build_plans`` whose
    rotation is balanced (see there), since each rank's sources follow from its own rank."""
    plans = _without_gc(sources, [dest], min_split_bytes=min_split_bytes, transforms=transforms, lone=True)
    return plans[dest.rank]
