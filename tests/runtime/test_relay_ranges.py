"""The byte-range arithmetic of ``wbridge.pull.ranges`` (splits, set differences, clipped plans) and the
checks of the zone arguments."""

from __future__ import annotations

import numpy as np
import pytest

from transports.base import ReadBatch
from wbridge import Publisher, Subscriber, UsageError, Zone
from wbridge.pull.ranges import ALIGN, clip, part, subtract, union


def test_parts_cover_the_buffer_once_aligned() -> None:
    for size in (0, 1, ALIGN - 1, 3 * ALIGN + 5, 10_000_000):
        for n in (1, 2, 3, 4, 7):
            ranges = [part(size, i, n) for i in range(n)]
            assert ranges[0][0] == 0 and ranges[-1][1] == size
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert all(lo % ALIGN == 0 for lo, _ in ranges[1:] if lo < size)
            if size >= n * ALIGN:
                sizes = [hi - lo for lo, hi in ranges]
                assert max(sizes) - min(sizes) <= 2 * ALIGN  # balanced: each cut within ALIGN / 2


def test_subtract_and_union() -> None:
    assert subtract([(0, 100)], [(10, 20), (50, 60)]) == [(0, 10), (20, 50), (60, 100)]
    assert subtract([(0, 10), (20, 30)], [(5, 25)]) == [(0, 5), (25, 30)]
    assert subtract([(0, 10)], [(0, 10)]) == []
    assert subtract([(0, 10)], []) == [(0, 10)]
    assert union([(5, 10), (0, 5), (20, 30), (25, 40)]) == [(0, 10), (20, 40)]


def test_clip_keeps_source_and_destination_in_step() -> None:
    batch = ReadBatch.of([(0, 1000, 0, 0, 100), (1, 0, 0, 100, 50), (0, 5000, 0, 150, 50)])
    got = clip(batch, [(50, 120), (190, 400)])
    rows = list(
        zip(*(getattr(got, c).tolist() for c in ("src_region", "src_offset", "dst_region", "dst_offset", "nbytes")))
    )
    assert rows == [(0, 1050, 0, 50, 50), (1, 0, 0, 100, 20), (0, 5040, 0, 190, 10)]
    assert clip(batch, []).total_bytes == 0
    assert np.array_equal(clip(batch, [(0, 200)]).nbytes, batch.nbytes)


@pytest.mark.parametrize("zone", ["", "a/b", 3, "z" * 129])
def test_bad_zone_is_usage_error(zone) -> None:
    # checked before the store is opened: nothing listens on these ports
    with pytest.raises(UsageError, match="zone"):
        Zone(zone)
    with pytest.raises(UsageError, match="zone"):
        Publisher("t", "tcp://127.0.0.1:1", zone=zone, connect_timeout=0.5)


def test_a_subscriber_zone_is_a_zone_value() -> None:
    # relay=True without a zone cannot be written; a bare name says what to write instead
    with pytest.raises(UsageError, match=r"write zone=Zone\('east'\)"):
        Subscriber("t", "tcp://127.0.0.1:1", zone="east", connect_timeout=0.5)
