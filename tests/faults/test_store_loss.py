"""The store is lost and comes back empty (the TCPStore host restarted, etcd's data wiped) while
publishers and a subscriber run. Every counter in it restarts at 1, so without store generations
a subscriber that held version 3 took the new version 3 for the one it held and reported success
with no transfer (stale weights), and a new subscriber got the old one's id. Now the subscriber
notices the new generation, pulls version 3 for real (its tensors are filled with garbage first, so
a pull that moved nothing shows), and every subscriber has its own id in the new generation."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary
from tests.runtime.harness import Worker, WorkerError, call_all, free_port
from wbridge import Async

from .actors import FaultPub, FaultSub

pytestmark = pytest.mark.timeout(240)

PUB = dict(model_kind="tiny", transport="tcp", mode=Async(max_staleness=100))
SUB = dict(fused=False, model_kind="tiny", transport="tcp", lease_ttl=5.0)


def pull(sub: Worker, v: int, within: float = 60.0) -> dict:
    """``pull(min_version=v)``; a pull that meets the store still down raises StoreError: retried."""
    deadline = time.monotonic() + within
    while True:
        try:
            return sub.call("pull", min_version=v, timeout=20.0)
        except WorkerError as e:
            if e.exc_type != "StoreError" or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def retried(w: Worker, method: str, *args, within: float = 60.0, **kwargs):
    """``w.call(...)``, again while it meets the store still down (StoreError)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return w.call(method, *args, **kwargs)
        except WorkerError as e:
            if e.exc_type != "StoreError" or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_store_loss_never_reports_a_version_not_pulled(store: str) -> None:
    if store == "etcd" and etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    server = EtcdServer() if store == "etcd" else None
    pubs, subs = [], []
    try:
        if server is not None:
            server.start()
            url = server.url + "/loss/"
        else:
            url = f"tcp://127.0.0.1:{free_port()}"
        host = dict(host_store=True) if server is None else {}
        pubs = [Worker("pub0", FaultPub, url, 0, 2, 2, **host, **PUB), Worker("pub1", FaultPub, url, 1, 2, 2, **PUB)]
        subs.append(Worker("sub", FaultSub, url, 1, 0, **SUB))
        for v in (1, 2, 3):
            call_all(pubs, "publish", v)
        got = pull(subs[0], 3)
        assert got["v"] == 3 and got["bad"] == [], got

        # The store is lost: its host dies and comes back fresh, or etcd loses its data.
        if server is None:
            pubs[0].kill()
            pubs[0] = Worker("pub0-restarted", FaultPub, url, 0, 2, 2, **host, **PUB)
            # pub1 is not told: its next publish finds the new generation and registers there
            retried(pubs[1], "publish", 1)
            pubs[0].call("publish", 1)
        else:
            server.kill()
            shutil.rmtree(os.path.join(server.data_dir, "data"))
            server.start()
            for p in pubs:  # the documented recovery step: every rank registers again
                retried(p, "reregister")
            call_all(pubs, "publish", 1)
        subs.append(Worker("sub-new", FaultSub, url, 1, 0, **SUB))  # joins the new store first
        for v in (2, 3):  # the same version numbers again, in the new store
            assert [r["v"] for r in call_all(pubs, "publish", v)] == [v, v]

        for s in subs:  # the old subscriber held a "version 3": it must pull this one for real
            got = pull(s, 3)
            assert got["v"] == 3 and got["bad"] == [], f"{s.name} reported a version it did not pull: {got}"
        ids = [s["id"] for s in pubs[0].call("subscribers")]
        assert len(ids) == 2 and len(set(ids)) == 2, f"subscriber ids collide across store generations: {ids}"

        call_all(pubs, "publish", 4)  # and the channel goes on (no plan cached from the old store)
        for s in subs:
            got = pull(s, 4)
            assert got["v"] == 4 and got["bad"] == [], got
    finally:
        for w in subs + pubs:
            w.stop()
        if server is not None:
            server.close()
