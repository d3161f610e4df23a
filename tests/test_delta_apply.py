"""Adding a source's decoded deltas into its destination (``wbridge.pull.delta_reads``): the host
path (one compiled ``add_pairs`` call over every read) and the path a device destination takes
(the changed bytes cut at the reads, a scatter per destination region) write the same bytes, for
reads that start and end on odd bytes, leave gaps, and land in several regions in any order."""

from __future__ import annotations

import numpy as np
import pytest

from transports.base import ReadBatch
from wbridge.protocol import delta as F
from wbridge.pull import delta_reads as R
from wbridge.pull.session import Source

from .test_delta_format import changed, truth


@pytest.mark.parametrize("reads", [5, 100])  # a write per read, or one per region (``FEW_READS``)
def test_the_device_path_writes_what_the_host_path_adds(reads: int) -> None:
    a, b = changed(4 * F.CHUNK_BYTES + 3, 0.05, 21, ulp=False)
    rng = np.random.default_rng(reads)
    cuts = np.unique(np.concatenate(([0, len(a)], rng.integers(1, len(a), reads - 1))))
    soff, end = cuts[:-1], cuts[1:].copy()
    end[1::3] -= 1  # gaps: bytes no read covers
    n = end - soff
    regions = 3
    dreg = rng.integers(0, regions, len(soff))
    doff = np.zeros(len(soff), np.int64)
    sizes = np.zeros(regions, np.int64)
    for i in rng.permutation(len(soff)):  # each region's reads in a shuffled order
        doff[i], sizes[dreg[i]] = sizes[dreg[i]], sizes[dreg[i]] + n[i]
    batch = ReadBatch(np.zeros(len(soff), np.int64), soff, dreg, doff, n)
    src = Source(0, "tcp", b"", [], batch)
    g = R.source_geometry(src, len(a), [b"d"], np.array([0], np.int64))
    assert g is not None
    at, diffs = truth(a, b)
    decoded = R.Decoded(((at, diffs.reshape(-1).view(np.uint32)),))
    host = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    device = [h.copy() for h in host]
    want = [h.copy() for h in host]
    for i in range(len(soff)):
        w = want[dreg[i]][doff[i] : doff[i] + n[i]]
        w += b[soff[i] : end[i]] - a[soff[i] : end[i]]
    F.add_pairs(at, decoded.pairs[0][1], g.soff, g.end, np.array([h.ctypes.data for h in host])[g.dreg] + g.doff)
    for w in R.writes(g, decoded):
        R.apply_write(device[w.region], w)
    assert all(np.array_equal(x, y) for x, y in zip(host, want))
    assert all(np.array_equal(x, y) for x, y in zip(device, want))
