"""The mutual HMAC challenge-response that opens every tcp and nccl connection (the token never
crosses the wire), written once over each transport's own framing.

    client -> HELLO      client_nonce (32 bytes)
    server -> CHALLENGE  server_nonce (32) + HMAC(token, label, "server", instance, client_nonce, server_nonce)
    client -> AUTH       HMAC(token, label, "client", instance, server_nonce, client_nonce)
    server -> OK         (empty), or ERROR and the server closes the connection

A transport passes ``send(step, payload)`` and ``recv(step) -> payload | None`` (``None``: the peer
answered with its ERROR frame) for the steps ``hello``, ``challenge``, ``auth``, ``ok``, ``error``;
``label`` (``b"wbridge-tcp-v1"``, say) keeps one transport's proofs from being replayed on another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from collections.abc import Callable

from ._util import time_left
from .errors import AuthError, ProtocolError, TransportError

NONCE_BYTES = 32
MAC_BYTES = 32

Send = Callable[[str, bytes], None]
Recv = Callable[[str], "bytes | None"]


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def mac(key: bytes, label: bytes, role: bytes, instance: bytes, first: bytes, second: bytes) -> bytes:
    """The handshake proof: binds the transport, the role, the server instance and both nonces to the token."""
    return hmac.new(key, label + b"\0" + role + b"\0" + instance + first + second, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def server_handshake(send: Send, recv: Recv, key: bytes, label: bytes, instance: bytes) -> bool:
    """Runs the serving side; False (after sending ERROR) when the client does not prove the token."""
    client_nonce = recv("hello")
    if client_nonce is None or len(client_nonce) != NONCE_BYTES:
        raise ProtocolError(f"HELLO nonce of {len(client_nonce or b'')} bytes")
    nonce = new_nonce()
    send("challenge", nonce + mac(key, label, b"server", instance, client_nonce, nonce))
    answer = recv("auth")
    if answer is None or not verify(mac(key, label, b"client", instance, nonce, client_nonce), answer):
        send("error", b"authentication failed")
        return False
    send("ok", b"")
    return True


def client_handshake(send: Send, recv: Recv, key: bytes, label: bytes, instance: bytes, who: str) -> None:
    """Runs the reading side; ``AuthError`` when either side fails to prove the token, ``TransportError``
    when the server refuses to start. ``who`` (``"tcp: peer host:port"``) starts every message."""
    client_nonce = new_nonce()
    send("hello", client_nonce)
    payload = recv("challenge")
    if payload is None or len(payload) != NONCE_BYTES + MAC_BYTES:
        raise TransportError(f"{who} refused the handshake: {(payload or b'')[:200]!r}")
    nonce, proof = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
    if not verify(mac(key, label, b"server", instance, client_nonce, nonce), proof):
        raise AuthError(f"{who} failed to prove the shared token (wrong token, or another server instance there)")
    send("auth", mac(key, label, b"client", instance, nonce, client_nonce))
    if recv("ok") is None:
        raise AuthError(f"{who} rejected our token")


def dial(kind: str, host: str, port: int, deadline: float, handshake: Callable[[socket.socket], None]) -> socket.socket:
    """A connection to ``host:port`` on which ``handshake`` succeeded before ``deadline``; every
    failure is a ``TransportError`` (``AuthError`` from the handshake stays one) naming the peer."""
    label = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=time_left(deadline, kind, label, "connect"))
    except OSError as e:
        raise TransportError(f"{kind}: cannot connect to peer {label}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handshake(sock)
        return sock
    except BaseException as e:
        sock.close()
        if isinstance(e, TransportError):
            raise
        if isinstance(e, socket.timeout):
            raise TransportError(f"{kind}: handshake with peer {label} timed out") from e
        if isinstance(e, OSError):
            raise TransportError(f"{kind}: handshake with peer {label} failed: {e!r}") from e
        raise
