"""A pull in flight when the store is lost, asking for a version number of the lost history
(``min_version`` = the one after what it held). It joins the store's new generation, holding
nothing there, so Async publishers wait for its ack once they are ``max_staleness`` ahead. It used
to wait for its old number in the new history, which the publishers could not reach without its
ack: both sides stood until their deadlines (the soak's publisher failed with "subscribers within
3 versions of 4"). Now a pull that finds the store lost reads the newest version of the new
history, and the publishers go on."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary
from tests.runtime.harness import Worker, WorkerError, free_port
from wbridge import Async, open_store

from .actors import FaultPub, FaultSub

pytestmark = pytest.mark.timeout(180)

PUB = dict(model_kind="tiny", transport="tcp", mode=Async(max_staleness=1))
SUB = dict(fused=False, model_kind="tiny", transport="tcp", lease_ttl=30.0)


def publish(pub: Worker, v: int, within: float = 30.0) -> int:
    """``publish(v)`` with a 15 s timeout, again while it meets the store still coming back."""
    deadline = time.monotonic() + within
    while True:
        try:
            return pub.call("publish", v, timeout=15.0)["v"]
        except WorkerError as e:
            if e.exc_type != "StoreError" or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_pull_in_flight_across_a_store_loss_holds_no_publisher_back(store: str) -> None:
    if store == "etcd" and etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    server = EtcdServer().start() if store == "etcd" else None
    url = server.url + "/across/" if server is not None else f"tcp://127.0.0.1:{free_port()}"
    hosted = open_store(url, host_store=True) if server is None else None
    pub = sub = None
    try:
        pub = Worker("pub", FaultPub, url, 0, 1, 1, **PUB)
        sub = Worker("sub", FaultSub, url, 1, 0, **SUB)
        for v in (1, 2, 3):
            assert publish(pub, v) == v
            assert sub.call("pull", min_version=v, timeout=20.0)["v"] == v
        sub.send("pull", min_version=4, timeout=60.0)  # waits for version 4 of this history
        time.sleep(1.0)

        # the store is lost and comes back empty (a new generation: versions count from 1)
        if server is not None:
            server.kill()
            shutil.rmtree(os.path.join(server.data_dir, "data"))
            server.start()
        else:
            hosted.close()
            hosted = open_store(url, host_store=True)

        # version 2 of the new history waits for the subscriber's ack of 1 (max_staleness=1): it
        # comes only if the pull reads the new history instead of waiting for its 4 there. A pull
        # that met the store down (StoreError) is made again as its caller would: min_version=4.
        t0 = time.monotonic()
        assert publish(pub, 1) == 1
        pub.send("publish", 2, timeout=20.0)
        while True:
            try:
                got = sub.result(40.0)
                break
            except WorkerError as e:
                if e.exc_type != "StoreError" or time.monotonic() - t0 > 30.0:
                    raise
                sub.send("pull", min_version=4, timeout=60.0)
        assert got["v"] in (1, 2) and got["bad"] == [] and not got["untouched"], got
        assert pub.result(30.0)["v"] == 2, "the publisher waited for the subscriber's ack"
        # and the channel goes on; version 3 waits for an ack of 2 (max_staleness=1), which a
        # subscriber that took version 1 above gives by pulling 2 first
        got = sub.call("pull", min_version=2, timeout=20.0, garbage=None)  # (it may hold 2: no read)
        assert got["v"] == 2 and got["bad"] == [], got
        assert publish(pub, 3) == 3
        got = sub.call("pull", min_version=3, timeout=20.0)
        assert got["v"] == 3 and got["bad"] == [] and not got["untouched"], got
    finally:
        for w in (sub, pub):
            if w is not None:
                w.stop()
        if hosted is not None:
            hosted.close()
        if server is not None:
            server.close()
