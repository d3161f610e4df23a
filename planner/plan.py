"""Plans: frozen, inspectable lists of one-sided byte-range reads for one destination rank.

A plan stores its reads column-wise (numpy ``int64`` arrays, one group per source rank) because a
trillion-parameter job has millions of them; ``Plan.ops()`` yields them as ``ReadOp`` values.
Offsets are byte offsets inside the named regions of the source and destination ranks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import PlanError

COLUMNS = ("src_region", "src_offset", "dst_region", "dst_offset", "nbytes")


def frozen_int64(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only, contiguous ``int64`` array: the form of every column of a plan (no
    copy where ``a`` already has it)."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


def freeze_columns(obj: object, names: Sequence[str], what: str) -> int:
    """Turns the fields ``names`` of the frozen dataclass ``obj`` into ``frozen_int64`` columns
    and returns their common length; ``PlanError`` naming ``what`` when the lengths differ."""
    for c in names:
        object.__setattr__(obj, c, frozen_int64(getattr(obj, c)))
    lengths = {len(getattr(obj, c)) for c in names}
    if len(lengths) > 1:
        raise PlanError(f"{what}: columns of different lengths")
    return lengths.pop()


@dataclass(frozen=True)
class ReadOp:
    """Copy ``nbytes`` from ``src_offset`` of region ``src_region`` of rank ``src_rank`` to
    ``dst_offset`` of the destination's region ``dst_region``."""

    src_rank: int
    src_region: int
    src_offset: int
    dst_region: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class SourceOps:
    """All reads a plan makes from one source rank, as read-only ``int64`` columns."""

    src_rank: int
    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray

    def __post_init__(self) -> None:
        freeze_columns(self, COLUMNS, f"source rank {self.src_rank}")

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SourceOps)
            and self.src_rank == other.src_rank
            and all(np.array_equal(getattr(self, c), getattr(other, c)) for c in COLUMNS)
        )

    def __hash__(self) -> int:
        return hash((self.src_rank, len(self)))


@dataclass(frozen=True, eq=True)
class Plan:
    """The reads destination rank ``dst_rank`` performs, grouped by source rank (sorted).

    ``needed_bytes`` is the number of destination bytes that map to canonical data; a valid plan
    reads exactly that many bytes.
    """

    dst_rank: int
    sources: tuple[SourceOps, ...]
    needed_bytes: int

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    @property
    def total_bytes(self) -> int:
        return sum(s.total_bytes for s in self.sources)

    def bytes_per_source(self) -> dict[int, int]:
        return {s.src_rank: s.total_bytes for s in self.sources}

    def ops(self) -> Iterator[ReadOp]:
        for s in self.sources:
            cols = [getattr(s, c).tolist() for c in COLUMNS]
            for row in zip(*cols):
                yield ReadOp(s.src_rank, *row)

    def summary(self) -> dict:
        per = self.bytes_per_source()
        loads = list(per.values()) or [0]
        mean = sum(loads) / len(loads)
        return {
            "dst_rank": self.dst_rank,
            "ops": len(self),
            "bytes": self.total_bytes,
            "needed_bytes": self.needed_bytes,
            "bytes_per_source": per,
            "balance_max_over_mean": (max(loads) / mean) if mean else 1.0,
        }

    def to_json(self) -> str:
        return json.dumps(
            {
                "dst_rank": self.dst_rank,
                "needed_bytes": self.needed_bytes,
                "sources": [
                    {"src_rank": s.src_rank, **{c: getattr(s, c).tolist() for c in COLUMNS}} for s in self.sources
                ],
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        try:
            d = json.loads(text)
            return cls(
                int(d["dst_rank"]),
                tuple(SourceOps(int(s["src_rank"]), *(s[c] for c in COLUMNS)) for s in d["sources"]),
                int(d["needed_bytes"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed plan record: {e}") from e


def summarize(plans: Mapping[int, Plan] | Iterable[Plan]) -> dict:
    """Totals over many destinations: bytes per source and per destination, ops, balance.

    ``balance_max_over_mean`` is over the source ranks that serve anything.
    """
    plan_list = list(plans.values()) if isinstance(plans, Mapping) else list(plans)
    per_src: dict[int, int] = {}
    for p in plan_list:
        for r, v in p.bytes_per_source().items():
            per_src[r] = per_src.get(r, 0) + v
    loads = list(per_src.values()) or [0]
    mean = sum(loads) / len(loads)
    return {
        "destinations": len(plan_list),
        "ops": sum(len(p) for p in plan_list),
        "bytes": sum(p.total_bytes for p in plan_list),
        "needed_bytes": sum(p.needed_bytes for p in plan_list),
        "bytes_per_source": dict(sorted(per_src.items())),
        "bytes_per_destination": {p.dst_rank: p.total_bytes for p in sorted(plan_list, key=lambda p: p.dst_rank)},
        "balance_max_over_mean": (max(loads) / mean) if mean else 1.0,
    }


def format_summary(summary: dict) -> str:
    """A short human-readable rendering of ``Plan.summary()`` or ``summarize()``."""
    lines = []
    if "dst_rank" in summary:
        lines.append(
            f"plan for destination rank {summary['dst_rank']}: {summary['ops']} reads, "
            f"{summary['bytes']} of {summary['needed_bytes']} needed bytes"
        )
    else:
        lines.append(
            f"{summary['destinations']} destinations: {summary['ops']} reads, "
            f"{summary['bytes']} of {summary['needed_bytes']} needed bytes"
        )
    for r, v in summary["bytes_per_source"].items():
        lines.append(f"  source rank {r}: {v} bytes")
    lines.append(f"  balance (max/mean bytes per source): {summary['balance_max_over_mean']:.3f}")
    return "\n".join(lines)
