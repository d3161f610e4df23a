"""Faults the soak injects besides killing subscribers: losing the store, a slowloris client."""

from __future__ import annotations

import base64
import os
import shutil
import socket
import threading
import time
from typing import Any

from tests.runtime.actors import TOKEN
from transports.base import decode_descriptor
from wbridge import open_store
from wbridge.protocol import generation
from wbridge.protocol.channel import ChannelStore
from wbridge.protocol.keys import Keys
from wbridge.protocol.records import open_sealed


def lose_store(url: str, store: Any, etcd: Any, replay: bool = False) -> Any:
    """The store comes back empty: the hosted TCPStore is closed and a fresh one hosted on the same
    port, or etcd is killed, its data wiped, and restarted. Returns the new hosted store (tcp).
    ``replay``: the channel's generation record is kept (as a store client without the token
    could) and put back into the emptied store before anyone writes another one."""
    key = Keys("t").generation
    kept = None
    if replay:
        spy = store if store is not None else open_store(url, connect_timeout=10.0)
        kept = spy.get(key)
        if spy is not store:
            spy.close()
    if etcd is not None:
        etcd.kill()
        shutil.rmtree(os.path.join(etcd.data_dir, "data"), ignore_errors=True)
        etcd.start()
        new = None
    else:
        store.close()
        deadline = time.monotonic() + 30.0
        while True:
            try:
                new = open_store(url, host_store=True)
                break
            except Exception:  # noqa: BLE001 - the port may linger a moment
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    if kept is not None:
        spy = new if new is not None else open_store(url, connect_timeout=10.0)
        if not spy.compare_set(key, None, kept):
            print("soak: the replay lost the race (a client wrote a new generation first)", flush=True)
        if spy is not new:
            spy.close()
    return new


def tcp_endpoints(url: str, ranks: int) -> list[tuple[str, int]]:
    """Where each publisher rank's tcp transport listens (from its record in the store)."""
    out = []
    with open_store(url) as store:
        keys = Keys("t", generation.current(ChannelStore(store, Keys("t"), TOKEN.encode())))
        for r in range(ranks):
            rec = open_sealed(TOKEN.encode(), keys.rank(1, r), store.get(keys.rank(1, r)))
            d = decode_descriptor("tcp", base64.b64decode(rec["transports"]["tcp"]["endpoint"]), ("host", "port"))
            out.append((d["host"], int(d["port"])))
    return out


class Slowloris:
    """``per_rank`` connections to every rank's tcp server that trickle a byte a second and never
    authenticate; a closed one is opened again (at most once a second)."""

    def __init__(self, url: str, ranks: int, per_rank: int) -> None:
        self.targets = [a for a in tcp_endpoints(url, ranks) for _ in range(per_rank)]
        self.socks: list[socket.socket | None] = [None] * len(self.targets)
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-slowloris", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for i, addr in enumerate(self.targets):
                s = self.socks[i]
                try:
                    if s is None:
                        s = self.socks[i] = socket.create_connection(addr, timeout=1.0)
                        s.setblocking(False)
                        self.reopened += 1
                    s.send(b"\0")  # never a whole frame header: the handshake never completes
                    if s.recv(1) == b"":
                        raise ConnectionError
                except BlockingIOError:
                    pass
                except OSError:
                    if s is not None:
                        s.close()
                    self.socks[i] = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            if s is not None:
                s.close()
