"""A hung store (its process stopped: connections open, nothing answers) must not hold a caller
past its own timeout. Before, ``publish(timeout=3)`` took 30 s with a hung TCPStore (its calls
were bounded only by ``connect_timeout``), and with etcd both ``pull`` and ``publish`` did."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary
from tests.runtime.harness import Worker, WorkerError
from wbridge import Async

from .actors import FaultPub, FaultSub
from .conftest import freeze_group, standalone_store_proc

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 3.0
SLACK = 4.0  # the call's own timeout plus this, on a loaded 2-core machine (the old code: 30 s)


def timed_failure(w: Worker, method: str, *args, **kwargs) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        w.call(method, *args, call_timeout=60.0, **kwargs)
    return err.value.exc_type, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_calls_end_by_their_timeout_when_the_store_hangs(store: str) -> None:
    if store == "etcd" and etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    server = proc = None
    pub = sub = None
    try:
        if store == "etcd":
            server = EtcdServer().start()
            url, pid = server.url + "/hang/", server.proc.pid
        else:
            proc, url = standalone_store_proc()
            pid = proc.pid
        opts = dict(model_kind="tiny", transport="tcp", mode=Async(max_staleness=100))
        pub = Worker("pub", FaultPub, url, 0, 1, 1, **opts)
        sub = Worker("sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp", lease_ttl=30.0)
        pub.call("publish", 1)
        assert sub.call("pull", min_version=1)["bad"] == []

        freeze_group(pid)
        try:
            kind, took = timed_failure(pub, "publish", 2, timeout=TIMEOUT)
            assert kind in ("StoreError", "WaitTimeout") and took < TIMEOUT + SLACK, (kind, took)
            kind, took = timed_failure(sub, "pull", min_version=2, timeout=TIMEOUT)
            assert kind in ("StoreError", "WaitTimeout") and took < TIMEOUT + SLACK, (kind, took)
        finally:
            os.killpg(pid, signal.SIGCONT)
        # and both go on once it answers again
        assert pub.call("publish", 2, timeout=30.0)["v"] == 2
        got = sub.call("pull", min_version=2, timeout=30.0)
        assert got["v"] == 2 and got["bad"] == [], got
    finally:
        for w in (sub, pub):
            if w is not None:
                w.stop()
        if server is not None:
            server.close()
        if proc is not None:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
