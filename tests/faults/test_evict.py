"""A subscriber reported dead stops counting at once (``Publisher.evict``), long before its lease
would lapse; a live one is never evicted by it, and one evicted while alive is not harmed.

One publisher (``one_step_off``, one staging slot: a reader holds the slot it reads) and two
subscribers with a 30 s lease. The victim is SIGKILLed half-way through reading version 2, holding
its reading mark and not having acked it: the publish of version 3 waits for it, until a third
process (a driver, as in a Ray job: ``Channel.evict``, through the store) evicts it a second later,
and then returns at once (not after the 30 s lease). The bystander stays counted throughout: the
next publish waits for its ack. Then the publisher evicts the bystander itself (``Publisher.evict``)
while it is alive, half-way through a read: the publisher overwrites its slot (its read fails stale
and retries the newer version, bit-exact, never torn), and its next pull joins again under a new
id, after which publishes wait for it again.
"""

from __future__ import annotations

import time

import pytest

from tests.runtime.actors import TOKEN
from tests.runtime.harness import Worker
from wbridge.errors import UsageError
from wbridge.integrations.ray import Channel

from .actors import FaultSub, one_slot_pub, pause_fault, release, wait_paused

TTL = 30.0  # long: a publish that waited for the lease would be unmistakable
SLACK = 6.0  # a loaded 2-core machine: process wake-ups and store round trips


def names(pub: Worker) -> list[str]:
    return sorted(s["name"] for s in pub.call("subscribers"))


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_evicted_dead_reader_stops_counting_at_once(kind: str, tmp_path, request) -> None:
    pub, url = one_slot_pub(kind, request)
    (tmp_path / "v").mkdir()
    (tmp_path / "b").mkdir()
    v_fault, v_paused, _ = pause_fault(tmp_path / "v", on_reads=(2,))  # the victim's pull of version 2
    b_fault, b_paused, b_go = pause_fault(tmp_path / "b", on_reads=(4,))  # the bystander's of version 4
    sub_kw = dict(fused=False, model_kind="tiny", transport="tcp", lease_ttl=TTL)
    victim = Worker("victim", FaultSub, url, 1, 0, sub_name="victim", fault=v_fault, **sub_kw)
    bystander = Worker("bystander", FaultSub, url, 1, 0, sub_name="bystander", fault=b_fault, **sub_kw)
    try:
        assert pub.call("publish", 1)["v"] == 1
        for s in (victim, bystander):
            assert s.call("pull", min_version=1)["bad"] == []
        assert pub.call("publish", 2)["v"] == 2
        assert bystander.call("pull", min_version=2)["bad"] == []

        # The victim dies half-way through reading version 2 (its mark says so, it acked 1 only).
        victim.send("pull", min_version=2, timeout=60.0)
        wait_paused(v_paused, 1)
        t_kill = time.time()
        victim.kill()
        # Version 3 (same slot, needs the acks of 2) waits for it until it is evicted, 1 s later.
        pub.send("publish", 3, timeout=60.0)
        time.sleep(1.0)
        assert not pub.ready(), "publish(3) did not wait for the dead reader"
        t_evict = time.time()
        assert Channel("t", url, TOKEN).evict("victim") == 1
        got = pub.result(60)
        waited = got["t_ret"] - t_evict
        assert got["v"] == 3
        assert waited < TTL / 5, f"publish(3) returned {waited:.1f}s after the eviction (lease ttl {TTL}s)"
        assert got["t_ret"] - t_kill < TTL / 3
        assert names(pub) == ["bystander"]

        # The bystander was not evicted: the next publish waits for its ack of 3.
        pub.send("publish", 4, timeout=60.0)
        time.sleep(1.0)  # not an assertion: the publish is blocked on the bystander by now
        assert not pub.ready(), "publish(4) did not wait for the live bystander's ack"
        assert bystander.call("pull", min_version=3)["bad"] == []
        assert pub.result(60)["v"] == 4

        # Evicting a live reader half-way through version 4: the slot is no longer held for it...
        old_id = pub.call("subscribers")[0]["id"]
        bystander.send("pull", min_version=4, timeout=60.0)
        wait_paused(b_paused, 1)
        assert pub.call("evict", "bystander") == 1
        assert pub.call("publish", 5, timeout=SLACK)["v"] == 5
        # ... its read fails stale and it takes version 5 instead, bit-exact
        release(b_go)
        got = bystander.result(60)
        assert got["v"] == 5 and got["bad"] == [] and got["retries"] >= 1, got
        # ... and its next pull joins again under a new id: publishes wait for it again.
        assert bystander.call("pull")["v"] == 5
        subs = pub.call("subscribers")
        assert len(subs) == 1, f"the evicted bystander did not join again: {subs}"
        now = subs[0]
        assert now["name"] == "bystander" and now["id"] != old_id and now["acked"] == 5, now
        assert pub.call("publish", 6)["v"] == 6
        pub.send("publish", 7, timeout=60.0)
        time.sleep(1.0)  # not an assertion: the publish is blocked on the bystander by now
        assert not pub.ready(), "publish(7) did not wait for the re-joined bystander's ack of 6"
        assert bystander.call("pull", min_version=6)["bad"] == []
        assert pub.result(60)["v"] == 7
        for bad in (True, "", 0, 1.5):  # a typed error, not an eviction of subscriber 1
            with pytest.raises(UsageError):
                Channel("t", url, TOKEN).evict(bad)
        assert names(pub) == ["bystander"]
    finally:
        victim.stop()
        bystander.stop()
        pub.stop()
