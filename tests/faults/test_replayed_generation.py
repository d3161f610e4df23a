"""Stale weights through a replayed generation record (issue 27, defect 1). Someone with store
access but no token keeps the channel's signed generation record, the store is wiped (its host
restarted, etcd's data lost) while the trainer restarts too, and the old record is put back before
the new trainer registers. Clients then see the same generation; the new trainer publishes new
weights under the old version numbers (and the same epoch, 1). Before, the subscriber that held
"version 3" took the new version 3 for it (``rec.v == version``) and returned 3 without reading a
byte. Now a version is held by its identity (number, epoch, a nonce the committing publisher drew
for it): the subscriber reads the new version 3 (its tensors are filled with garbage first, so a pull
that moved nothing shows)."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary
from tests.runtime.harness import Worker, WorkerError, call_all
from wbridge import Async
from wbridge.protocol.keys import Keys
from wbridge.store import open_store

from .actors import FaultPub, FaultSub
from .conftest import standalone_store_proc

pytestmark = pytest.mark.timeout(240)

PUB = dict(model_kind="tiny", transport="tcp", mode=Async(max_staleness=100))
SUB = dict(fused=False, model_kind="tiny", transport="tcp", lease_ttl=5.0)


def trainer(url: str) -> list[Worker]:
    return [Worker("pub0", FaultPub, url, 0, 2, 2, **PUB), Worker("pub1", FaultPub, url, 1, 2, 2, **PUB)]


def pull(sub: Worker, v: int, within: float = 60.0) -> dict:
    """``pull(min_version=v)``, again while it meets the store still coming back (StoreError)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return sub.call("pull", min_version=v, timeout=20.0)
        except WorkerError as e:
            if e.exc_type != "StoreError" or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_replayed_generation_record_never_reports_a_version_not_read(store: str) -> None:
    if store == "etcd" and etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    server = proc = None
    pubs, sub = [], None
    try:
        if store == "etcd":
            server = EtcdServer().start()
            url = server.url + "/replay/"
        else:
            proc, url = standalone_store_proc()
        pubs = trainer(url)
        sub = Worker("sub", FaultSub, url, 1, 0, **SUB)
        for v in (1, 2, 3):
            call_all(pubs, "publish", v)
        got = pull(sub, 3)
        assert got["v"] == 3 and got["bad"] == [], got
        spy = open_store(url, connect_timeout=10.0)  # a store client without the token
        old_generation = spy.get(Keys("t").generation)
        spy.close()
        assert old_generation is not None

        for p in pubs:  # the trainer restarts ...
            p.kill()
        if server is not None:  # ... while the store loses everything
            server.kill()
            shutil.rmtree(os.path.join(server.data_dir, "data"))
            server.start()
        else:
            port = int(url.rsplit(":", 1)[1])
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
            proc, url = standalone_store_proc(port=port)
        spy = open_store(url, connect_timeout=10.0)
        spy.set(Keys("t").generation, old_generation)  # the replay: a valid signed record
        spy.close()

        pubs = trainer(url)  # the new trainer joins the replayed generation: epoch 1 again
        for v in (1, 2, 3):  # new weights under the old version numbers
            assert [r["v"] for r in call_all(pubs, "publish", v)] == [v, v]
        got = pull(sub, 3)
        print(
            f"{store}: after the replay, pull(min_version=3) -> v={got['v']} "
            f"untouched={got['untouched']} bad={len(got['bad'])} nbytes={got['nbytes']}"
        )
        assert got["v"] == 3 and not got["untouched"] and got["bad"] == [], (
            f"the subscriber reported version 3 without reading it: {got}"
        )
        call_all(pubs, "publish", 4)  # and the channel goes on
        got = pull(sub, 4)
        assert got["v"] == 4 and got["bad"] == [], got
    finally:
        for w in [*pubs, *([sub] if sub else [])]:
            w.stop()
        if server is not None:
            server.close()
        if proc is not None:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
