"""Across test hosts (network namespaces joined by a bridge): a link cut in the middle of a pull and
restored, the publisher's side (store on a third host) or the subscriber's (store behind the cut).
(Listening addresses: ``test_listen.py``.)

Workers (``pub_on``, ``sub_on``) are forked from the harness's forkserver and then join their host's namespace,
so every process has its own address: 10.123.0.1 (A), 10.123.0.2 (B), 10.123.0.3 (C)."""

from __future__ import annotations

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary

from .actors import pause_fault, pub_on, release, sub_on, wait_paused

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

PULL_TIMEOUT = 4.0
SLACK = 6.0


@pytest.mark.slow
@pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (apt-get install -y etcd-server)")
def test_link_cut_mid_pull_then_restored(network, tmp_path) -> None:
    net = network(3)
    a, b, c = net.hosts
    server = EtcdServer(host=c.addr, prefix_cmd=c.exec_prefix)  # the store on a third host
    fault, paused, go = pause_fault(tmp_path, on_reads=(2,))
    pub = sub = None
    try:
        server.start()
        url = server.url + "/cut/"
        pub = pub_on(a, url)
        sub = sub_on(b, url, fault=fault)
        pub.call("publish", 1)
        first = sub.call("pull", min_version=1)
        assert first["bad"] == [] and first["transports"][0][0] == "tcp"

        pub.call("publish", 2)
        sub.send("try_pull", timeout=PULL_TIMEOUT)
        wait_paused(paused, 1)  # half of version 2 is in
        net.cut(a)  # the publisher's host drops off the network
        release(go)
        r = sub.result(PULL_TIMEOUT + 30)
        assert r["error"] in ("TransportError", "WaitTimeout"), r
        assert r["elapsed"] <= PULL_TIMEOUT + SLACK, r
        assert r["version"] is None, "a failed pull must not claim a complete version"
        assert sub.call("check", 2) != [], "the second half never arrived"

        net.restore(a)
        r = sub.call("pull", min_version=2, timeout=30.0)
        assert r["v"] == 2 and r["bad"] == [], r
        pub.call("publish", 3)
        r = sub.call("pull", min_version=3, timeout=30.0)
        assert r["v"] == 3 and r["bad"] == [], r
    finally:
        for w in (sub, pub):
            if w is not None:
                w.stop()
        server.close()


@pytest.mark.slow
def test_subscriber_cut_off_with_its_store_errors_within_its_timeout(network, tmp_path) -> None:
    """The subscriber's own link goes down mid-pull: publisher and store (tcp://, hosted by the
    publisher) become unreachable together. The pull must still fail within its timeout."""
    net = network(2)
    a, b = net.hosts
    url = f"tcp://{a.addr}:29700"
    fault, paused, go = pause_fault(tmp_path, on_reads=(2,))
    pub = pub_on(a, url, host_store=True)
    sub = sub_on(b, url, fault=fault, connect_timeout=5.0, lease_ttl=1.0)
    try:
        pub.call("publish", 1)
        assert sub.call("pull", min_version=1)["bad"] == []
        pub.call("publish", 2)
        sub.send("try_pull", timeout=2.0)
        wait_paused(paused, 1)
        net.cut(b)
        release(go)
        r = sub.result(60)
        net.restore(b)
        assert r["error"] is not None and r["version"] is None, r
        assert r["elapsed"] <= 2.0 + 3.0, f"pull(timeout=2) failed only after {r['elapsed']:.1f}s: {r}"
        r = sub.call("pull", min_version=2, timeout=30.0)
        assert r["v"] == 2 and r["bad"] == [], r
    finally:
        sub.stop()
        pub.stop()
