"""When the process that hosts a ``tcp://`` store dies, the other processes say so: a ``StoreError``
that names the store's host:port as gone and what to check, with torch's own message kept as the
cause. Before, a publisher rank that lost its store host reported only torch's "Failed to recv, got
0 bytes. Connection was likely closed", which hid that rank 0 (the host) had died."""

from __future__ import annotations

import time

import pytest

from tests.runtime.harness import Worker, WorkerError, free_port

from .actors import FaultPub, FaultSub

pytestmark = pytest.mark.timeout(120)

CONNECT_TIMEOUT = 5.0


def failure(w: Worker, timeout: float = 60.0) -> WorkerError:
    with pytest.raises(WorkerError) as err:
        w.result(timeout)
    return err.value


@pytest.mark.slow
def test_store_host_killed_mid_publish_is_named_by_the_other_processes() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    hostport = url.removeprefix("tcp://")
    kw = dict(model_kind="tiny", transport="tcp", mode="sync", connect_timeout=CONNECT_TIMEOUT)
    host = rank1 = sub = None
    try:
        host = Worker("pub0", FaultPub, url, 0, 2, 1, host_store=True, timeout=None, **kw)
        rank1 = Worker("pub1", FaultPub, url, 1, 2, 1, timeout=None, **kw)
        host.result(60.0)
        rank1.result(60.0)
        sub = Worker(
            "sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp", connect_timeout=CONNECT_TIMEOUT
        )
        for w in (host, rank1):
            w.send("publish", 1)  # sync: returns once the subscriber acked
        assert sub.call("pull", min_version=1)["bad"] == []
        assert [w.result(60.0)["v"] for w in (host, rank1)] == [1, 1]

        # rank 1 enters the collective publish of version 2 (sync: it waits for the acks of a version
        # that needs rank 0 too) and the subscriber waits for that version; then
        # the store host dies before it joins (SIGKILL: no goodbye on any connection)
        rank1.send("publish", 2, timeout=60.0)
        sub.send("pull", min_version=2, timeout=60.0)
        time.sleep(1.0)
        assert not rank1.ready() and not sub.ready()
        host.kill()
        t0 = time.monotonic()
        for who in (rank1, sub):
            err = failure(who)
            assert err.exc_type == "StoreError", str(err)
            text = str(err)
            assert f"store host tcp://{hostport} is gone" in text, text
            assert "host_store=True" in text and "wbridge store serve" in text, text
        # a wait blocked in the store notices at its socket's timeout, connect_timeout (5 s here)
        assert time.monotonic() - t0 < CONNECT_TIMEOUT + 20.0
    finally:
        for w in (sub, rank1, host):
            if w is not None:
                w.stop()
