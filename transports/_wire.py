"""Framing and authentication of the ``tcp`` transport's wire protocol (version 1).

Every message is one frame: a fixed 16-byte header followed by ``length`` payload bytes::

    magic  4s  b"WBTP"
    version B  PROTOCOL_VERSION
    type    B  one of the FrameType values
    flags   H  reserved, must be 0
    length  Q  payload bytes; at most MAX_PAYLOAD[type] (DATA: exactly what the READ asked for)

Connection: the handshake of ``transports._auth`` (label ``wbridge-tcp-v1``) in HELLO, CHALLENGE,
AUTH and AUTH_OK frames; the token is the HMAC key and never crosses the wire.

Reads, after AUTH_OK, any number of times::

    client -> READ       n entries of little-endian u64 (region_id, offset, nbytes)
    server -> DATA       the concatenated bytes of the n reads, or ERROR (the connection stays usable)

Both ends validate every field before acting on it; anything malformed ends the connection.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Sequence
from enum import IntEnum

import numpy as np

from . import _auth
from ._auth import MAC_BYTES, NONCE_BYTES
from .errors import ProtocolError

MAGIC = b"WBTP"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<4sBBHQ")
LABEL = b"wbridge-tcp-v1"
ENTRY = np.dtype([("region", "<u8"), ("offset", "<u8"), ("nbytes", "<u8")])
#: Reads per READ frame; bounds what one frame makes the server validate and hold.
MAX_ENTRIES = 4096
#: The most bytes one READ may ask for (a sanity bound; plans split far below it).
MAX_READ_BYTES = 1 << 40


class FrameType(IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    AUTH_OK = 4
    READ = 5
    DATA = 6
    ERROR = 7


MAX_ERROR_BYTES = 4096
#: Largest payload each frame type may carry; DATA is bounded by the READ it answers.
MAX_PAYLOAD = {
    FrameType.HELLO: NONCE_BYTES,
    FrameType.CHALLENGE: NONCE_BYTES + MAC_BYTES,
    FrameType.AUTH: MAC_BYTES,
    FrameType.AUTH_OK: 0,
    FrameType.READ: MAX_ENTRIES * ENTRY.itemsize,
    FrameType.DATA: MAX_READ_BYTES,
    FrameType.ERROR: MAX_ERROR_BYTES,
}


def pack_header(ftype: FrameType, length: int) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(ftype), 0, length)


def frame(ftype: FrameType, payload: bytes = b"") -> bytes:
    return pack_header(ftype, len(payload)) + payload


def parse_header(raw: bytes) -> tuple[FrameType, int]:
    """Validates a 16-byte header; raises ``ProtocolError`` naming the bad field."""
    magic, version, ftype, flags, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this side speaks {PROTOCOL_VERSION})")
    try:
        kind = FrameType(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    if flags != 0:
        raise ProtocolError(f"reserved flags set: {flags:#x}")
    if length > MAX_PAYLOAD[kind]:
        raise ProtocolError(f"{kind.name} frame of {length} bytes exceeds the limit {MAX_PAYLOAD[kind]}")
    return kind, length


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Reads exactly ``n`` bytes; ``ConnectionError`` on EOF (socket timeouts propagate)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, expect: Sequence[FrameType] | None = None) -> tuple[FrameType, bytes]:
    """Reads one whole control frame (DATA payloads are received by the caller, in place)."""
    kind, length = parse_header(recv_exact(sock, HEADER.size))
    if expect is not None and kind not in expect:
        raise ProtocolError(f"expected {'/'.join(e.name for e in expect)}, got {kind.name}")
    if kind is FrameType.DATA:
        return kind, length.to_bytes(8, "little")
    return kind, recv_exact(sock, length) if length else b""


def mac(key: bytes, role: bytes, instance: bytes, first: bytes, second: bytes) -> bytes:
    """The handshake proof of this protocol (see ``transports._auth.mac``)."""
    return _auth.mac(key, LABEL, role, instance, first, second)


_STEPS = {
    "hello": FrameType.HELLO,
    "challenge": FrameType.CHALLENGE,
    "auth": FrameType.AUTH,
    "ok": FrameType.AUTH_OK,
    "error": FrameType.ERROR,
}


def handshake_io(
    sock: socket.socket, *, client: bool, time_left: Callable[[], float] | None = None
) -> tuple[_auth.Send, _auth.Recv]:
    """``send``/``recv`` of ``transports._auth`` over frames. The client takes the server's ERROR as a
    refusal; the server takes anything but the expected frame as a protocol error."""

    def send(step: str, payload: bytes) -> None:
        sock.sendall(frame(_STEPS[step], payload))

    def recv(step: str) -> bytes | None:
        if time_left is not None:
            sock.settimeout(time_left())
        kind, payload = recv_frame(sock, (_STEPS[step], FrameType.ERROR) if client else (_STEPS[step],))
        return None if kind is FrameType.ERROR else payload

    return send, recv


def pack_entries(region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> bytes:
    arr = np.empty(len(region), dtype=ENTRY)
    arr["region"], arr["offset"], arr["nbytes"] = region, offset, nbytes
    return arr.tobytes()


def unpack_entries(payload: bytes) -> np.ndarray:
    if len(payload) == 0 or len(payload) % ENTRY.itemsize:
        raise ProtocolError(f"READ payload of {len(payload)} bytes is not a positive multiple of {ENTRY.itemsize}")
    return np.frombuffer(payload, dtype=ENTRY)
