"""Servers listen only on the address they were given: on a test host, on that host's address; by
default, on loopback. Checked from the kernel's socket tables (``ss``), not from the code's intent."""

from __future__ import annotations

import subprocess

import pytest

import transports
from tests.runtime.harness import Worker, free_port
from wbridge import Async

from .actors import FaultPub, FaultSub, pub_on, sub_on

pytestmark = pytest.mark.timeout(120)

SERVED = [t for t in ("tcp", "local", "nccl") if t in transports.available()]


def _ss(argv_prefix: list[str], flags: str) -> list[str]:
    out = subprocess.run(argv_prefix + ["ss", "-Hln" + flags], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def listeners(host, proto: str = "t") -> list[str]:
    """Local addresses of the listening TCP (``t``) or UDP (``u``) sockets in the host's namespace."""
    return [line.split()[3] for line in _ss(host.exec_prefix, proto) if line.strip()]


def listeners_of(pid: int) -> list[str]:
    """Local addresses of the listening TCP and UDP sockets that process ``pid`` holds."""
    return [line.split()[3] for proto in ("tp", "up") for line in _ss([], proto) if f"pid={pid}," in line]


def address(hostport: str) -> str:
    return hostport.rsplit(":", 1)[0].strip("[]")


@pytest.mark.netns
def test_servers_bind_only_the_address_given(network) -> None:
    """Publisher(host=A's address) hosting the TCP store and serving tcp, local and nccl: every
    listening socket in A's namespace is on A's address (none on 0.0.0.0, [::] or loopback); the
    subscriber's host listens on nothing."""
    net = network(2)
    a, b = net.hosts
    url = f"tcp://{a.addr}:29700"
    pub = pub_on(a, url, host_store=True, transport=SERVED)
    sub = sub_on(b, url)
    try:
        pub.call("publish", 1)
        assert sub.call("pull", min_version=1)["bad"] == []
        tcp = listeners(a)
        # the store, the tcp transport and (where available) nccl's control listener
        assert len(tcp) >= 2 + ("nccl" in SERVED), tcp
        assert f"{a.addr}:29700" in tcp
        assert all(address(x) == a.addr for x in tcp), tcp
        assert all(address(x) == a.addr for x in listeners(a, "u")), listeners(a, "u")
        assert listeners(b) == [] and listeners(b, "u") == [], "a subscriber serves nothing"
    finally:
        sub.stop()
        pub.stop()


def test_defaults_listen_on_loopback_only() -> None:
    """No host given anywhere: the hosted store and every served transport listen on 127.0.0.1."""
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker(
        "pub",
        FaultPub,
        url,
        0,
        1,
        1,
        host_store=True,
        model_kind="tiny",
        transport=SERVED,
        mode=Async(max_staleness=10),
    )
    sub = Worker("sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp")
    try:
        pub.call("publish", 1)
        assert sub.call("pull", min_version=1)["bad"] == []
        mine = listeners_of(pub.proc.pid)
        assert len(mine) >= 2 + ("nccl" in SERVED), mine
        assert all(address(a) == "127.0.0.1" for a in mine), mine
        assert listeners_of(sub.proc.pid) == []
    finally:
        sub.stop()
        pub.stop()
