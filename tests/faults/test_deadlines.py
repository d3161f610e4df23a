"""Every blocking call is bounded by its caller's timeout, the later ones too (issue 27, defects 2,
3 and 8). Before, a hung tcp store failed the first ``publish(timeout=3)`` in 3 s but held the
second for minutes (reconnecting ignored the deadline: torch's handshake waits for an answer), as it
did a second ``pull(timeout=3)`` and ``wait_version(timeout=3)``; ``wait_for_subscribers(n,
timeout=3)`` waited out ``connect_timeout`` (30 s) on a stopped etcd or a killed store host and
never returned with ``timeout=nan``; bad timeouts raised ``TypeError``/``ValueError``."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary
from tests.runtime.harness import Worker, WorkerError
from wbridge import Async

from .actors import FaultPub, FaultSub
from .conftest import freeze_group, process_state, standalone_store_proc

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 3.0
SLACK = 4.0  # the call's own timeout plus this, on a loaded 2-core machine (the old code: minutes)
PUB = dict(model_kind="tiny", transport="tcp", mode=Async(max_staleness=100))
SUB = dict(fused=False, model_kind="tiny", transport="tcp", lease_ttl=30.0)


def timed_failure(w: Worker, method: str, *args, store_pid: int | None = None, **kwargs) -> tuple[str, float]:
    """The error class ``w.method(...)`` raised and the seconds it took; a test failure if it
    returned (naming the state of the store's process ``store_pid``: a hung store is stopped, T)."""
    t0 = time.monotonic()
    try:
        got = w.call(method, *args, call_timeout=120.0, **kwargs)
    except WorkerError as e:
        return e.exc_type, time.monotonic() - t0
    store = "" if store_pid is None else f" (store process {store_pid}: state {process_state(store_pid)})"
    pytest.fail(f"{w!r}.{method}{args} returned {got!r} after {time.monotonic() - t0:.1f}s{store}: expected a failure")


@pytest.mark.slow
def test_later_calls_end_by_their_timeout_on_a_hung_tcp_store() -> None:
    proc, url = standalone_store_proc()
    pub = sub = None
    try:
        pub = Worker("pub", FaultPub, url, 0, 1, 1, **PUB)
        sub = Worker("sub", FaultSub, url, 1, 0, **SUB)
        pub.call("publish", 1)
        assert sub.call("pull", min_version=1)["bad"] == []

        freeze_group(proc.pid)
        try:
            calls = [
                (pub, "publish", (2,), dict(timeout=TIMEOUT)),
                (sub, "pull", (), dict(min_version=2, timeout=TIMEOUT)),
                (sub, "api", ("wait_version",), dict(after=1, timeout=TIMEOUT)),
            ]
            took = {}
            for attempt in ("first", "second", "third"):  # the later ones reconnect
                for w, method, args, kwargs in calls:
                    kind, t = timed_failure(w, method, *args, store_pid=proc.pid, **kwargs)
                    took[f"{attempt} {method}{args[:1]}"] = round(t, 1)
                    assert kind in ("StoreError", "WaitTimeout"), (attempt, method, kind)
            print("seconds per call on the hung store:", took)
            assert max(took.values()) < TIMEOUT + SLACK, took
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        # and both go on once it answers again
        assert pub.call("publish", 2, timeout=30.0)["v"] == 2
        got = sub.call("pull", min_version=2, timeout=30.0)
        assert got["v"] == 2 and got["bad"] == [], got
    finally:
        for w in (sub, pub):
            if w is not None:
                w.stop()
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.slow
@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_wait_for_subscribers_ends_by_its_timeout_when_the_store_is_gone(store: str) -> None:
    if store == "etcd" and etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    server = proc = pub = None
    try:
        if store == "etcd":
            server = EtcdServer().start()
            url = server.url + "/gone/"
        else:
            proc, url = standalone_store_proc()
        pub = Worker("pub", FaultPub, url, 0, 1, 1, **PUB)
        assert pub.call("api", "wait_for_subscribers", 0, timeout=TIMEOUT) == 0
        if store == "etcd":
            freeze_group(server.proc.pid)  # stopped: connections hang
        else:
            proc.kill()  # the store's host is gone: connections refused
            proc.wait(10)
        try:
            took = []
            for _ in range(2):
                kind, t = timed_failure(pub, "api", "wait_for_subscribers", 5, timeout=TIMEOUT)
                assert kind in ("WaitTimeout", "StoreError"), kind
                took.append(round(t, 1))
            print(f"wait_for_subscribers(timeout={TIMEOUT}) on a gone {store} store: {took} s")
            assert max(took) < TIMEOUT + SLACK, took
            kind, t = timed_failure(pub, "api", "wait_for_subscribers", 5, timeout=math.nan)
            assert kind == "UsageError" and t < SLACK, (kind, t)
        finally:
            if server is not None:
                os.killpg(server.proc.pid, signal.SIGCONT)
    finally:
        if pub is not None:
            pub.stop()
        if server is not None:
            server.close()
        if proc is not None:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()


BAD_TIMEOUTS = ["x", "3", math.nan, -1.0, math.inf, None, True]


@pytest.mark.slow
def test_bad_timeouts_and_names_are_usage_errors(standalone_store: str) -> None:
    pub = sub = None
    try:
        pub = Worker("pub", FaultPub, standalone_store, 0, 1, 1, **PUB)
        sub = Worker("sub", FaultSub, standalone_store, 1, 0, **SUB)
        refused = []
        for bad in BAD_TIMEOUTS:
            for w, method, args in (
                (sub, "wait_version", (0,)),
                (sub, "pull", ()),
                (pub, "wait_for_subscribers", (1,)),
                (pub, "wait_acked", (1,)),
                (pub, "publish", ()),
            ):
                kind, t = timed_failure(w, "api", method, *args, timeout=bad)
                assert kind == "UsageError", (method, bad, kind)
                refused.append(method)
        print(f"{len(refused)} calls with bad timeouts refused with UsageError")
        for kwargs in (dict(name="n" * 100_000), dict(name="n" * 257)):
            with pytest.raises(WorkerError) as err:
                Worker("bad-sub", FaultSub, standalone_store, 1, 0, **SUB, sub_name=kwargs["name"]).call("version")
            assert err.value.exc_type == "UsageError", err.value
    finally:
        for w in (sub, pub):
            if w is not None:
                w.stop()
