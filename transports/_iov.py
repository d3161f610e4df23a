"""Scatter-gather socket I/O over iovec columns: ``writev``/``readv`` through ctypes, ``IOV_MAX``
pieces per system call, no Python object per piece.

An iovec array is ``(k, 2)`` ``uint64`` (address, length), built with numpy. ``send_iov`` and
``recv_iov`` move every byte of it, in order, through a socket, resuming after partial transfers
(found by a binary search over the running byte count) and waiting with ``poll`` where the socket
would block; the wait is bounded by ``time_left()`` and ends in ``TimeoutError``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
from collections.abc import Callable

import numpy as np

#: Pieces per ``readv``/``writev`` call (Linux IOV_MAX).
IOV_MAX = 1024

_libc = ctypes.CDLL(None, use_errno=True)
for _fn in (_libc.readv, _libc.writev):
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    _fn.restype = ctypes.c_ssize_t


def iovecs(addr: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The ``(k, 2)`` uint64 iovec array of ``k`` pieces."""
    out = np.empty((len(nbytes), 2), dtype=np.uint64)
    out[:, 0], out[:, 1] = addr, nbytes  # cast column by column: mixing int64 and uint64 would go through float64
    return out


def send_iov(sock: socket.socket, iov: np.ndarray, time_left: Callable[[], float]) -> None:
    """Sends every piece of ``iov`` (a gather write), in order."""
    _move(sock, iov, _libc.writev, select.POLLOUT, time_left)


def recv_iov(sock: socket.socket, iov: np.ndarray, time_left: Callable[[], float]) -> None:
    """Fills every piece of ``iov`` (a scatter read), in order; ``ConnectionError`` on EOF."""
    _move(sock, iov, _libc.readv, select.POLLIN, time_left)


def _move(
    sock: socket.socket, iov: np.ndarray, call: Callable[..., int], event: int, time_left: Callable[[], float]
) -> None:
    if len(iov) == 0:
        return
    fd = sock.fileno()
    ends = np.cumsum(iov[:, 1], dtype=np.uint64)
    total, done, i = int(ends[-1]), 0, 0
    poller = None
    while done < total:
        j = min(i + IOV_MAX, len(iov))
        window = iov[i:j]
        skip = done - (int(ends[i - 1]) if i else 0)
        if skip:  # the first piece went in part: send or receive the rest of it
            window = window.copy()
            window[0, 0] += skip
            window[0, 1] -= skip
        got = call(fd, window.ctypes.data, j - i)
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                if poller is None:
                    poller = select.poll()
                    poller.register(fd, event)
                if not poller.poll(max(1, int(time_left() * 1000))):
                    raise TimeoutError("timed out")
                continue
            if err == errno.EINTR:
                continue
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise ConnectionError(f"connection closed after {done} of {total} bytes")
        done += got
        if done < total:  # (most moves are done in one call)
            i = int(np.searchsorted(ends, done, side="right"))
