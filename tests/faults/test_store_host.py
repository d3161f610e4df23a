"""The store host's own client recovers from a failed call like any other client. Before, one
non-integer write by an unauthenticated client (the TCPStore has no authentication) made the host's
next add fail, and every later call failed with "Broken pipe" even after the key was repaired:
nothing committed again."""

from __future__ import annotations

import datetime

import pytest

from tests.runtime.actors import TOKEN
from tests.runtime.harness import Worker, WorkerError, free_port
from wbridge import Async, open_store
from wbridge.protocol import generation
from wbridge.protocol.channel import ChannelStore
from wbridge.protocol.keys import Keys

from .actors import FaultPub

pytestmark = pytest.mark.timeout(120)


def test_host_client_reconnects_after_a_failed_call() -> None:
    import torch.distributed as dist

    url = f"tcp://127.0.0.1:{free_port()}"
    opts = dict(host_store=True, model_kind="tiny", transport="tcp", mode=Async(max_staleness=9))
    pub = Worker("pub", FaultPub, url, 0, 1, 1, **opts)
    store = None
    try:
        assert pub.call("publish", 1)["v"] == 1
        store = open_store(url)
        keys = Keys("t", generation.current(ChannelStore(store, Keys("t"), TOKEN.encode())))
        fence = keys.fence(0)  # version 2 goes to slot 0: its publish bumps this counter first
        good = store.get(fence) or b"0"
        # an unauthenticated client (no wbridge, no token) writes a non-integer where a count lives
        port = int(url.rsplit(":", 1)[1])
        raw = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
        raw.set(fence, b"not a number")
        with pytest.raises(WorkerError) as err:
            pub.call("publish", 2, timeout=10.0)
        assert err.value.exc_type == "StoreError"
        raw.set(fence, good)  # repaired
        del raw
        assert pub.call("publish", 2, timeout=10.0)["v"] == 2, "the host's client stayed wedged"
        assert pub.call("publish", 3, timeout=10.0)["v"] == 3
    finally:
        if store is not None:
            store.close()
        pub.stop()
