"""Host memory copies of a whole batch, with no Python call per copy.

``vm_read`` copies iovec columns out of another process (``process_vm_readv``, ``IOV_MAX`` pieces
per call). Copies within this process (out of a mapped memfd) are a ``CopyPlan``: a plan's reads
come in regular families (the rows of a column slice are copies of one length whose sources and
destinations advance by constant strides), which ``CopyPlan`` finds once, vectorised, and runs as
one strided copy each: rows shorter than ``TORCH_ROW`` by torch (``serial_chunks``: its vectorised
copy loop moved the 2 KiB rows of a column slice at 1.1-1.4x numpy's ``memmove`` per row here), longer rows by one numpy
copy. Copies in no family go, if short, to ``process_vm_readv`` on this very process (a kernel copy
of up to ``IOV_MAX`` pieces per call) and, if long (``LONG_COPY`` bytes or more, so few by
construction), to ``memmove`` one by one.

``serial_chunks`` is also the host executor of ``wbridge``'s reader-ordered snapshot copy.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import TransportError

#: Copies at least this long that belong to no progression are made by ``memmove`` one by one.
LONG_COPY = 256 << 10
#: Batches of at most this many copies outside progressions are made by ``memmove`` one by one.
FEW_COPIES = 8
#: Pieces per ``process_vm_readv`` call (Linux IOV_MAX).
IOV_MAX = 1024
#: Rows of a strided family shorter than this are copied by torch, longer ones by numpy (``memmove``
#: per row, whose per-call cost is noise on a long row).
TORCH_ROW = 64 << 10
#: Elements per torch copy: ATen runs a copy of fewer elements than its ``GRAIN_SIZE`` (32768) on
#: the calling thread. The copies stay single-threaded, as a ``memcpy`` is, whatever the process's
#: intra-op thread count: a parallel copy's thread barrier costs far more than it saves on a loaded
#: host (3x slower here at a load average of 8 on 2 cores).
SERIAL_ELEMS = 32767
_WIDE = (torch.int64, torch.int32, torch.int16, torch.uint8)  # moved as plain words: bit-exact

_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_libc.process_vm_readv.restype = ctypes.c_ssize_t


def vm_read(pid: int, local_iov: np.ndarray, remote_iov: np.ndarray, deadline: float | None = None) -> None:
    """Copies remote ``(addr, len)`` iovecs of ``pid`` into local ones, pairwise of equal lengths.

    IOV_MAX pairs per ``process_vm_readv``; a partial transfer resumes after the last whole iovec
    and retries the one it stopped in, so a fault there surfaces as its own error.
    """
    i = 0
    while i < len(local_iov):
        j = min(len(local_iov), i + IOV_MAX)
        got = _libc.process_vm_readv(pid, local_iov[i:j].ctypes.data, j - i, remote_iov[i:j].ctypes.data, j - i, 0)
        if got < 0:
            raise _vm_error(pid, ctypes.get_errno())
        done = np.cumsum(local_iov[i:j, 1])
        if got == done[-1]:
            i = j
        else:  # whole iovecs went, then maybe part of one: resume from there on shifted copies
            k = int(np.searchsorted(done, got, side="right"))
            part = got - (int(done[k - 1]) if k else 0)
            if got == 0:
                raise TransportError(f"local: process_vm_readv from pid {pid} made no progress")
            local_iov, remote_iov, i = local_iov[i + k :].copy(), remote_iov[i + k :].copy(), 0
            for iov in (local_iov, remote_iov):
                iov[0, 0] += part
                iov[0, 1] -= part
        if deadline is not None and i < len(local_iov) and time.monotonic() > deadline:
            raise TransportError(f"local: read from pid {pid} timed out")


def _vm_error(pid: int, err: int) -> TransportError:
    if err == errno.EPERM:
        return TransportError(
            f"local: the kernel denied process_vm_readv on pid {pid} (EPERM: a different uid, Yama "
            f"ptrace_scope, a non-dumpable publisher, or a seccomp filter); use the tcp transport"
        )
    if err == errno.ESRCH:
        return TransportError(f"local: peer pid {pid} is gone (ESRCH)")
    if err == errno.ENOSYS:
        return TransportError("local: process_vm_readv is not available here (ENOSYS); use tcp")
    return TransportError(f"local: process_vm_readv from pid {pid} failed: {os.strerror(err)}")


def progressions(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cuts copies (in batch order) into runs of equal-length copies whose destinations and sources
    each advance by a constant stride; returns ``(first, count)`` per run, every copy in one run."""
    k = len(nbytes)
    if k < 3:
        return np.arange(k, dtype=np.int64), np.ones(k, dtype=np.int64)
    dd, ds = np.diff(dst), np.diff(src)
    link = nbytes[1:] == nbytes[:-1]  # link i: copies i and i+1 have one length
    cont = np.zeros(k - 1, dtype=bool)  # link i and link i+1 step alike
    cont[:-1] = link[1:] & link[:-1] & (dd[1:] == dd[:-1]) & (ds[1:] == ds[:-1])
    starts = link.copy()
    starts[1:] &= ~cont[:-1]
    ends = link & ~cont
    first, last = np.flatnonzero(starts), np.flatnonzero(ends) + 1  # copies of each chain of links
    if len(first) > 1:  # a copy ending one chain and starting the next stays in the first
        first[1:] += first[1:] == last[:-1]
    covered = np.zeros(k + 1, dtype=np.int64)
    np.add.at(covered, first, 1)
    np.add.at(covered, last + 1, -1)
    alone = np.flatnonzero(np.cumsum(covered[:-1]) == 0)
    return np.concatenate([first, alone]), np.concatenate([last - first + 1, np.ones(len(alone), np.int64)])


class _Raw:
    """Exposes ``count`` elements of ``size`` bytes at ``addr``, ``stride`` apart, to numpy (no copy)."""

    def __init__(self, addr: int, size: int, stride: int, count: int, readonly: bool) -> None:
        self.__array_interface__ = {
            "shape": (count,),
            "typestr": f"|V{size}",
            "data": (addr, readonly),
            "strides": (stride,),
            "version": 3,
        }


def _rows_tensor(addr: int, n: int, step: int, count: int) -> torch.Tensor:
    """``count`` rows of ``n`` bytes at ``addr``, ``step`` apart, as a ``(count, n)`` uint8 tensor (no copy)."""
    span = np.asarray(_Raw(addr, 1, 1, (count - 1) * step + n, False)).view(np.uint8)
    return torch.from_numpy(span).as_strided((count, n), (step, 1))


def serial_chunks(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy of ``src`` into ``dst`` (uint8 CPU tensors of one shape, last dimension contiguous,
    ``dst`` not overlapping itself) as ``(destination, source)`` views that torch copies each on the
    calling thread (``SERIAL_ELEMS`` at most): moved as the widest integer words that every
    address, stride and row length allows, cut along the outer dimensions first."""
    if dst.numel() == 0:
        return []
    n = dst.shape[-1]
    addrs = (dst.data_ptr(), src.data_ptr(), n, *dst.stride()[:-1], *src.stride()[:-1])
    wide = next(w for w in _WIDE if all(a % w.itemsize == 0 for a in addrs))
    d, s = (dst.view(wide), src.view(wide)) if wide is not torch.uint8 else (dst, src)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    _cut(d, s, out)
    return out


def _cut(d: torch.Tensor, s: torch.Tensor, out: list) -> None:
    if d.numel() <= SERIAL_ELEMS:
        out.append((d, s))
    elif d.dim() == 1:
        for i in range(0, len(d), SERIAL_ELEMS):
            out.append((d[i : i + SERIAL_ELEMS], s[i : i + SERIAL_ELEMS]))
    else:
        inner = d[0].numel()
        if inner > SERIAL_ELEMS:
            for i in range(len(d)):
                _cut(d[i], s[i], out)
        else:
            k = SERIAL_ELEMS // inner
            for i in range(0, len(d), k):
                out.append((d[i : i + k], s[i : i + k]))


def run_chunks(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Makes the copies ``serial_chunks`` cut (one torch call per chunk, none per row)."""
    for d, s in chunks:
        d.copy_(s)


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """A batch of ``(dst, src, nbytes)`` host copies, arranged once to run without a Python call per copy."""

    strided: list[tuple[np.ndarray, np.ndarray]] = field(repr=False)  # (destination, source) views, long rows
    chunks: list[tuple[Any, Any]] = field(repr=False)  # serial_chunks of the families of short rows
    long: np.ndarray = field(repr=False)  # (k, 3) int64: dst, src, nbytes
    local_iov: np.ndarray = field(repr=False)  # (m, 2) uint64, short copies for process_vm_readv
    remote_iov: np.ndarray = field(repr=False)
    count: int

    @classmethod
    def of(cls, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, min_run: int = 4) -> CopyPlan:
        first, count = progressions(dst, src, nbytes)
        run = count >= min_run
        strided, chunks = [], []
        for a, c in zip(first[run].tolist(), count[run].tolist()):
            n = int(nbytes[a])
            d_step, s_step = int(dst[a + 1] - dst[a]), int(src[a + 1] - src[a])
            if n < TORCH_ROW and d_step >= n and s_step >= 0:  # torch views take no negative strides
                with warnings.catch_warnings():  # the source is a read-only mapping, only ever read
                    warnings.simplefilter("ignore", UserWarning)
                    chunks += serial_chunks(
                        _rows_tensor(int(dst[a]), n, d_step, c), _rows_tensor(int(src[a]), n, s_step, c)
                    )
                continue
            d = np.asarray(_Raw(int(dst[a]), n, d_step, c, False))
            s = np.asarray(_Raw(int(src[a]), n, s_step, c, True))
            strided.append((d, s))
        f, c = first[~run], count[~run]
        rest = np.repeat(f - (np.cumsum(c) - c), c) + np.arange(int(c.sum()), dtype=np.int64)
        few = len(rest) <= FEW_COPIES  # a syscall costs more than a few memmoves
        longs = rest if few else rest[nbytes[rest] >= LONG_COPY]
        short = rest[:0] if few else rest[nbytes[rest] < LONG_COPY]
        long = np.stack([dst[longs], src[longs], nbytes[longs]], axis=1).astype(np.int64)
        local_iov = np.ascontiguousarray(np.stack([dst[short], nbytes[short]], axis=1).astype(np.uint64))
        remote_iov = np.ascontiguousarray(np.stack([src[short], nbytes[short]], axis=1).astype(np.uint64))
        return cls(strided, chunks, long, local_iov, remote_iov, len(nbytes))

    def run(self) -> None:
        """Makes every copy."""
        run_chunks(self.chunks)
        for d, s in self.strided:
            np.copyto(d, s)
        memmove = ctypes.memmove
        for dst, src, n in self.long.tolist():
            memmove(dst, src, n)
        if len(self.local_iov):
            try:
                vm_read(os.getpid(), self.local_iov, self.remote_iov)
            except TransportError:  # the kernel refuses process_vm_readv here (a seccomp filter, say)
                for (d, n), (s, _) in zip(self.local_iov.tolist(), self.remote_iov.tolist()):
                    ctypes.memmove(d, s, n)

    def __repr__(self) -> str:
        return (
            f"CopyPlan(copies={self.count}, strided_runs={len(self.strided)}, torch_chunks={len(self.chunks)}, "
            f"long={len(self.long)}, "
            f"short={len(self.local_iov)})"
        )
