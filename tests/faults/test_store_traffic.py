"""Store traffic per version stays O(publishers + subscribers): counted call by call (the control-
plane benchmark's ``CountingStore``) with real publishers and subscribers in several processes on a
real TCPStore and a real etcd.

A sync subscriber's steady state is four calls per version: one batched read of the generation,
its own record, the version record and the slot fences; one blocking wait on the next version's
``ready`` key, which carries that version's record; its reading mark; its ack. Only the aggregating
publisher rank (rank 0) reads subscribers' keys: the other ranks learn the readers' layouts from
one key (``Keys.readers``) and the waits' outcomes from the keys rank 0 writes, and in a slow round
(a subscriber acking seconds later) they see rank 0 at work on the same key instead of scanning;
once rank 0 is gone mid-wait, they scan by themselves and the publish still completes."""

from __future__ import annotations

import threading
import time

import pytest

from benchmarks.control_plane import CHANNEL, TOKEN, Publishers, Run, StoreEnv, _sub_tensors
from tests.etcd_fixture import etcd_binary
from tests.runtime.harness import Worker
from wbridge import Subscriber, open_store

P, S, VERSIONS = 3, 6, 6
SLOW_S = 5.0  # the slow subscriber's pause before each pull: spans the other ranks' looks at 2 s and 4 s


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_calls_per_version_subscribers_four_and_only_rank0_scans(kind: str) -> None:
    if kind == "etcd" and etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    env = StoreEnv(kind)
    try:
        run = Run(env, P, S, 2)
        try:
            run.pubs.publish(2)
            pubs0, subs0, _ = run.requests()
            before = [store.calls.copy() for store in run.pubs.stores]
            run.pubs.publish(VERSIONS)
            _, subs1, errors = run.requests()
            assert not errors, errors
            subs = subs1 - subs0
            per_sub = subs.total() / (VERSIONS * S)
            # 4 exactly, but a subscriber's read and wait for the version after the last may or
            # may not have begun when the count is taken: up to 2 calls more each
            assert per_sub <= 4.0 + 2 / VERSIONS, f"{per_sub:.2f} calls per subscriber and version: {dict(subs)}"
            for rank, (store, old) in enumerate(zip(run.pubs.stores, before)):
                scans = {k: n for k, n in (store.calls - old).items() if "sub/" in k[1]}
                assert (rank == 0) == bool(scans), f"rank {rank} read subscriber keys: {scans}"
        finally:
            run.close()
    finally:
        env.close()


class SlowSub:
    """A subscriber (in its own process) that pulls only when told, after a pause."""

    def __init__(self, url: str, p: int) -> None:
        self.sub = Subscriber(CHANNEL, open_store(url), token=TOKEN, transport="tcp", lease_ttl=30.0, name="slow")
        self.sub.register(_sub_tensors(1, p))  # row 1: served by rank 1, which outlives rank 0

    def pull_after(self, pause: float) -> int:
        time.sleep(pause)
        return self.sub.pull(timeout=60.0)


def _scans(pubs: Publishers, rank: int, before: list) -> dict:
    return {k: n for k, n in (pubs.stores[rank].calls - before[rank]).items() if "sub/" in k[1]}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_slow_round_other_ranks_wait_on_rank0_and_scan_once_it_is_gone() -> None:
    env = StoreEnv("tcp")
    pubs = sub = None
    try:
        url = env.fresh()
        pubs = Publishers(url, P)
        sub = Worker("slow-sub", SlowSub, url, P)
        sub.send("pull_after", SLOW_S)
        before = [st.calls.copy() for st in pubs.stores]
        pubs.publish(1, timeout=60.0)  # sync: every rank waits SLOW_S for the ack of version 1
        assert sub.result(30) == 1
        for rank in range(1, P):
            assert not _scans(pubs, rank, before), f"rank {rank} scanned while rank 0 was at work"
        assert pubs.stores[0].calls["set", "aggregating"] >= 2, dict(pubs.stores[0].calls)

        # rank 0 closes (its process would die) while every rank waits for the ack of version 2
        sub.send("pull_after", SLOW_S)
        before = [st.calls.copy() for st in pubs.stores]
        done: dict = {}

        def publish(rank: int) -> None:
            try:
                done[rank] = pubs.pubs[rank].publish(timeout=60.0)
            except Exception as e:  # noqa: BLE001 - rank 0's is expected
                done[rank] = type(e).__name__

        threads = [threading.Thread(target=publish, args=(r,)) for r in range(P)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        pubs.pubs[0].close()
        for t in threads:
            t.join(60)
        assert sub.result(30) == 2
        assert done == {0: "UsageError", **{r: 2 for r in range(1, P)}}, done
        for rank in range(1, P):
            assert _scans(pubs, rank, before), f"rank {rank} never scanned with rank 0 gone"
    finally:
        if sub is not None:
            sub.stop()
        if pubs is not None:
            pubs.close()
        env.close()
