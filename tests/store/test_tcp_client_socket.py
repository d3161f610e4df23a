"""The TCP store's client finds its own connection among the process's sockets (it bounds each call
by that socket's timeouts and sends its waits on it): other connections to the store's port opened
at the same moment, by other threads' store clients or by anything else in the process (a health
probe), are never taken for it."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from wbridge.store import TcpStore
from wbridge.store.tcp import _bounded_tcpstore


@pytest.mark.timeout(240)
def test_clients_connecting_beside_other_connections_to_the_port_wait_on_their_own() -> None:
    host = TcpStore("127.0.0.1", 0, is_host=True, connect_timeout=30)
    host.set("k", b"v")
    stop, failures = threading.Event(), []

    def probe() -> None:  # another part of the process opening connections to the store's port
        while not stop.is_set():
            with socket.create_connection(("127.0.0.1", host.port), timeout=5):
                time.sleep(0.002)

    def client(n: int) -> None:
        for _ in range(n):
            c = TcpStore("127.0.0.1", host.port, is_host=False, connect_timeout=30)
            try:
                t0 = time.monotonic()
                # the key exists: the wait's own connection answers at once, but first it connects,
                # and while the probes open a socket to the port at the same moment, the connect is
                # made again (``_Ambiguous``): on a loaded machine (the suite at load 10 and more)
                # that held three waits 12-20 s. A wait answered on another socket ends at its timeout.
                c.wait("k", 90.0)
                got = c.get("k")
                if got != b"v" or time.monotonic() - t0 > 60.0:
                    failures.append((got, round(time.monotonic() - t0, 1)))
            except Exception as e:  # noqa: BLE001 - collected and reported
                failures.append(repr(e)[:200])
            finally:
                c.close()

    probes = [threading.Thread(target=probe, daemon=True) for _ in range(2)]
    clients = [threading.Thread(target=client, args=(15,), daemon=True) for _ in range(3)]
    try:
        for t in probes + clients:
            t.start()
        for t in clients:
            t.join(200)
        assert not any(t.is_alive() for t in clients), "a client hung"
        assert failures == [], failures
    finally:
        stop.set()
        for t in probes:  # before the store closes: a probe connecting after that is refused
            t.join(10)
        host.close()


@pytest.mark.timeout(60)
def test_a_connection_opened_during_the_handshake_is_not_taken_for_the_client() -> None:
    # The overlap made certain rather than left to timing: the probe connects inside the client's
    # connect, and is still open when the client's socket is looked for.
    host = TcpStore("127.0.0.1", 0, is_host=True, connect_timeout=30)
    probes: list[socket.socket] = []

    def make() -> object:
        store = dist.TCPStore("127.0.0.1", host.port, None, False, timeout=datetime.timedelta(seconds=10))
        probes.append(socket.create_connection(("127.0.0.1", host.port), timeout=5))
        return store

    try:
        store, socks = _bounded_tcpstore(make, host.port, 10.0)
        try:
            assert len(socks) == 1
            assert socks[0].getsockname()[1] != probes[0].getsockname()[1], "the probe's socket was taken"
            store.set("k", b"v")  # through the client whose socket was found
            assert host.get("k") == b"v"
        finally:
            for s in socks:
                s.close()
            del store
    finally:
        for p in probes:
            p.close()
        host.close()
