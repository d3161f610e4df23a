"""etcd-only behaviour: restart mid-use, endpoint failover, lease re-grant, prefixes, URL checks."""

from __future__ import annotations

import threading
import time

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary, free_port
from tests.store import _workers as W
from tests.store.test_store_conformance import CTX, SLACK, eventually, join_all, spawn
from wbridge.errors import StoreError, UsageError, WaitTimeout
from wbridge.store import open_store
from wbridge.store.etcd import EtcdStore

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (apt-get install -y etcd-server)"),
]


@pytest.fixture
def own_etcd():
    """An etcd of this test's own, so killing it disturbs no other test."""
    server = EtcdServer()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.mark.slow
def test_restart_mid_use_clients_reconnect_and_continue(own_etcd):
    url, ttl = own_etcd.url, 3.0
    s = open_store(url, connect_timeout=20)
    s.set("before", b"kept")
    stop, q, lq = CTX.Event(), CTX.Queue(), CTX.Queue()
    adder = spawn(W.steady_adder, url, "ctr", stop, q)
    holder = spawn(W.lease_holder, url, "live/h", ttl, lq)
    try:
        assert lq.get(timeout=60) == "leased"
        eventually(lambda: s.get_int("ctr") >= 5, 30, "the adder to start")
        woke = {}
        waiter = threading.Thread(target=lambda: woke.setdefault("v", s.wait_change("w", None, 60)))
        waiter.start()

        impatient = EtcdStore(url, connect_timeout=5, op_timeout=0.5)
        own_etcd.kill()
        # While etcd is down, a call with a short budget fails within it (no hang).
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="within 0.5s"):
            impatient.get("before")
        assert time.monotonic() - t0 <= 0.5 + SLACK
        time.sleep(1.5)  # not an assertion: etcd stays down a while, as after a crash
        own_etcd.start()

        # Same client objects, no reopen: reads, writes, watches and counters carry on.
        assert s.get("before") == b"kept"
        at_restart = s.get_int("ctr")
        s.set("w", b"after")
        waiter.join(30)
        assert not waiter.is_alive() and woke["v"] == b"after"
        eventually(lambda: s.get_int("ctr") >= at_restart + 5, 30, "adds to continue after the restart")
        # The lease survived: its holder's keep-alives resumed before the TTL ran out.
        t_end = time.monotonic() + 2 * ttl
        while time.monotonic() < t_end:
            assert s.is_alive("live/h", ttl)
            time.sleep(0.25)
    finally:
        stop.set()
        holder.kill()
    ok, failed = q.get(timeout=60)
    join_all([adder])
    final = s.get_int("ctr")
    # Nothing lost, nothing doubled: only an add cut off mid-flight may be unknown (StoreError).
    assert ok <= final <= ok + failed, (ok, failed, final)
    assert failed <= 2, failed
    s.close()


@pytest.mark.slow
def test_calls_while_etcd_is_down_are_bounded(own_etcd):
    s = open_store(own_etcd.url, connect_timeout=20)
    s.set("k", b"v")
    own_etcd.kill()
    for call in (lambda: s.wait_change("k", b"v", 1.0), lambda: s.wait("nope", 1.0)):
        t0 = time.monotonic()
        with pytest.raises((StoreError, WaitTimeout)):
            call()
        assert time.monotonic() - t0 <= 1.0 + SLACK
    own_etcd.start()
    assert s.get("k") == b"v"
    s.close()


def test_failover_to_a_live_endpoint(etcd_server):
    dead = free_port()
    url = f"etcd://127.0.0.1:{dead},127.0.0.1:{etcd_server.port}/failover/"
    with open_store(url, connect_timeout=10) as s:
        s.set("k", b"v")
        assert s.get("k") == b"v"
        assert s.add("n", 2) == 2
        assert f"endpoint=127.0.0.1:{etcd_server.port}" in repr(s)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="unreachable"):
        open_store(f"etcd://127.0.0.1:{dead},127.0.0.1:{free_port()}", connect_timeout=1.0)
    assert time.monotonic() - t0 <= 1.0 + SLACK


def test_lease_regranted_after_etcd_dropped_it(etcd_server):
    with (
        open_store(f"{etcd_server.url}/regrant/", connect_timeout=10) as s,
        open_store(f"{etcd_server.url}/regrant/", connect_timeout=10) as other,
    ):
        lease = s.lease("live/x", 2.0)
        first = lease.lease_id
        # Revoke it behind the holder's back (as etcd does when a lease expires): the key goes...
        client = other._clients[0]
        client.local.deadline = time.monotonic() + 5
        client.post(client.get_url("/kv/lease/revoke"), json={"ID": first})
        assert not other.is_alive("live/x", 2.0)
        # ... and the holder's next keep-alive notices, takes a new lease and rewrites the key.
        # (The key is rewritten before the holder records the new id: wait for both.)
        eventually(lambda: lease.lease_id != first and other.is_alive("live/x", 2.0), 5.0, "the lease to be re-granted")
        lease.revoke()
        assert not other.is_alive("live/x", 2.0)


def test_close_revokes_leases(etcd_server):
    other = open_store(f"{etcd_server.url}/closing/", connect_timeout=10)
    s = open_store(f"{etcd_server.url}/closing/", connect_timeout=10)
    s.lease("live/a", 5.0)
    assert other.is_alive("live/a", 5.0)
    s.close()
    assert not other.is_alive("live/a", 5.0)  # gone now, not after the TTL
    other.close()


def test_prefixes_keep_stores_apart(etcd_server):
    with (
        open_store(f"{etcd_server.url}/job-a", connect_timeout=10) as a,
        open_store(f"{etcd_server.url}/job-b/", connect_timeout=10) as b,
    ):
        a.set("k", b"a")
        assert b.get("k") is None
        b.set("k", b"b")
        assert a.get("k") == b"a"


@pytest.mark.parametrize(
    "url", ["etcd://", "etcd://127.0.0.1", "etcd://127.0.0.1:2379,nohost", "etcd://127.0.0.1:port"]
)
def test_bad_urls(url):
    """A malformed URL is a bad argument: UsageError, before any connection."""
    with pytest.raises(UsageError, match="host:port"):
        open_store(url, connect_timeout=0.5)


def test_bad_values_and_keys(etcd_server):
    with open_store(f"{etcd_server.url}/bad/", connect_timeout=10) as s:
        with pytest.raises(TypeError, match="bytes"):
            s.set("k", 12)
        with pytest.raises(StoreError, match="key"):
            s.get("")
        s.set("n", b"x")
        with pytest.raises(StoreError, match="'n'.*not an integer"):
            s.add("n", 1)
