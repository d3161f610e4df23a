"""The ``nccl`` transport's data plane: registered memory as tensors, the two-rank process groups
(gloo for host memory, NCCL for CUDA memory), and posting a batch of sends or receives on one.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ._copy import CopyPlan
from ._util import coalesce, memory_view
from .errors import TransportError

_log = logging.getLogger("transports.nccl")


class CudaMemory:
    """Exposes ``nbytes`` of device memory at ``addr`` to ``torch.as_tensor`` (no copy)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def tensor(addr: int, nbytes: int, device: str) -> torch.Tensor:
    if device == "cpu":
        return torch.frombuffer(memory_view(addr, nbytes), dtype=torch.uint8)
    return torch.as_tensor(CudaMemory(addr, nbytes), device=device)


def backend_for(devices: Sequence[str], who: str) -> str:
    kinds = {"cuda" if d.startswith("cuda") else d for d in devices}
    if kinds <= {"cpu"}:
        return "gloo"
    if kinds == {"cuda"}:
        return "nccl"
    raise TransportError(f"nccl: {who} mixes host and CUDA memory ({sorted(set(devices))}); stage into one kind")


def check_device(device: str) -> None:
    if device == "cpu":
        return
    if device.startswith("cuda:") and device[5:].isdigit():
        return
    raise TransportError(f"nccl: unsupported device {device!r} (cpu or cuda:N)")


def make_group(store: Any, rank: int, backend: str, host: str, timeout: float, device: str) -> Any:
    """A standalone two-rank process group (not registered with the default world: nothing global)."""
    td = datetime.timedelta(seconds=max(timeout, 0.001))
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = td
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    torch.cuda.set_device(torch.device(device))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = td
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def destroy(pg: Any) -> None:
    """Ends a group now, not when the garbage collector gets to it: its sockets and communicators
    must not outlive the pull (a traceback or a cycle can keep the object alive)."""
    if pg is None:
        return
    for name in ("shutdown", "abort"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
                return
            except RuntimeError as e:
                _log.debug("nccl: %s of a pull group failed: %r", name, e)


def post(pg: Any, backend: str, device: str, tensors: list, peer: int, send: bool) -> list:
    """Posts one send (or recv) per tensor, tag = position: the batch_isend_irecv of a bare group."""
    op = pg.send if send else pg.recv
    if backend == "nccl" and hasattr(pg, "_start_coalescing"):
        dev = torch.device(device)
        pg._start_coalescing(dev)
        for i, t in enumerate(tensors):
            op([t], peer, i)
        return [pg._end_coalescing(dev)]
    return [op([t], peer, i) for i, t in enumerate(tensors)]


def wait(works: list, deadline: float, what: str) -> None:
    for w in works:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"nccl: {what} timed out")
        try:
            w.wait(datetime.timedelta(seconds=left))
        except RuntimeError as e:
            raise TransportError(f"nccl: {what} failed: {e}") from e


def split(nbytes: np.ndarray, direct: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the reads sent on their own and of those packed together (same rule on both sides)."""
    big = nbytes >= direct
    return np.flatnonzero(big), np.flatnonzero(~big)


@dataclass(eq=False)
class Packed:
    """The short reads of a batch, sent as one contiguous ``buffer``: gathered into it on the serving
    side, scattered out of it on the reading side. Host memory moves as one ``CopyPlan`` (no Python
    call per read); CUDA memory as one ``copy_`` per read."""

    buffer: Any
    gather: bool  # True: regions -> buffer (the sender); False: buffer -> regions (the receiver)
    copies: CopyPlan | None = None
    pairs: list = field(default_factory=list, repr=False)  # CUDA: (region view, start, stop)

    def run(self) -> None:
        if self.copies is not None:
            self.copies.run()
            return
        for view, a, b in self.pairs:
            if self.gather:
                self.buffer[a:b].copy_(view)
            else:
                view.copy_(self.buffer[a:b])


def packed(
    tensors: Sequence[Any],
    addrs: Sequence[int],
    device: str,
    region: np.ndarray,
    offset: np.ndarray,
    nbytes: np.ndarray,
    *,
    gather: bool,
) -> Packed | None:
    """A ``Packed`` for reads ``(region, offset, nbytes)`` of the regions ``tensors`` (at ``addrs``)."""
    if not len(nbytes):
        return None
    pos = np.cumsum(nbytes) - nbytes
    buf = torch.empty(int(nbytes.sum()), dtype=torch.uint8, device=device)
    if device == "cpu":
        mem = np.asarray(addrs, dtype=np.int64)[region] + offset
        at = buf.data_ptr() + pos
        return Packed(buf, gather, CopyPlan.of(*(coalesce(at, mem, nbytes) if gather else coalesce(mem, at, nbytes))))
    rows = zip(region.tolist(), offset.tolist(), nbytes.tolist(), pos.tolist())
    return Packed(buf, gather, pairs=[(tensors[r][o : o + k], a, a + k) for r, o, k, a in rows])
