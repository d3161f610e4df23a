"""Connections that never authenticate cannot lock authenticated ones out of a publisher's tcp
server. Before, they shared the connection cap with authenticated ones and had only a per-receive
timeout, so peers trickling a byte now and then (slowloris) held every slot for as long as they
liked, and every new subscriber was turned away. Now a handshake gets ``handshake_timeout`` in all,
and those still in theirs have their own cap (the oldest evicted first)."""

from __future__ import annotations

import base64
import socket
import threading
import time

import pytest

from tests.runtime.actors import TOKEN
from tests.runtime.harness import Worker, free_port
from transports.base import decode_descriptor
from wbridge import open_store
from wbridge.protocol import generation
from wbridge.protocol.channel import ChannelStore
from wbridge.protocol.keys import Keys
from wbridge.protocol.records import open_sealed

from .actors import FaultPub, FaultSub

pytestmark = pytest.mark.timeout(120)

CAP, HANDSHAKE, ATTACKERS, TRICKLE = 16, 2.0, 40, 1.0


def tcp_endpoint(url: str) -> tuple[str, int]:
    with open_store(url) as store:
        keys = Keys("t", generation.current(ChannelStore(store, Keys("t"), TOKEN.encode())))
        rec = open_sealed(TOKEN.encode(), keys.rank(1, 0), store.get(keys.rank(1, 0)))
    d = decode_descriptor("tcp", base64.b64decode(rec["transports"]["tcp"]["endpoint"]), ("host", "port"))
    return d["host"], int(d["port"])


@pytest.mark.slow
def test_unauthenticated_trickle_cannot_lock_out_subscribers() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    opts = {"tcp": {"max_connections": CAP, "handshake_timeout": HANDSHAKE}}
    pub = Worker(
        "pub", FaultPub, url, 0, 1, 1, host_store=True, model_kind="tiny", transport="tcp", transport_options=opts
    )
    stop = threading.Event()
    socks: list[socket.socket] = []
    closed_at: dict[int, float] = {}
    sub = None
    try:
        pub.call("publish", 1)
        addr = tcp_endpoint(url)
        for _ in range(ATTACKERS):
            socks.append(socket.create_connection(addr, timeout=5))
        started = time.monotonic()

        def trickle() -> None:  # one byte per connection every TRICKLE s: never a whole frame header
            while not stop.wait(TRICKLE):
                for i, s in enumerate(socks):
                    if i in closed_at:
                        continue
                    try:
                        s.sendall(b"\x00")
                        s.setblocking(False)
                        if s.recv(1) == b"":
                            closed_at[i] = time.monotonic() - started
                    except BlockingIOError:
                        pass
                    except OSError:
                        closed_at[i] = time.monotonic() - started

        threading.Thread(target=trickle, daemon=True).start()
        time.sleep(0.5)  # the attack is on
        sub = Worker("sub", FaultSub, url, 1, 0, fused=False, model_kind="tiny", transport="tcp")
        got = sub.call("pull", min_version=1, timeout=20.0)
        assert got["v"] == 1 and got["bad"] == [], got
        time.sleep(HANDSHAKE + 2 * TRICKLE)
        assert len(closed_at) == ATTACKERS, f"only {len(closed_at)} of {ATTACKERS} trickling connections were closed"
        assert max(closed_at.values()) < HANDSHAKE + 2 * TRICKLE + 1.0, closed_at
    finally:
        stop.set()
        for s in socks:
            s.close()
        if sub is not None:
            sub.stop()
        pub.stop()
