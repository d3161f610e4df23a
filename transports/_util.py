"""Small helpers shared by the built-in transports: raw memory views, field checks, stream balancing."""

from __future__ import annotations

import ctypes
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .errors import TransportError

#: Largest address or size accepted from a descriptor (64-bit user-space addresses fit below 2**63).
MAX_INT = (1 << 63) - 1


def memory_view(addr: int, nbytes: int) -> memoryview:
    """A writable, flat ``memoryview`` of ``nbytes`` at ``addr`` (no copy; the caller keeps it alive)."""
    if nbytes <= 0:
        raise TransportError(f"cannot view {nbytes} bytes at {addr:#x}")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")


def check_host_memory(kind: str, addr: object, nbytes: object, device: str) -> None:
    """Refuses a registration these host-memory transports cannot serve, naming why."""
    if device != "cpu":
        raise TransportError(f"{kind} moves host memory only, not {device!r}: stage the tensor in host memory")
    if type(addr) is not int or type(nbytes) is not int or not (0 < addr and 0 < nbytes <= MAX_INT - addr):  # noqa: E721
        raise TransportError(f"{kind}: cannot register {nbytes!r} bytes at {addr!r}")


def int_field(kind: str, d: dict, key: str, lo: int = 0, hi: int = MAX_INT) -> int:
    """``d[key]`` as an int in ``[lo, hi]``, or ``TransportError`` naming the field."""
    v = d.get(key)
    if type(v) is not int or not lo <= v <= hi:  # noqa: E721 - bool is not a valid field value
        raise TransportError(f"{kind}: descriptor field {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def str_field(kind: str, d: dict, key: str, max_len: int = 256) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= max_len:
        raise TransportError(f"{kind}: descriptor field {key!r} must be a non-empty string, got {v!r:.80}")
    return v


def hex_field(kind: str, d: dict, key: str, nbytes: int) -> bytes:
    v = str_field(kind, d, key, 2 * nbytes)
    try:
        out = bytes.fromhex(v)
    except ValueError:
        out = b""
    if len(out) != nbytes:
        raise TransportError(f"{kind}: descriptor field {key!r} must be {nbytes} hex-encoded bytes")
    return out


def token_key(token: Any) -> bytes:
    """The HMAC key for ``token`` (``None``: the empty key, i.e. no authentication)."""
    if token is None:
        return b""
    if isinstance(token, str):
        return token.encode()
    if isinstance(token, (bytes, bytearray, memoryview)):
        return bytes(token)
    raise TransportError(f"token must be bytes, str or None, got {type(token).__name__}")


def split_and_balance(nbytes: np.ndarray, streams: int, split: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cuts reads longer than ``split`` into pieces and spreads the pieces over ``streams`` by bytes.

    Returns ``(op, start, stream)`` per piece: the index of the read it comes from, the byte offset
    of the piece within that read, and its stream. Each stream takes a consecutive run of pieces
    (those whose middle byte falls in its ``1/streams`` share of the batch), so its loads stay
    within ``2 * split`` of each other and each stream reads neighbouring bytes.
    """
    pieces = np.maximum(1, -(-nbytes // split))
    op = np.repeat(np.arange(len(nbytes), dtype=np.int64), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = (np.arange(len(op), dtype=np.int64) - first) * split
    size = np.minimum(nbytes[op] - start, split)
    total = int(size.sum())
    middle = np.cumsum(size) - size + size // 2
    stream = np.minimum(middle * streams // max(total, 1), streams - 1)
    return op, start, stream


def coalesce(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merges consecutive reads whose sources and destinations both continue where the last ended."""
    if len(nbytes) < 2:
        return dst, src, nbytes
    brk = (src[1:] != src[:-1] + nbytes[:-1]) | (dst[1:] != dst[:-1] + nbytes[:-1])
    starts = np.concatenate([[0], np.flatnonzero(brk) + 1])
    return dst[starts], src[starts], np.add.reduceat(nbytes, starts)


# The lowest port ``free_port`` picks (services' well-known and registered ports lie mostly below).
_LOWEST_PICKED = 10000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for tests, demos and benchmarks that start servers).

    Picked at random below the kernel's ephemeral range where that range leaves room: a port the
    kernel handed out (``bind`` to port 0) stays in the range it hands out to every outgoing
    connection and port-0 listener on the machine, and one of those took such a port before its
    server bound it (``EADDRINUSE``) while a loaded test suite connected all around. Random per
    call, not per process: forked processes share ``random``'s state."""
    low = _ephemeral_low()
    if low >= 2 * _LOWEST_PICKED:
        for _ in range(64):
            port = _LOWEST_PICKED + secrets.randbelow(low - _LOWEST_PICKED)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The low end of the kernel's ephemeral port range (0 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def time_left(deadline: float, kind: str, label: str, what: str) -> float:
    """Seconds left before ``deadline``, or ``TransportError`` naming the peer once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportError(f"{kind}: {what} with peer {label} timed out")
    return left


@contextmanager
def peer_lock(kind: str, peer: Any, timeout: float) -> Iterator[None]:
    """Holds ``peer.lock`` (one read per peer at a time) for at most ``timeout`` seconds of waiting,
    and refuses a peer that is ``closed``; errors name ``peer.label``."""
    if not peer.lock.acquire(timeout=timeout):
        raise TransportError(f"{kind}: peer {peer.label} busy with another read for {timeout}s")
    try:
        if peer.closed:
            raise TransportError(f"{kind}: peer {peer.label} is disconnected")
        yield
    finally:
        peer.lock.release()


def wake(sock: socket.socket | None) -> None:
    """Shuts ``sock`` down both ways (waking threads blocked on it), ignoring a socket already gone."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
