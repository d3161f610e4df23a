"""A counter any store client can write is read defensively (issue 27, defect 5). A client without
the token sets the subscriber counter to 10**6: before, the aggregating publisher rank took every id
up to it for a subscriber about to appear and read a million records per scan, so every publish
failed, and still did after the counter was repaired (it kept the forged high-water mark, so
subscribers joining after the repair were never found). Now the jump is logged and the ids in it
are not looked for; publishing goes on, and a subscriber that joins after the repair is counted."""

from __future__ import annotations

import pytest

from tests.runtime.harness import Worker
from wbridge.store import open_store

from .actors import FaultPub, FaultSub

pytestmark = pytest.mark.timeout(180)

SUB = dict(fused=False, model_kind="tiny", transport="tcp", lease_ttl=5.0)


@pytest.mark.slow
@pytest.mark.parametrize("store_url", ["cli", "etcd"], indirect=True)
def test_forged_subscriber_counter_is_ignored_and_recovered_from(store_url: str) -> None:
    url = store_url
    pub = Worker("pub", FaultPub, url, 0, 1, 1, model_kind="tiny", transport="tcp", mode="one_step_off")
    subs = [Worker("sub", FaultSub, url, 1, 0, **SUB)]
    spy = open_store(url, connect_timeout=10.0)  # a store client without the token
    try:
        assert pub.call("publish", 1)["v"] == 1
        assert subs[0].call("pull", min_version=1)["bad"] == []
        live = subs[0].call("live_key")
        counter = live[: live.index("sub/")] + "subs"
        sane = spy.get(counter)
        spy.set(counter, b"1000000")  # the forged write
        for v in (2, 3):  # publishing goes on (it waits for the subscriber's acks)
            assert pub.call("publish", v, timeout=10.0)["v"] == v
            assert subs[0].call("pull", min_version=v, timeout=10.0)["bad"] == []
        spy.set(counter, sane)  # repaired
        subs.append(Worker("sub-late", FaultSub, url, 1, 0, **SUB))
        assert pub.call("api", "wait_for_subscribers", 2, timeout=10.0) == 2
        assert subs[1].call("pull", min_version=3, timeout=10.0)["bad"] == []  # (publish 4 waits for its ack)
        assert pub.call("publish", 4, timeout=10.0)["v"] == 4
        for s in subs:
            got = s.call("pull", min_version=4, timeout=10.0)
            assert got["v"] == 4 and got["bad"] == [], got
        assert sorted(s["id"] for s in pub.call("subscribers")) == [1, 2]
    finally:
        spy.close()
        for w in [*subs, pub]:
            w.stop()


@pytest.mark.slow
def test_forged_relay_counter_is_ignored_and_recovered_from(standalone_store: str) -> None:
    """The same for a zone's relay counter: before, every reader of the zone read a million relay
    record keys per look and its pulls timed out."""
    from tests.runtime.actors import PubActor, SubActor
    from wbridge import Async, Staging, Zone

    url = standalone_store
    pub = Worker("pub", PubActor, url, 0, 1, 1, staging=Staging(checksums=True), mode=Async(max_staleness=100))
    relay = dict(fused=False, zone=Zone("a", relay=True), transport="tcp")
    workers = [Worker("relay1", SubActor, url, 1, 0, **relay)]
    reader = Worker("reader", FaultSub, url, 1, 0, fused=True, model_kind="small", zone=Zone("a"), transport="tcp")
    spy = open_store(url, connect_timeout=10.0)  # a store client without the token
    try:
        pub.call("publish", 1)
        assert workers[0].call("pull", 1)["bad"] == []
        assert reader.call("pull", 1)["from_peers"] > 0
        live = reader.call("live_key")
        counter = live[: live.index("sub/")] + "zone/a/n"
        sane = spy.get(counter)
        spy.set(counter, b"1000000")  # the forged write
        pub.call("publish", 2)
        assert workers[0].call("pull", 2)["bad"] == []
        got = reader.call("pull", 2, timeout=10.0)
        assert got["bad"] == [] and got["from_peers"] > 0, got  # still reads its relay
        spy.set(counter, sane)  # repaired; a relay that joins now is read too
        workers.append(Worker("relay2", SubActor, url, 1, 0, **relay))
        workers[0].stop()
        pub.call("publish", 3)
        assert workers[1].call("pull", 3)["bad"] == []
        got = reader.call("pull", 3, timeout=10.0)
        assert got["bad"] == [] and got["from_peers"] > 0, got
    finally:
        spy.close()
        for w in [reader, *workers, pub]:
            w.stop()
