"""The bench's control connection: a server's one listening port, where a client proves the token
and learns what is served (endpoints, region descriptors), then asks for raw engines.

Framing: each message is a 4-byte big-endian length, a 1-byte kind and the payload (at most
``MAX_MESSAGE`` bytes). The connection opens with ``transports._auth``'s mutual HMAC
challenge-response (label ``wbridge-bench-v1``; the token never crosses the wire); after it both
sides exchange JSON objects. A client with another token is refused before anything is said.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

from .. import _auth
from .._util import time_left
from ..errors import ProtocolError, TransportError

LABEL = b"wbridge-bench-v1"
MAX_MESSAGE = 16 << 20
_HEADER = struct.Struct(">IB")
_KINDS = {"hello": 1, "challenge": 2, "auth": 3, "ok": 4, "error": 5, "json": 6}
_NAMES = {v: k for k, v in _KINDS.items()}


class Channel:
    """One control connection (either side): ``send`` and ``recv`` JSON objects; ``close()`` is idempotent.

    - ``sock``: the connected socket.
    - ``peer``: ``host:port`` of the other side, for messages.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer

    def _send(self, kind: str, payload: bytes) -> None:
        self.sock.sendall(_HEADER.pack(len(payload), _KINDS[kind]) + payload)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError(f"bench control: {self.peer} closed the connection")
            buf += chunk
        return bytes(buf)

    def _recv(self, kind: str) -> bytes | None:
        """The payload of the next message, which must be of ``kind``; None for the peer's ``error``."""
        length, code = _HEADER.unpack(self._recv_exact(_HEADER.size))
        if length > MAX_MESSAGE or code not in _NAMES:
            raise ProtocolError(f"bench control: malformed message from {self.peer} (kind {code}, {length} bytes)")
        payload = self._recv_exact(length)
        if _NAMES[code] == "error":
            return None
        if _NAMES[code] != kind:
            raise ProtocolError(f"bench control: {self.peer} sent {_NAMES[code]} where {kind} was due")
        return payload

    def send(self, obj: Any) -> None:
        self._send("json", json.dumps(obj).encode())

    def recv(self, timeout: float | None) -> dict:
        """The next JSON object; ``TransportError`` when the peer closes, errs or stays silent ``timeout`` s."""
        self.sock.settimeout(timeout)
        try:
            payload = self._recv("json")
        except (OSError, ConnectionError) as e:
            raise TransportError(f"bench control: no answer from {self.peer}: {e!r}") from e
        if payload is None:
            raise TransportError(f"bench control: {self.peer} ended the session")
        try:
            obj = json.loads(payload)
        except ValueError as e:
            raise ProtocolError(f"bench control: {self.peer} sent malformed JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ProtocolError(f"bench control: {self.peer} sent {type(obj).__name__}, not an object")
        if "error" in obj:
            raise TransportError(f"bench control: {self.peer}: {obj['error']}")
        return obj

    def request(self, obj: Any, timeout: float | None) -> dict:
        self.send(obj)
        return self.recv(timeout)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __repr__(self) -> str:
        return f"Channel({self.peer}, open={self.sock.fileno() >= 0})"


def accept(sock: socket.socket, peer: str, key: bytes, timeout: float) -> Channel | None:
    """The server's side of a new connection: a ``Channel`` once the client proved ``key``, None
    (connection closed) when it did not or misbehaved within ``timeout`` seconds."""
    ch = Channel(sock, peer)
    sock.settimeout(timeout)
    try:
        if _auth.server_handshake(ch._send, ch._recv, key, LABEL, b""):
            return ch
    except (OSError, ConnectionError, TransportError):
        pass
    ch.close()
    return None


def dial(host: str, port: int, key: bytes, timeout: float) -> Channel:
    """The client's side: a ``Channel`` to ``host:port`` after the mutual handshake; ``AuthError`` when
    either side does not hold ``key``, ``TransportError`` when the server cannot be reached."""
    deadline = time.monotonic() + timeout
    label = f"{host}:{port}"

    def handshake(sock: socket.socket) -> None:
        sock.settimeout(time_left(deadline, "bench", label, "authenticate"))
        ch = Channel(sock, label)
        _auth.client_handshake(ch._send, ch._recv, key, LABEL, b"", f"bench: server {label}")

    return Channel(_auth.dial("bench", host, port, deadline, handshake), label)
