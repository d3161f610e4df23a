"""A reference model of the tcp server's replies, and a raw client, for the fuzz tests.

The model is written apart from ``transports._wire`` on purpose: it re-derives, from the protocol
description, what a correct server answers to any byte stream sent after a valid handshake.
"""

from __future__ import annotations

import socket
import struct
import time

from transports import _auth
from transports import _wire as w

HDR = struct.Struct("<4sBBHQ")
READ, DATA, ERROR, CHALLENGE = 5, 6, 7, 2
LIMITS = {1: 32, 2: 64, 3: 32, 4: 0, 5: 4096 * 24, 6: 1 << 40, 7: 4096}
ENTRY = struct.Struct("<QQQ")


def read_frame(entries: list[tuple[int, int, int]]) -> bytes:
    payload = b"".join(ENTRY.pack(*e) for e in entries)
    return HDR.pack(b"WBTP", 1, READ, 0, len(payload)) + payload


def expected_replies(stream: bytes, regions: dict[int, bytes]) -> list[tuple[int, bytes | None]]:
    """What the server must send back for ``stream`` (sent after the handshake, then EOF).

    ``(DATA, bytes)`` for a READ whose every entry lies in a registered region, ``(ERROR, None)``
    otherwise; a malformed frame gets ``(ERROR, None)`` and ends the connection; a truncated one ends
    it silently.
    """
    out: list[tuple[int, bytes | None]] = []
    pos = 0
    while len(stream) - pos >= HDR.size:
        magic, version, ftype, flags, length = HDR.unpack_from(stream, pos)
        if magic != b"WBTP" or version != 1 or ftype not in LIMITS or flags or length > LIMITS[ftype] or ftype != READ:
            return out + [(ERROR, None)]
        if len(stream) - pos - HDR.size < length:
            return out
        payload = stream[pos + HDR.size : pos + HDR.size + length]
        pos += HDR.size + length
        if length == 0 or length % ENTRY.size:
            return out + [(ERROR, None)]
        entries = [ENTRY.unpack_from(payload, i) for i in range(0, length, ENTRY.size)]
        if any(rid not in regions or n == 0 or off + n > len(regions[rid]) for rid, off, n in entries):
            out.append((ERROR, None))
        else:
            out.append((DATA, b"".join(regions[rid][off : off + n] for rid, off, n in entries)))
    return out


def parse_replies(data: bytes) -> list[tuple[int, bytes]]:
    """Splits what the server sent into ``(type, payload)``; raises on anything that is not a frame."""
    out, pos = [], 0
    while pos < len(data):
        magic, version, ftype, flags, length = HDR.unpack_from(data, pos)
        if magic != b"WBTP" or version != 1 or flags:
            raise AssertionError(f"server sent a malformed header at byte {pos}: {data[pos : pos + 16]!r}")
        payload = data[pos + HDR.size : pos + HDR.size + length]
        if len(payload) != length:
            raise AssertionError(f"server sent a truncated {ftype} frame")
        out.append((ftype, payload))
        pos += HDR.size + length
    return out


def client_handshake(sock: socket.socket, key: bytes, instance: bytes, wait_ok: bool = True) -> None:
    """Plays the client's side of the handshake; ``wait_ok=False`` stops after sending AUTH."""
    nonce = _auth.new_nonce()
    sock.sendall(w.frame(w.FrameType.HELLO, nonce))
    kind, payload = w.recv_frame(sock, (w.FrameType.CHALLENGE,))
    server_nonce = payload[: w.NONCE_BYTES]
    sock.sendall(w.frame(w.FrameType.AUTH, w.mac(key, b"client", instance, server_nonce, nonce)))
    if wait_ok:
        w.recv_frame(sock, (w.FrameType.AUTH_OK,))


def exchange(sock: socket.socket, stream: bytes, timeout: float = 5.0) -> bytes:
    """Sends ``stream``, half-closes, and returns everything the server sends until it closes.

    Raises ``TimeoutError`` if the server neither answers nor closes within ``timeout`` (a hang).
    """
    try:
        sock.sendall(stream)
        sock.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server already gave up on us; what it said is still readable
    deadline = time.monotonic() + timeout
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"server kept the connection open {timeout}s after EOF")
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 20)
        except ConnectionResetError:
            break
        except TimeoutError:
            raise TimeoutError(f"server kept the connection open {timeout}s after EOF") from None
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)
