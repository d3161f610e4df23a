"""The gate for server connections that have not authenticated yet (slowloris defence).

At most ``cap`` connections may be in their handshake at once, each for at most ``timeout``
seconds in all (a per-receive timeout lets a peer trickling a byte at a time stay forever). When
full, a new connection evicts the oldest one: a client with the token passes its handshake in a
round trip, so connections that trickle bytes or never speak cannot hold the server, and they do
not count toward its cap on authenticated connections.
"""

from __future__ import annotations

import socket
import threading
import time

MAX_PREAUTH = 64


def _shutdown(sock: socket.socket) -> None:
    """Wakes the thread blocked on ``sock`` (it then closes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class PreauthGate:
    """``timeout``: a whole handshake's limit; ``cap``: connections in their handshake at once."""

    def __init__(self, timeout: float, cap: int = MAX_PREAUTH) -> None:
        self.timeout, self.cap = timeout, cap
        self._since: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="wbridge-tcp-preauth", daemon=True)
        self._reaper.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._since)

    def admit(self, conn: socket.socket) -> None:
        """``conn`` starts its handshake (evicting the oldest one in theirs when full)."""
        with self._lock:
            if len(self._since) >= self.cap:
                _shutdown(min(self._since, key=self._since.__getitem__))
            self._since[conn] = time.monotonic()

    def passed(self, conn: socket.socket) -> None:
        """``conn`` authenticated, or ended: no longer gated."""
        with self._lock:
            self._since.pop(conn, None)

    def _reap_loop(self) -> None:
        while not self._stop.wait(min(0.5, self.timeout / 4)):
            limit = time.monotonic() - self.timeout
            with self._lock:
                late = [c for c, since in self._since.items() if since < limit]
            for c in late:
                _shutdown(c)

    def close(self) -> None:
        self._stop.set()
