"""Blocking semantics of the sync modes, checked with timestamps taken in the processes.

A subscriber is told to wait before it starts pulling (``DELAY`` seconds, or at a gate the test
opens: ``HOLD``); a publish that must wait for its ack can only return after that start, and one
that must not wait returns before it."""

from __future__ import annotations

import time

import pytest

from wbridge import Async, ZeroCopy

from .actors import PubActor, SubActor
from .harness import Worker, free_port

DELAY = 1.0
# A subscriber held at a gate starts pulling once the test opens the gate, or after HOLD seconds: a
# publish that must not wait returns while it is held (however slow a loaded machine makes it), and
# one that wrongly waits for its ack returns only after HOLD.
HOLD = 20.0


def held_publish(pub: Worker, v: int, gate) -> dict:
    """``publish(v)`` while the subscriber is held; the gate opens 0.5 s after the call went out.
    A publish that must wait for the subscriber's ack returns after the gate opened; one that does
    not wait has returned by then (unless a loaded machine slowed it past 0.5 s: the check can
    then miss, never fail wrongly)."""
    pub.send("publish", v)
    time.sleep(0.5)
    gate.touch()
    return pub.result(60.0)


def pair(mode: str, lease_ttl: float = 10.0, **pub_kwargs) -> tuple[Worker, Worker]:
    """A publisher and a subscriber. The lease outlasts a process frozen for seconds by a loaded
    machine: a lapsed lease would end the publisher's wait for the ack these tests time."""
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", PubActor, url, 0, 1, 1, host_store=True, model_kind="tiny", mode=mode, **pub_kwargs)
    sub = Worker("sub", SubActor, url, 1, 0, fused=False, model_kind="tiny", lease_ttl=lease_ttl)
    return pub, sub


@pytest.mark.timeout(90)
def test_sync_publish_returns_after_every_ack() -> None:
    pub, sub = pair("sync")
    try:
        sub.send("pull", min_version=1, delay=DELAY)
        p = pub.call("publish", 1)
        s = sub.result()
        assert s["v"] == 1 and s["bad"] == []
        assert p["t_ret"] >= s["t_start"], "sync publish returned before the subscriber pulled"
    finally:
        sub.stop(), pub.stop()


@pytest.mark.timeout(90)
def test_one_step_off_waits_only_for_the_previous_version(tmp_path) -> None:
    pub, sub = pair("one_step_off")
    gate = tmp_path / "pull"
    try:
        sub.send("pull", min_version=1, delay=HOLD, gate=str(gate))
        p1 = pub.call("publish", 1)
        p2 = held_publish(pub, 2, gate)
        s1 = sub.result()
        assert s1["bad"] == []
        assert p1["t_ret"] < s1["t_start"], "publish(1) waited for an ack it must not wait for"
        assert p2["t_ret"] >= s1["t_start"], "publish(2) returned before version 1 was acked"
        s2 = sub.call("pull", min_version=2)
        assert s2["v"] == 2 and s2["bad"] == []
    finally:
        sub.stop(), pub.stop()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("k", [1, 2])
def test_async_blocks_only_past_max_staleness(k: int, tmp_path) -> None:
    pub, sub = pair(Async(max_staleness=k))
    gate = tmp_path / "pull"
    try:
        sub.send("pull", min_version=1, delay=HOLD, gate=str(gate))
        returns = [pub.call("publish", v)["t_ret"] for v in range(1, k + 1)]
        returns.append(held_publish(pub, k + 1, gate)["t_ret"])
        s = sub.result()
        assert s["bad"] == [] or s["v"] > 1
        # versions 1..k leave the subscriber (acked 0) at most k behind: no waiting
        assert all(t < s["t_start"] for t in returns[:k]), "async publish waited inside the bound"
        # version k+1 would put it k+1 behind: publish waits for its ack
        assert returns[k] >= s["t_start"], "async publish let a subscriber fall too far behind"
    finally:
        sub.stop(), pub.stop()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sync_publisher_stops_waiting_for_a_dead_subscriber() -> None:
    pub, sub = pair("sync", lease_ttl=2.0)
    try:
        assert pub.call("live_subscribers") == 1
        sub.kill()
        t0 = time.monotonic()
        p = pub.call("publish", 1, timeout=30.0)
        elapsed = time.monotonic() - t0
        assert p["v"] == 1
        assert elapsed < 10.0, f"publish waited {elapsed:.1f}s for a dead subscriber (lease ttl 2s)"
        assert pub.call("live_subscribers") == 0
    finally:
        pub.stop()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_zero_copy_serves_live_tensors_until_every_ack() -> None:
    pub, sub = pair("one_step_off", staging=ZeroCopy())
    try:
        for v in (1, 2):
            sub.send("pull", min_version=v, delay=DELAY)
            p = pub.call("publish", v)
            s = sub.result()
            assert s["v"] == v and s["bad"] == []
            assert p["t_ret"] >= s["t_start"], "zero-copy publish returned before the ack"
        # once publish() returned, the trainer owns its tensors again: v2 is fenced off
        late = sub.call("try_pull", timeout=1.5)
        assert late["error"] is None and late["v"] == 2  # already applied: no read needed
    finally:
        sub.stop(), pub.stop()
