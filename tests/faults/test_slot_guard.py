"""A reader holds its slot: with one staging slot (``one_step_off``), the publish that would
overwrite the slot a subscriber is reading waits for it. While the reader lives (stopped half-way
through its reads), the publish does not return and the reader then finishes bit-exactly with the
version it began; once a reader is SIGKILLed half-way, the publish goes ahead when, and only when,
its lease lapses."""

from __future__ import annotations

import os
import time

import pytest

from tests.runtime.harness import Worker

from .actors import FaultSub, one_slot_pub, pause_fault, release, wait_paused

TTL = 3.0
SLACK = 6.0  # a loaded 2-core machine: process wake-ups and store round trips


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_reader_blocks_overwrite_of_its_slot_until_its_lease_lapses(kind: str, tmp_path, request) -> None:
    pub, url = one_slot_pub(kind, request)
    fault, paused, go = pause_fault(tmp_path, on_reads=(2, 3))  # the pulls of versions 2 and 3
    sub = Worker(
        "sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp", lease_ttl=TTL, fault=fault
    )
    try:
        assert pub.call("publish", 1)["v"] == 1
        assert sub.call("pull", min_version=1)["bad"] == []
        assert pub.call("publish", 2)["v"] == 2

        # A live reader, stopped half-way through version 2: version 3 (same slot) must wait.
        sub.send("pull", min_version=2, timeout=60.0)
        wait_paused(paused, 1)
        pub.send("publish", 3, timeout=60.0)
        time.sleep(2 * TTL)  # not an assertion: several lease periods with the reader alive
        assert not pub.ready(), "publish(3) overwrote the slot under a live reader"
        release(go)
        got = sub.result(60)
        assert got["v"] == 2 and got["bad"] == [], f"the reader of version 2 saw its slot change: {got}"
        assert pub.result(60)["v"] == 3

        # A reader killed half-way through version 3: version 4 waits until its lease lapses.
        os.remove(go)
        sub.send("pull", min_version=3, timeout=60.0)
        wait_paused(paused, 2)
        pub.send("publish", 4, timeout=60.0)
        time.sleep(1.0)  # not an assertion: the publish is blocked on the reader by now
        assert not pub.ready(), "publish(4) overwrote the slot under a live reader"
        t_kill = time.time()
        sub.kill()
        got = pub.result(60)
        waited = got["t_ret"] - t_kill
        assert got["v"] == 4
        assert TTL / 2 <= waited <= TTL + SLACK, f"publish(4) returned {waited:.1f}s after the kill (ttl={TTL}s)"
        assert pub.call("subscribers") == []
    finally:
        sub.stop()
        pub.stop()
