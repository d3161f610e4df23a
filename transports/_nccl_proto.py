"""The ``nccl`` transport's control protocol: framing over its control connection, the handshake in
those frames, and the rendezvous stores that its process groups form through that connection.

A frame is a 16-byte header (``WBNC``, type, payload length), a JSON object and raw bytes. The
handshake is ``transports._auth`` with label ``wbridge-nccl-v1`` (nonces and proofs in the raw part).
"""

from __future__ import annotations

import base64
import datetime
import json
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch.distributed as dist

from . import _auth
from ._wire import recv_exact
from .errors import TransportError

MAGIC = b"WBNC"
HEADER = struct.Struct("<4sB3xQ")
MAX_PAYLOAD = 64 << 20
INSTANCE = 16
LABEL = b"wbridge-nccl-v1"
#: Wire message types.
HELLO, CHALLENGE, AUTH, OK, ERROR, PREPARE, RELEASE, PULL, READY, STORE, END, DONE = range(1, 13)
ENTRY = np.dtype([("region", "<i8"), ("offset", "<i8"), ("nbytes", "<i8")])
_STEPS = {"hello": HELLO, "challenge": CHALLENGE, "auth": AUTH, "ok": OK, "error": ERROR}


def send(sock: socket.socket, kind: int, payload: dict | None = None, raw: bytes = b"") -> None:
    body = json.dumps(payload or {}, separators=(",", ":")).encode()
    sock.sendall(HEADER.pack(MAGIC, kind, 4 + len(body) + len(raw)) + struct.pack("<I", len(body)) + body + raw)


def recv(sock: socket.socket, expect: Sequence[int] | None = None) -> tuple[int, dict, bytes]:
    magic, kind, length = HEADER.unpack(recv_exact(sock, HEADER.size))
    if magic != MAGIC or length > MAX_PAYLOAD or length < 4:
        raise ConnectionError(f"malformed frame (magic {magic!r}, {length} bytes)")
    data = recv_exact(sock, length)
    (jlen,) = struct.unpack_from("<I", data)
    if jlen > length - 4:
        raise ConnectionError("malformed frame (JSON longer than the payload)")
    try:
        payload = json.loads(data[4 : 4 + jlen])
    except ValueError as e:
        raise ConnectionError(f"malformed frame: {e}") from None
    if not isinstance(payload, dict):
        raise ConnectionError("malformed frame (payload is not an object)")
    if expect is not None and kind not in expect and kind != ERROR:
        raise ConnectionError(f"unexpected message type {kind} (expected {list(expect)})")
    return kind, payload, data[4 + jlen :]


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def unb64(s: Any) -> bytes:
    if not isinstance(s, str):
        raise ConnectionError("malformed frame (expected base64 text)")
    return base64.b64decode(s, validate=True)


def handshake_io(sock: socket.socket) -> tuple[_auth.Send, _auth.Recv]:
    """``send``/``recv`` of ``transports._auth`` over this protocol's frames (ERROR: a refusal)."""

    def send_step(step: str, payload: bytes) -> None:
        send(sock, _STEPS[step], {"message": payload.decode()} if step == "error" else None, payload)

    def recv_step(step: str) -> bytes | None:
        kind, _, raw = recv(sock, (_STEPS[step],))
        return None if kind == ERROR else raw

    return send_step, recv_step


class SocketStore(dist.Store):
    """The reader's rendezvous store: every call is answered by the serving side over the connection."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self.deadline = sock, deadline

    def _call(self, op: str, **kw: Any) -> dict:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransportError("nccl: rendezvous timed out")
        self._sock.settimeout(left)
        send(self._sock, STORE, {"op": op, **kw})
        kind, payload, _ = recv(self._sock, (OK,))
        if kind == ERROR:
            raise TransportError(f"nccl: rendezvous store: {payload.get('message')}")
        return payload

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key=key, value=b64(bytes(value)))

    def get(self, key: str) -> bytes:
        return unb64(self._call("get", key=key)["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key=key, amount=int(amount))["value"])

    def check(self, keys: list) -> bool:
        return bool(self._call("check", keys=[k for k in keys])["value"])

    def wait(self, keys: list, timeout: Any = None) -> None:
        self._call("wait", keys=[k for k in keys])

    def set_timeout(self, timeout: Any) -> None:
        pass


class EpochStore(dist.Store):
    """The serving side's rendezvous store for one pull: a HashStore whose waits give up as soon as
    ``abort`` is set (the reader's connection died), so a reader killed mid-rendezvous frees the
    serving side at once instead of at the pull's timeout."""

    STEP = datetime.timedelta(milliseconds=50)

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.inner.set_timeout(self.STEP)
        self.deadline = deadline
        self.abort = threading.Event()

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: list) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list, timeout: Any = None) -> None:
        while not self.inner.check(list(keys)):
            if self.abort.is_set():
                raise TransportError("nccl: the reader left during the rendezvous")
            if time.monotonic() > self.deadline:
                raise TransportError(f"nccl: rendezvous timed out waiting for {list(keys)}")
            self.abort.wait(self.STEP.total_seconds())

    def set_timeout(self, timeout: Any) -> None:
        pass
