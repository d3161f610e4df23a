"""The version record's per-rank fields are sealed, never defaulted into something else: the delta
extents a reader of whole slots reads each delta by (``VersionRecord.deltas``) are ints >= 0, one
list per publisher rank, or the record is a ``StoreError``."""

from __future__ import annotations

import pytest

from wbridge.errors import StoreError
from wbridge.protocol.version import VersionRecord


def record(**kw: object) -> VersionRecord:
    fields = dict(v=3, epoch=1, slot=1, fence=2, world_size=2, zero_copy=False, checksums=True, committed_at=0.0)
    return VersionRecord(**{**fields, **kw})


def test_delta_extents_are_one_list_of_sizes_per_rank() -> None:
    rec = record(deltas=[[4096, 0, 9000], [0, 0, 0]])  # (as the record's JSON holds them)
    assert rec.deltas == ((4096, 0, 9000), (0, 0, 0))
    assert record().deltas == ()  # publishers without deltas
    for bad in ([[4096]], [[-1, 0], [0, 0]], [["x"], [0]], [5, 6]):
        with pytest.raises(StoreError, match="malformed version record"):
            record(deltas=bad)
