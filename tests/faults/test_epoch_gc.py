"""Old epochs' keys are collected (issue 27, defect 9). Before, every re-registration left three
keys behind for good (the rank record and packed slot layout of the epoch left, and a snapshot
counter of a version committed under it): 68 -> 128 keys over 20 re-registrations. Counted as every
key in the store (TCPStore ``num_keys``; an etcd range count under the channel's prefix)."""

from __future__ import annotations

import pytest

from tests.runtime.harness import Worker, free_port
from wbridge import Staging, open_store

from .actors import FaultPub, FaultSub
from .test_store_gc import etcd_keys, tcp_keys

pytestmark = pytest.mark.timeout(180)

REREGISTRATIONS = 20


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_key_count_stays_bounded_over_re_registrations(kind: str, request) -> None:
    if kind == "tcp":
        host = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
        url, count = host.url, lambda: tcp_keys(host)
    else:
        host, server = None, request.getfixturevalue("etcd_server")
        url = request.getfixturevalue("etcd_url")
        prefix = "/" + url.split("/", 3)[3]
        count = lambda: etcd_keys(server, prefix)  # noqa: E731
    kw = dict(model_kind="tiny", mode="one_step_off", transport="tcp", staging=Staging(checksums=True))
    pub = Worker("pub", FaultPub, url, 0, 1, 1, **kw)
    sub = Worker("sub", FaultSub, url, 1, 0, fused=True, model_kind="tiny", transport="tcp")  # a packed layout
    try:
        counts = {}
        v = 0
        for n in range(1, REREGISTRATIONS + 1):
            pub.call("reregister")
            for _ in range(2):
                v += 1
                pub.call("publish", v)
                assert sub.call("pull", min_version=v)["bad"] == []
            counts[n] = count()
        print(f"{kind}: keys after 4 and {REREGISTRATIONS} re-registrations: {counts[4]} -> {counts[REREGISTRATIONS]}")
        assert counts[REREGISTRATIONS] <= counts[4], (
            f"the store grew from {counts[4]} to {counts[REREGISTRATIONS]} keys"
        )
    finally:
        for w in [sub, pub]:
            w.stop()
        if host is not None:
            host.close()
