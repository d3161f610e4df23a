"""etcd crashes and comes back while publishers and a subscriber run: a pull stopped half-way when
etcd dies finishes once it is back, publishes issued while it is down complete, nobody reconnects
by hand, and the subscriber's lease survives."""

from __future__ import annotations

import time

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary
from tests.runtime.harness import Worker, call_all

from .actors import FaultPub, FaultSub, pause_fault, release, wait_paused

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (apt-get install -y etcd-server)"),
]

DOWN_FOR = 1.0  # seconds etcd stays down: longer than a poll, shorter than the lease TTL


@pytest.mark.slow
def test_etcd_restart_while_publishing_and_pulling(tmp_path) -> None:
    server = EtcdServer()
    fault, paused, go = pause_fault(tmp_path, on_reads=(3, 4))  # the pull of version 2
    pubs, sub = [], None
    try:
        server.start()
        url = server.url + "/restart/"
        # one_step_off: publish(v) waits for the subscriber's ack of v-1, read through etcd
        pubs = [Worker(f"pub{r}", FaultPub, url, r, 2, 2, model_kind="tiny", transport="tcp") for r in range(2)]
        sub = Worker(
            "sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp", lease_ttl=5.0, fault=fault
        )
        call_all(pubs, "publish", 1)
        assert sub.call("pull", min_version=1)["bad"] == []
        call_all(pubs, "publish", 2)

        sub.send("pull", min_version=2, timeout=60.0)
        wait_paused(paused, 2)  # version 2 half read from both ranks
        server.kill()  # etcd crashes mid-pull
        for p in pubs:  # and publishes of version 3 start while it is down
            p.send("publish", 3, timeout=60.0)
        release(go)
        time.sleep(DOWN_FOR)  # the outage (not an assertion)
        assert not sub.ready() and not any(p.ready() for p in pubs), "finished without a store?"
        server.start()  # same data directory, same address

        got = sub.result(60)  # the pull's fence check and ack waited for etcd
        assert got["v"] == 2 and got["bad"] == [], got
        assert [r["v"] for r in (p.result(60) for p in pubs)] == [3, 3]
        got = sub.call("pull", min_version=3, timeout=30.0)
        assert got["v"] == 3 and got["bad"] == [], got
        assert pubs[0].call("live_subscribers") == 1, "the subscriber's lease did not survive the restart"
        call_all(pubs, "publish", 4)
        assert sub.call("pull", min_version=4)["bad"] == []
    finally:
        if sub is not None:
            sub.stop()
        for p in pubs:
            p.stop()
        server.close()
