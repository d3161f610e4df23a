"""A follow loop keeps following after the store is lost (issue 36, defect 2).

A subscriber that only waits for versions (``wait_version``, ``latest``, ``versions()``: what the
vLLM watcher, the SGLang follow loop and the Ray actor run) used to keep reading the lost store
generation after the store came back empty and the trainers registered again: it never saw another
version, with no error, while a plain ``pull()`` on the same subscriber got the new one at once.

Here a watcher thread runs the loop an engine runs (wait for a version above what it holds, pull it)
on a registered subscriber, and one ``versions()`` loop runs on a watcher that never registered; the
store is lost (the TCP store's process restarted empty, or etcd's keys wiped) and the trainer
publishes a new history, whose contents differ from the old one's. Both loops reach the new history's
newest version, and the registered subscriber holds its bytes.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.runtime.actors import TOKEN
from tests.runtime.harness import Worker, WorkerError
from wbridge import Async, Subscriber, WaitTimeout, WBridgeError
from wbridge.testing.synthetic import ModelConfig, make_tensors, mismatches

from .actors import FaultPub
from .conftest import standalone_store_proc
from .test_sealed_versions import Attacker

pytestmark = pytest.mark.timeout(180)


def publish(pub: Worker, content: int, within: float = 60.0) -> int:
    """Publishes ``content``; again while the publisher meets the store still coming back."""
    deadline = time.monotonic() + within
    while True:
        try:
            return pub.call("publish", content)["v"]
        except WorkerError as e:
            if e.exc_type not in ("StoreError", "WaitTimeout") or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Follower:
    """The loop an engine's watcher runs, on its own thread: wait for a version above the one held
    (``wait_version``), pull it; ``pulled`` lists ``(version, content check)`` of each pull."""

    def __init__(self, sub: Subscriber, tensors: dict) -> None:
        self.sub, self.tensors = sub, tensors
        self.pulled: list[tuple[int, int]] = []  # (version, the content it holds)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                v = self.sub.wait_version(timeout=1.0)
                got = self.sub.pull(min_version=v, timeout=10.0)
            except WaitTimeout:
                continue
            except WBridgeError as e:  # the store still coming back: the loop goes on
                self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.2)
                continue
            held = next((c for c in (got, 100 + got) if mismatches(self.tensors, c) == []), None)
            self.pulled.append((got, held))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


async def _versions(url: str, want: int, timeout: float) -> list[int]:
    """A watcher that never registers, following with ``versions()`` until it sees ``want``."""
    seen: list[int] = []
    with Subscriber("t", url, token=TOKEN, connect_timeout=10) as watcher:

        async def loop() -> None:
            async for v in watcher.versions():
                seen.append(v)
                if v == want:
                    return

        try:
            await asyncio.wait_for(loop(), timeout)
        except asyncio.TimeoutError:
            pass
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_follow_loops_reach_the_new_history_after_a_store_loss(store: str, request) -> None:
    proc = None
    if store == "tcp":
        proc, url = standalone_store_proc()
    else:
        url = request.getfixturevalue("etcd_url")
    pub = Worker("pub", FaultPub, url, 0, 1, 1, model_kind="tiny", transport="tcp", mode=Async(max_staleness=100))
    tensors = make_tensors(ModelConfig.tiny(), 1, 0, fused=False, fill_value=0xA5)
    sub = Subscriber("t", url, token=TOKEN, transport="tcp", connect_timeout=10, lease_ttl=5.0)
    follower = None
    loop_thread = None
    try:
        sub.register(tensors)
        follower = Follower(sub, tensors)
        for v in (1, 2, 3):
            assert publish(pub, v) == v
        deadline = time.monotonic() + 30
        while (3, 3) not in follower.pulled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (3, 3) in follower.pulled, follower.pulled

        seen: list[int] = []
        loop_thread = threading.Thread(target=lambda: seen.extend(asyncio.run(_versions(url, 2, 60.0))))
        loop_thread.start()
        time.sleep(1.0)  # the versions() loop is running (it yields what comes after the newest: 3)

        # the store is lost: the TCP store's process restarts empty, or etcd's keys are wiped
        if proc is not None:
            port = url.rsplit(":", 1)[1]
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
            proc, _ = standalone_store_proc(port=int(port))
        else:
            Attacker(url).wipe()
        # the trainer's next publishes register again there: a new history, other contents
        assert publish(pub, 101) == 1
        assert publish(pub, 102) == 2

        deadline = time.monotonic() + 45
        while (2, 102) not in follower.pulled and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (2, 102) in follower.pulled, f"the watcher loop stopped following: {follower.pulled} {follower.errors}"
        assert sub.latest() == 2 and sub.version == 2 and mismatches(tensors, 102) == []
        loop_thread.join(60)
        assert seen and seen[-1] == 2, f"versions() did not follow the new history: {seen}"
    finally:
        if follower is not None:
            follower.close()
        if loop_thread is not None:
            loop_thread.join(60)
        sub.close()
        pub.stop()
        if proc is not None:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()


@pytest.mark.slow
def test_a_pull_waiting_for_a_rank_record_follows_a_store_loss(etcd_url) -> None:
    """A pull that waits for a publisher's record (committed before the record showed, or the
    record is gone) while the store loses its history reads the new history's version at once,
    instead of waiting out its timeout for a record that will never show (the soak saw such pulls
    fail after 60 s)."""
    attacker = Attacker(etcd_url)
    pub = Worker("pub", FaultPub, etcd_url, 0, 1, 1, model_kind="tiny", transport="tcp", mode=Async(max_staleness=100))
    tensors = make_tensors(ModelConfig.tiny(), 1, 0, fused=False, fill_value=0xA5)
    sub = Subscriber("t", etcd_url, token=TOKEN, transport="tcp", connect_timeout=10)
    try:
        assert publish(pub, 1) == 1
        rank_key = next(k for k in attacker.dump() if k.endswith("/e/1/r/0"))
        attacker.delete(rank_key)
        sub.register(tensors)
        result: dict = {}

        def pulling() -> None:
            t0 = time.monotonic()
            try:
                result["v"] = sub.pull(timeout=40.0)
            except WBridgeError as e:
                result["error"] = e
            result["s"] = time.monotonic() - t0

        thread = threading.Thread(target=pulling)
        thread.start()
        time.sleep(2.0)  # the pull waits for the deleted record
        attacker.wipe()  # the store loses its history; the trainer registers again there
        t_loss = time.monotonic()
        assert publish(pub, 101) == 1
        thread.join(60)
        assert "error" not in result, result
        assert result["v"] == 1 and mismatches(tensors, 101) == [], result
        assert time.monotonic() - t_loss < 20, f"the pull waited out its timeout: {result}"
    finally:
        sub.close()
        pub.stop()
