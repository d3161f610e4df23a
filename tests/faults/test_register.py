"""Registering again (the documented recovery step, and how a layout changes) neither leaks nor
breaks what works. Before, every re-registration leaked slots x shard bytes of shared memory and
8 fds per rank (30 of them: fds 37 -> 281, shared memory 4 -> 124 MB), and a register() that failed
at the store left the publisher unregistered, with new regions served over freed buffers."""

from __future__ import annotations

import datetime

import pytest

from tests.runtime.actors import TOKEN
from tests.runtime.harness import Worker, WorkerError, free_port
from wbridge import Async, open_store
from wbridge.protocol import generation
from wbridge.protocol.channel import ChannelStore
from wbridge.protocol.keys import Keys

from .actors import FaultPub, FaultSub

pytestmark = pytest.mark.timeout(180)

PUB = dict(host_store=True, model_kind="tiny", transport=["tcp", "local"], mode=Async(max_staleness=100))


def test_reregistration_frees_what_the_old_registration_held() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", FaultPub, url, 0, 1, 1, **PUB)
    sub = Worker("sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="local")
    try:
        v = 1
        pub.call("publish", v)
        assert sub.call("pull", min_version=v)["bad"] == []
        before = pub.call("held")
        assert before["shm"] > 0, "the local transport staged nothing in shared memory"
        for _ in range(10):
            pub.call("reregister")
            v += 1
            pub.call("publish", v)
            got = sub.call("pull", min_version=v)
            assert got["v"] == v and got["bad"] == [], got
        after = pub.call("held")
        assert after["fds"] <= before["fds"] + 2, (before, after)
        assert after["shm"] == before["shm"], (before, after)
    finally:
        sub.stop()
        pub.stop()


def test_register_that_fails_at_the_store_keeps_the_old_registration() -> None:
    import torch.distributed as dist

    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", FaultPub, url, 0, 1, 1, **PUB)
    sub = Worker("sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp")
    store = open_store(url)
    try:
        pub.call("publish", 1)
        assert sub.call("pull", min_version=1)["bad"] == []
        keys = Keys("t", generation.current(ChannelStore(store, Keys("t"), TOKEN.encode())))
        count = store.get(keys.reg)
        port = int(url.rsplit(":", 1)[1])
        raw = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
        raw.set(keys.reg, "broken")  # the registration counter: register() fails at the store
        with pytest.raises(WorkerError) as err:
            pub.call("reregister")
        assert err.value.exc_type == "StoreError", err.value
        # the old registration still serves: publish and pull go on as if nothing happened
        assert pub.call("publish", 2, timeout=10.0)["v"] == 2
        got = sub.call("pull", min_version=2)
        assert got["v"] == 2 and got["bad"] == [], got
        raw.set(keys.reg, count)  # repaired: registering again works
        pub.call("reregister")
        pub.call("publish", 3)
        got = sub.call("pull", min_version=3)
        assert got["v"] == 3 and got["bad"] == [], got
    finally:
        store.close()
        sub.stop()
        pub.stop()


def test_close_frees_the_registration() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", FaultPub, url, 0, 1, 1, **PUB)
    try:
        pub.call("reregister")
        pub.call("publish", 1)
        open_ = pub.call("held")
        pub.call("close")
        closed = pub.call("held")
        assert open_["shm"] > 0 and closed["shm"] == 0, (open_, closed)
        assert closed["fds"] < open_["fds"], (open_, closed)
    finally:
        pub.stop()
