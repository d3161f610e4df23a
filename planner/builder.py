"""Plan builder: intersects source and destination layouts into balanced, validated read plans."""
from __future__ import annotations

from typing import Mapping, Sequence

from .layout import RankLayout
from .plan import Plan

DEFAULT_MIN_SPLIT_BYTES = 1 << 20


def build_plans(sources: Sequence[RankLayout], dests: Sequence[RankLayout], *,
                min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
                transforms: Mapping[str, str] | None = None) -> dict[int, Plan]:
    """Plans every rank in ``dests`` together against ``sources``; returns ``{dst_rank: Plan}``.

    Every destination byte that maps to canonical data is read exactly once; among sources that
    hold the same bytes (replicas) the reads are assigned to minimise the largest number of bytes
    any source serves across all ``dests``. Raises ``PlanError`` (naming tensors and ranks) if the
    result would not validate. ``transforms`` names, per canonical tensor, an allowed dtype change.
    """
    raise NotImplementedError


def build_plan(sources: Sequence[RankLayout], dest: RankLayout, **kwargs) -> Plan:
    """``build_plans(sources, [dest])[dest.rank]``."""
    return build_plans(sources, [dest], **kwargs)[dest.rank]
