"""The store does not grow with the number of versions: per-version keys (snapshot counters,
checksums, ready/acked/free marks) are collected a few versions later, and subscribers that left
take their keys with them. Counted as every key in the store (TCPStore ``num_keys``; an etcd range
count under the channel's prefix)."""

from __future__ import annotations

import base64

import pytest
import requests

from tests.runtime.harness import Worker, call_all, free_port
from wbridge import Staging, open_store

from .actors import Churn, FaultPub, FaultSub

pytestmark = pytest.mark.timeout(240)

VERSIONS = 60


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
    try:
        churn.call("start")
        counts = {}
        for v in range(1, VERSIONS + 1):
            call_all(pubs, "publish", v)
            assert sub.call("pull", min_version=v)["bad"] == []
            if v in (10, VERSIONS):
                if v == VERSIONS:
                    stats = churn.call("finish", 60.0)
                    assert stats["left"] == 6 and stats["torn"] == 0 and stats["hangs"] == 0, stats
                    call_all(pubs, "publish", v + 1)  # a scan after they left collects them
                    assert sub.call("pull", min_version=v + 1)["bad"] == []
                counts[v] = count()
        assert counts[VERSIONS] <= counts[10], f"the store grew from {counts[10]} to {counts[VERSIONS]} keys"
    finally:
        for w in [churn, sub, *pubs]:
            w.stop()
        if host is not None:
            host.close()
