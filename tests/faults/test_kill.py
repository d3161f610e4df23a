"""Processes SIGKILLed in the middle of a pull: a publisher rank (the subscriber fails in time and
holds no complete version; after a restart and a new epoch the next pull is exact) and a subscriber
(a ``sync`` publisher stops waiting for it once its lease lapses)."""

from __future__ import annotations

import time

import pytest

from tests.runtime.harness import Worker, call_all, free_port
from wbridge import Async, open_store

from .actors import FaultPub, FaultSub, pause_fault, release, wait_paused

PULL_TIMEOUT = 8.0
SLACK = 6.0  # a loaded 2-core machine: process wake-ups and store round trips


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "store_url,staged",
    [("cli", False), ("etcd", True)],
    indirect=["store_url"],
    ids=["cli-store-direct", "etcd-staged"],
)
def test_publisher_killed_mid_pull_then_restarted(store_url: str, staged: bool, tmp_path) -> None:
    # TP=2 publishers; a TP=1 subscriber reads half of every tensor from each rank (2 sources,
    # one batch each). Its reads 3 and 4 (the pull of v2) stop half-way; rank 1 dies there.
    fault, paused, go = pause_fault(tmp_path, on_reads=(3, 4))
    kw = dict(model_kind="tiny", mode=Async(max_staleness=10), transport="tcp")
    pubs = [Worker(f"pub{r}", FaultPub, store_url, r, 2, 2, **kw) for r in range(2)]
    sub = Worker(
        "sub", FaultSub, store_url, 1, 0, fused=False, staged=staged, transport="tcp", model_kind="tiny", fault=fault
    )
    try:
        call_all(pubs, "publish", 1)
        assert sub.call("pull", min_version=1)["bad"] == []
        before = sub.call("digest")
        call_all(pubs, "publish", 2)
        sub.send("try_pull", timeout=PULL_TIMEOUT)
        wait_paused(paused, 2)
        pubs[1].kill()
        release(go)
        r = sub.result(PULL_TIMEOUT + 30)
        assert r["error"] in ("TransportError", "WaitTimeout"), r
        assert "WBridgeError" in r["mro"]
        assert r["elapsed"] <= PULL_TIMEOUT + SLACK, r
        if staged:
            assert r["version"] == 1, "staged: the live tensors still hold version 1"
            assert sub.call("digest") == before, "staged: a failed pull changed the live tensors"
        else:
            assert r["version"] is None, "a failed pull must not claim a complete version"
            assert sub.call("check", 2) != [], "half of rank 1's bytes were never read"

        # The store lives outside the dead rank: rank 1 comes back, every rank registers again
        # (a new epoch), the next version is published and pulled bit-exactly.
        pubs[1] = Worker("pub1-restarted", FaultPub, store_url, 1, 2, 2, **kw)
        assert pubs[0].call("reregister") == 2 == pubs[1].call("epoch")
        got = call_all(pubs, "publish", 3)
        assert [g["v"] for g in got] == [3, 3]
        r = sub.call("pull", min_version=3, timeout=30.0)
        assert r["v"] == 3 and r["bad"] == [], r
    finally:
        sub.stop()
        for p in pubs:
            p.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_subscriber_killed_mid_pull_sync_publisher_stops_waiting(kind: str, tmp_path, request) -> None:
    # short, to time how soon a dead subscriber stops counting; not so short that a live one, its
    # lease thread starved on a loaded machine (or etcd slow to keep it alive), lapses before the kill
    ttl = 3.0
    if kind == "tcp":
        url = f"tcp://127.0.0.1:{free_port()}"
        pub = Worker("pub", FaultPub, url, 0, 1, 1, host_store=True, model_kind="tiny", mode="sync")
    else:
        url = request.getfixturevalue("etcd_url")
        pub = Worker("pub", FaultPub, url, 0, 1, 1, model_kind="tiny", mode="sync")
    fault, paused, _ = pause_fault(tmp_path, on_reads=(2,))  # never released: it dies paused
    sub = Worker(
        "sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp", lease_ttl=ttl, fault=fault
    )
    try:
        sub.send("pull", min_version=1)
        assert pub.call("publish", 1)["v"] == 1  # sync: returns once the subscriber acked 1
        assert sub.result()["bad"] == []
        live_key = sub.call("live_key")
        assert [s["acked"] for s in pub.call("subscribers")] == [1]

        pub.send("publish", 2, timeout=60.0)
        sub.send("pull", min_version=2)
        wait_paused(paused, 1)
        assert not pub.ready(), "sync publish(2) returned while its subscriber was still reading"
        t_kill = time.time()
        sub.kill()
        got = pub.result(60)
        assert got["v"] == 2
        waited = got["t_ret"] - t_kill
        assert waited <= ttl + SLACK, f"publish waited {waited:.1f}s for a subscriber dead for ttl={ttl}s"
        assert pub.call("subscribers") == [], "the dead subscriber still counts as live"
        # Nothing leaked: the next publishes (one reuses the slot the dead one was reading) do not wait.
        for v in (3, 4):
            t0 = time.time()
            assert pub.call("publish", v, timeout=30.0)["v"] == v
            assert time.time() - t0 < SLACK
        if kind == "etcd":
            with open_store(url, connect_timeout=10) as store:
                assert store.get(live_key) is None, "etcd still holds the dead subscriber's lease key"
    finally:
        sub.stop()
        pub.stop()
