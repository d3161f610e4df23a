"""Stores across test hosts (network namespaces): reachable over the link, bounded when it is cut."""

from __future__ import annotations

import sys

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary
from tests.hosts import network  # noqa: F401 - fixture

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

SLACK = 3.0  # process start-up and a loaded machine: a bounded call may overrun by this much
FAILED = ("StoreError", "WaitTimeout")  # StoreError or WaitTimeout


def driver(host, *args: str):
    proc = host.popen([sys.executable, "-u", "-m", "tests.store._store_driver", *args])
    ready = proc.recv(60)
    return proc, ready["ready"]


def ok(reply) -> object:
    assert reply["ok"], reply
    return reply["value"]


def exercise_cut_and_restore(net, client, op_timeout: float) -> None:
    """Client on host 1 works; with host 1's link cut its next call fails in time; restored, it works."""
    assert ok(client.request({"op": "set", "key": "k", "value": b"before".hex()}, 30)) is None
    assert ok(client.request({"op": "get", "key": "k"}, 30)) == b"before".hex()

    net.cut(1)
    reply = client.request({"op": "get", "key": "k"}, op_timeout + 30)
    assert not reply["ok"] and reply["error"] in FAILED, reply
    assert reply["took"] <= op_timeout + SLACK, reply
    reply = client.request({"op": "wait", "key": "never", "timeout": 1.0}, op_timeout + 30)
    assert not reply["ok"] and reply["error"] in FAILED, reply
    assert reply["took"] <= max(1.0, op_timeout) + SLACK, reply

    net.restore(1)
    # The same client object recovers: no reopen, no restart.
    assert ok(client.request({"op": "set", "key": "k", "value": b"after".hex()}, op_timeout + 30)) is None
    assert ok(client.request({"op": "get", "key": "k"}, op_timeout + 30)) == b"after".hex()
    assert ok(client.request({"op": "add", "key": "n", "delta": 2}, op_timeout + 30)) == 2


@pytest.mark.slow
def test_tcp_store_across_hosts_link_cut_and_restored(network):
    net = network(2)
    a, b = net.hosts
    assert a.addr != b.addr
    _, url = driver(a, "host", a.addr, "10")
    assert url.startswith(f"tcp://{a.addr}:")
    client, _ = driver(b, "open", url, "3")
    exercise_cut_and_restore(net, client, op_timeout=3.0)


@pytest.mark.slow
@pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (apt-get install -y etcd-server)")
def test_etcd_store_across_hosts_link_cut_and_restored(network):
    net = network(2)
    a, b = net.hosts
    server = EtcdServer(host=a.addr, prefix_cmd=a.exec_prefix)
    try:
        server.start()
        client, _ = driver(b, "open", server.url + "/netns/", "3")
        exercise_cut_and_restore(net, client, op_timeout=3.0)
    finally:
        server.close()


@pytest.mark.slow
def test_hosts_are_isolated(network):
    """Each host reaches the others over the bridge; a cut host reaches no one and no one reaches it."""
    net = network(3)
    a, b, c = net.hosts
    ping = [sys.executable, "-c", "import socket,sys; s=socket.create_connection((sys.argv[1], 9), 2)"]
    # Port 9 is closed everywhere: "refused" proves the peer answered, a timeout that it did not.
    assert "ConnectionRefused" in a.run(ping + [b.addr]).stderr
    net.cut(c)
    err = a.run(ping + [c.addr]).stderr
    assert "timed out" in err or "No route to host" in err, err
    assert "ConnectionRefused" in a.run(ping + [b.addr]).stderr
    net.restore(c)
    assert "ConnectionRefused" in a.run(ping + [c.addr]).stderr


UNREACHABLE = """
import json, sys, time
import torch.distributed  # imported up front: its import time is not the store's
import wbridge.store.etcd
from wbridge.store import open_store
out = {}
for url in sys.argv[1:]:
    t0 = time.monotonic()
    try:
        open_store(url, connect_timeout=2.0)
        out[url] = ["opened", 0]
    except Exception as e:
        out[url] = [type(e).__name__, time.monotonic() - t0]
print(json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_store_on_a_cut_host_is_unreachable_within_connect_timeout(network):
    """Packets to a cut host vanish (no refusal comes back): opening still fails within its timeout."""
    net = network(2)
    a, b = net.hosts
    net.cut(a)
    urls = [f"tcp://{a.addr}:29500", f"etcd://{a.addr}:2379"]
    out = b.python(UNREACHABLE, *urls).recv(60)
    for url in urls:
        kind, took = out[url]
        assert kind == "StoreError" and took <= 2.0 + SLACK, (url, out[url])
