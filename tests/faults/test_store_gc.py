"""The store does not grow with the number of versions: per-version keys (snapshot counters,
checksums, ready/acked/free marks) are collected a few versions later, and subscribers that left
take their keys with them. Counted as every key in the store (TCPStore ``num_keys``; an etcd range
count under the channel's prefix)."""

from __future__ import annotations

import base64
import time

import pytest
import requests

from tests.runtime.harness import Worker, call_all, free_port
from wbridge import Staging, open_store
from wbridge.protocol import generation as _generation
from wbridge.protocol.channel import ChannelStore
from wbridge.protocol.keys import Keys

from .actors import TOKEN, Churn, FaultPub, FaultSub

pytestmark = pytest.mark.timeout(240)

VERSIONS = 60
CHURN_SECONDS = 120.0  # alone the six lifetimes end within a dozen versions (2 s); loaded, far later


def tcp_keys(store) -> int:
    return int(store._call(lambda st: st.num_keys()))  # noqa: SLF001 - test introspection


def etcd_keys(server, prefix: str) -> int:
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    r = requests.post(
        f"{server.http}/v3/kv/range", json={"key": b64(prefix), "range_end": b64(end), "count_only": True}, timeout=30
    )
    return int(r.json().get("count", 0))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_key_count_stays_bounded_over_many_versions(kind: str, request) -> None:
    if kind == "tcp":
        host = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
        url, count = host.url, lambda: tcp_keys(host)
    else:
        host, server = None, request.getfixturevalue("etcd_server")
        url = request.getfixturevalue("etcd_url")
        prefix = "/" + url.split("/", 3)[3]
        count = lambda: etcd_keys(server, prefix)  # noqa: E731
    kw = dict(model_kind="tiny", mode="one_step_off", transport="tcp", staging=Staging(checksums=True))
    pubs = [Worker(f"pub{r}", FaultPub, url, r, 2, 2, **kw) for r in range(2)]
    sub = Worker("sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp", verify=True)
    churn = Worker("churn", Churn, url, 7, 6, 2, ttl=2.0)  # 6 subscribers join, pull and leave
    client = host if host is not None else open_store(url)
    v = 0

    def publish(n: int) -> None:
        nonlocal v
        for _ in range(n):
            v += 1
            call_all(pubs, "publish", v)
            assert sub.call("pull", min_version=v)["bad"] == []

    try:
        # while the subscribers come and go: each brings its layout (kept, one key per distinct
        # layout) and the publishers pack for each new set of layouts (a key per rank and set)
        # versions keep coming until the last of them left: a churn subscriber that joins late
        # waits for a version after the one it pulled, which a count of versions could stop short of
        churn.call("start")
        publish(10)
        until = time.monotonic() + CHURN_SECONDS
        while churn.call("left") < 6 and time.monotonic() < until:
            publish(1)
        stats = churn.call("finish", 60.0)
        assert stats["left"] == 6 and stats["torn"] == 0 and stats["hangs"] == 0, stats
        publish(1)  # its scan collects those that left
        keys = Keys("t").at(_generation.current(ChannelStore(client, Keys("t"), TOKEN.encode())))
        n = client.get_int(keys.subs)
        assert n == 7 + stats["join_retries"], (n, stats)  # the pulling subscriber and the 6 (a failed join: an id)
        leases = [sub.call("live_key"), *churn.call("lease_keys")]  # (each join's: its id and tag)
        names = [k for i in range(1, n + 1) for k in (keys.sub(i), keys.sub(i, "state"))] + leases
        held = [k for k, val in zip(names, client.get_many(names)) if val is not None]
        owners = {k.split("/sub/")[1].split("/")[0] for k in held}
        assert len(held) == 3 and len(owners) == 1, f"keys of departed subscribers are still in the store: {held}"
        # then versions alone: the per-version keys of old versions are collected as new ones come
        before = count()
        publish(VERSIONS)
        after = count()
        assert after <= before, f"the store grew from {before} to {after} keys over {VERSIONS} versions"
    finally:
        for w in [churn, sub, *pubs]:
            w.stop()
        client.close()
