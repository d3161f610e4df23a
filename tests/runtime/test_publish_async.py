"""``Publisher.publish_async()``: the snapshot runs on the publisher's thread, the future carries
the version or the error, and close() with a publish in flight neither hangs nor leaks the thread.

Real processes and a real TcpStore. Not tested here: that a write breaking the contract (writing
the live tensors before the future is done) is caught. It is not: the slot stamps tell a reader
that the *staging slot* changed under its reads, but a trainer writing its *live* tensors during
the copy leaves a slot that is stable and torn, and nothing downstream can tell it from a real
version. That is why the contract is on the caller (on a GPU, the copy stream's ordering).
"""

from __future__ import annotations

import threading
import time

import pytest

from wbridge.testing.synthetic import set_version

from .actors import PubActor, SubActor
from .harness import Worker, call_all, free_port

DELAY = 1.0


class AsyncPubActor(PubActor):
    """A trainer rank that publishes the way a GPU trainer overlaps its snapshot: the previous
    version's future is awaited right before the write of the next version's values."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fut = None

    def step(self, v: int, timeout: float = 30.0) -> dict:
        if self.fut is not None:
            self.fut.result(timeout=timeout)
        set_version(self.tensors, v)  # the optimizer step
        self.fut = self.pub.publish_async(timeout=timeout)
        return {"t_ret": time.time(), "done_at_return": self.fut.done()}

    def result(self, timeout: float = 30.0) -> dict:
        v = self.fut.result(timeout=timeout)
        return {"v": v, "t_done": time.time(), "stats": vars(self.pub.stats.last)}

    def try_publish(self, v: int, timeout: float, background: bool) -> dict:
        """One publish expected to fail: the error class it raised (through the future, or not)."""
        set_version(self.tensors, v)
        t0 = time.monotonic()
        try:
            if background:
                self.pub.publish_async(timeout=timeout).result(timeout=timeout + 30.0)
            else:
                self.pub.publish(timeout=timeout)
            return {"error": None}
        except Exception as e:  # noqa: BLE001
            return {
                "error": type(e).__name__,
                "mro": [c.__name__ for c in type(e).__mro__],
                "message": str(e),
                "elapsed": time.monotonic() - t0,
            }

    def close_in_flight(self, timeout: float) -> dict:
        """Starts a publish that cannot finish (a live subscriber never acks), then closes."""
        set_version(self.tensors, 1)
        fut = self.pub.publish_async(timeout=timeout)
        time.sleep(0.3)  # let it get into its wait for acks (not an assertion)
        in_flight = not fut.done()
        t0 = time.monotonic()
        self.pub.close()
        close_s = time.monotonic() - t0
        try:
            fut.result(timeout=1.0)
            error = None
        except Exception as e:  # noqa: BLE001
            error = type(e).__name__
        return {
            "in_flight": in_flight,
            "close_s": close_s,
            "error": error,
            "repr": repr(self.pub),
            "threads": [t.name for t in threading.enumerate() if t.name.startswith("wbridge-publish")],
        }


def _channel(mode: str, world: int, tp: int, **pub_kwargs) -> tuple[str, list[Worker]]:
    url = f"tcp://127.0.0.1:{free_port()}"
    pubs = [
        Worker(f"pub{r}", AsyncPubActor, url, r, world, tp, host_store=(r == 0), mode=mode, **pub_kwargs)
        for r in range(world)
    ]
    return url, pubs


def _stop(*workers: Worker) -> None:
    for w in workers:
        w.stop()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_publish_async_returns_at_once_and_subscribers_get_every_version_bit_exact() -> None:
    """sync mode makes the point sharpest: publish_async returns before the ack it must wait for,
    and the future resolves only after it. Two publisher ranks (TP=2), two subscribers (fused
    TP=2 rank 0, unfused TP=1), garbage in their tensors before every pull."""
    url, pubs = _channel("sync", 2, 2)
    subs = [
        Worker("sub-fused", SubActor, url, 2, 0, fused=True, lease_ttl=5.0),
        Worker("sub-full", SubActor, url, 1, 0, fused=False, lease_ttl=5.0),
    ]
    try:
        for v in (1, 2, 3):
            for s in subs:
                s.send("pull", min_version=v, delay=DELAY)
            steps = call_all(pubs, "step", v)
            done = call_all(pubs, "result")
            pulled = [s.result() for s in subs]
            for p in pulled:
                assert p["v"] == v and p["bad"] == [], p
            for st, dn in zip(steps, done):
                # not done when it returned: it did not block on the acks (no timing race under load)
                assert not st["done_at_return"], "publish_async returned a finished future in sync mode"
                assert dn["v"] == v
                assert all(dn["t_done"] >= p["t_start"] for p in pulled), "the future resolved before the acks"
                assert dn["stats"]["background"] and dn["stats"]["version"] == v
                assert dn["stats"]["nbytes"] > 0 and dn["stats"]["stall_s"] > 0
    finally:
        _stop(*subs, *pubs)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_errors_come_through_the_future_as_publish_raises_them() -> None:
    url, pubs = _channel("sync", 1, 1)
    mute = Worker("mute", SubActor, url, 1, 0, fused=False, lease_ttl=30.0)  # live, never acks
    try:
        got_async = pubs[0].call("try_publish", 1, 1.0, True)
        got_sync = pubs[0].call("try_publish", 2, 1.0, False)
        assert got_async["error"] == got_sync["error"] == "WaitTimeout", (got_async, got_sync)
        assert "WBridgeError" in got_async["mro"] and "acks of version 1" in got_async["message"]
        assert got_async["elapsed"] < 10.0
    finally:
        _stop(mute, *pubs)


@pytest.mark.timeout(90)
def test_close_with_a_publish_in_flight_neither_hangs_nor_leaks_the_thread() -> None:
    url, pubs = _channel("sync", 1, 1)
    mute = Worker("mute", SubActor, url, 1, 0, fused=False, lease_ttl=30.0)
    try:
        got = pubs[0].call("close_in_flight", 60.0, call_timeout=30.0)
        assert got["in_flight"], "the publish finished on its own; nothing was in flight at close()"
        assert got["close_s"] < 5.0, f"close() took {got['close_s']:.1f}s with a publish in flight"
        assert got["error"] == "UsageError", got
        assert got["threads"] == [], f"publish thread still alive after close(): {got['threads']}"
        assert "closed" in got["repr"]
    finally:
        _stop(mute, *pubs)
