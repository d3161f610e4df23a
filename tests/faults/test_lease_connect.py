"""The lease's own store connection is opened within ``connect_timeout``, not
``min(connect_timeout, lease_ttl)``: TCPStore connects stall for seconds now and then, and with
``lease_ttl=2`` that failed ``register()``. Here the lease's connection is held up in connect()
for longer than the TTL."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.runtime.harness import Worker, free_port

from .actors import FaultPub, FaultSub

pytestmark = pytest.mark.timeout(120)

TTL, STALL = 1.0, 3.0


class StallingProxy:
    """Forwards 127.0.0.1:<port> to ``target``; after ``after`` connections, new connections stall
    in connect() for ``stall`` seconds (its accept queue is kept full: the kernel drops their SYNs,
    as on a store host whose backlog overflowed), then go through."""

    def __init__(self, target: int, after: int, stall: float) -> None:
        self.target, self.after, self.stall = target, after, stall
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)  # an accept queue of one
        self.port = self.listener.getsockname()[1]
        self.stalled = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        accepted, fillers = 0, []
        while True:
            if accepted == self.after and not fillers:
                for _ in range(2):  # fill the queue: the next client's SYN is dropped
                    s = socket.socket()
                    s.setblocking(False)
                    s.connect_ex(("127.0.0.1", self.port))
                    fillers.append(s)
                self.stalled.set()
                time.sleep(self.stall)
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            conn.close()
            return
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


@pytest.mark.slow
def test_lease_connects_within_connect_timeout_not_lease_ttl() -> None:
    port = free_port()
    pub = Worker(
        "pub", FaultPub, f"tcp://127.0.0.1:{port}", 0, 1, 1, host_store=True, model_kind="tiny", transport="tcp"
    )
    proxy = StallingProxy(port, after=2, stall=STALL)  # the subscriber's own 2 go through
    sub = None
    try:
        pub.call("publish", 1)
        sub = Worker(
            "sub",
            FaultSub,
            f"tcp://127.0.0.1:{proxy.port}",
            1,
            0,
            fused=False,
            model_kind="tiny",
            transport="tcp",
            lease_ttl=TTL,
            connect_timeout=30.0,
        )  # register() opened the lease's connection, STALL > TTL late
        assert proxy.stalled.is_set()
        got = sub.call("pull", min_version=1)
        assert got["v"] == 1 and got["bad"] == [], got
    finally:
        if sub is not None:
            sub.stop()
        pub.stop()
        proxy.close()
