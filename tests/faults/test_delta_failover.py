"""Delta pulls fail over to replicas like full pulls (issue 27, defect 7): publishers encode deltas
(``Staging(delta=Delta())``) on two DP replicas, and the source a subscriber's pull of the next
version is reading dies half-way through that read. Before, such a pull could raise
``TransportError`` where a full pull read from the surviving replica; now a delta pull whose source
dies falls back to the full read, which fails over to the replica, and ends bit-exact."""

from __future__ import annotations

import pytest

from tests.runtime.delta_actors import DeltaPub, DeltaSub
from tests.runtime.harness import Worker, call_all
from wbridge import Async, Delta, Staging

from .actors import pause_fault, release, wait_paused

pytestmark = pytest.mark.timeout(180)

FRAC = 0.02
# Which read of the subscriber to stop (1-based over its whole life, counting reads of 1 KiB and
# more): version 1 is one data read (and a stamp read); version 2's delta pull (of whole slots)
# reads each delta whole (header, tables and streams) and the slot stamp in one read, stopped
# half-way: the stamp is in its second half, read after the victim died.
STAGES = {
    "deltas": dict(on_reads=(2,)),
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", sorted(STAGES))
@pytest.mark.parametrize("victim", [0, 1])
def test_delta_pull_fails_over_when_a_replica_dies(standalone_store: str, tmp_path, victim: int, stage: str) -> None:
    url = standalone_store  # outside the publishers: either may die
    kw = dict(staging=Staging(delta=Delta()), transport="tcp", mode=Async(max_staleness=100), host_store=False)
    pubs = [Worker(f"pub{r}", DeltaPub, url, rank=r, world_size=2, **kw) for r in range(2)]
    fault, paused, go = pause_fault(tmp_path, **STAGES[stage])
    sub = Worker("sub", DeltaSub, url, transport="tcp", fault=fault)
    try:
        call_all(pubs, "publish")
        assert sub.call("pull", min_version=1)["v"] == 1 and sub.call("bad", []) == []
        call_all(pubs, "step", 2, FRAC)
        sub.send("pull", min_version=2, timeout=60.0)
        wait_paused(paused, 1)
        pubs[victim].kill()
        release(go)
        got = sub.result(60)
        print(f"{stage}, victim rank {victim}: {got}")
        assert got["v"] == 2 and sub.call("bad", [(2, FRAC)]) == [], got
        # where the victim was the pull's source, the deltas could not be read: a full read failed over
        assert got["delta"] or got["why"] == "source-failed", got
    finally:
        sub.stop()
        for p in pubs:
            p.stop()
