"""A subscriber frozen longer than its ``lease_ttl`` while a sync publisher waits on it is counted
dead (the publisher goes on). Before, it stayed dead for good: once resumed it kept pulling, but
publishers never waited for it again. Now its next pull finds its lease lapsed and joins again
under a new id, and publishers wait for it as before."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.runtime.harness import Worker, free_port

from .actors import FaultPub, FaultSub

pytestmark = pytest.mark.timeout(120)

TTL = 2.0


@pytest.mark.slow
def test_revived_subscriber_is_waited_for_again() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", FaultPub, url, 0, 1, 1, host_store=True, model_kind="tiny", transport="tcp", mode="sync")
    sub = Worker("sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp", lease_ttl=TTL)
    try:
        pub.send("publish", 1, timeout=30.0)
        assert sub.call("pull", min_version=1)["bad"] == []
        assert pub.result(30)["v"] == 1

        os.kill(sub.proc.pid, signal.SIGSTOP)  # frozen (a debugger, a swap storm) past its lease
        try:
            assert pub.call("publish", 2, timeout=30.0)["v"] == 2  # goes on once the lease lapsed
            assert pub.call("live_subscribers") == 0
        finally:
            os.kill(sub.proc.pid, signal.SIGCONT)
        got = sub.call("pull", min_version=2)
        assert got["v"] == 2 and got["bad"] == [], got
        assert pub.call("live_subscribers") == 1, "the revived subscriber is not waited for"

        pub.send("publish", 3, timeout=30.0)  # sync: must wait for the revived subscriber's ack
        time.sleep(1.0)
        assert not pub.ready(), "a sync publish returned without the live subscriber's ack"
        got = sub.call("pull", min_version=3)
        assert got["v"] == 3 and got["bad"] == [], got
        assert pub.result(30)["v"] == 3
    finally:
        sub.stop()
        pub.stop()
