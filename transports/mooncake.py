"""``mooncake``: one-sided batched reads through the Mooncake Transfer Engine.

Each transport owns one ``TransferEngine`` started in P2P-handshake mode (no metadata server): the
engine's session address ``host:rpc_port`` is the endpoint, and region descriptors carry the
session, the address and the size of each registered buffer. The protocol is ``rdma`` where RDMA
devices exist (``/sys/class/infiniband`` not empty) and ``tcp`` otherwise; both sides must agree.

- ``register`` registers the buffer with the engine once (never per read);
- ``prepare`` checks every read against the descriptors and builds the engine's three address
  lists (local addresses, remote addresses, lengths) once;
- ``read`` posts them as engine batches of at most ``max_batch`` reads with the engine's async
  API (``batch_transfer_async_read``), keeping ``depth`` batches in flight (it waits for the oldest
  with ``get_batch_transfer_status`` before posting the next), on a worker thread, and waits at most
  ``timeout`` seconds; the engine gives up on a batch after its own transfer timeout.

What the engine does not give (so this transport cannot either; the conformance suite skips these
cases with the reasons in ``conformance_skips``):

- no peer authentication: the ``token`` is not used;
- its listeners (handshake RPC and, over ``tcp``, the data port) bind all interfaces, whatever
  ``host`` says (``host`` is only what the endpoint advertises);
- over ``tcp`` the serving engine does not check that a requested address lies in a registered
  buffer. Over ``rdma`` the NIC's memory keys do. So ``auto`` picks mooncake only on RDMA devices;
  use mooncake over tcp on trusted networks (tests, benchmarks) only.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, ClassVar

import numpy as np

from ._host import rdma_devices
from ._util import check_host_memory, int_field, str_field
from .base import (
    OneOf,
    Positive,
    PreparedBatch,
    ReadBatch,
    Region,
    Transport,
    checked_options,
)
from .errors import TransportError

try:
    from mooncake.engine import TransferEngine
except ImportError as e:  # re-raised so that transports.get names the extra (and the system library)
    raise ImportError(
        f"mooncake-transfer-engine is not importable ({e}); it needs the pip package "
        "mooncake-transfer-engine (or -non-cuda) and the system library libibverbs1"
    ) from e

_log = logging.getLogger(__name__)
PROTOCOLS = ("auto", "tcp", "rdma")
_ids = itertools.count(1)


@dataclass(eq=False)
class MooncakePeer:
    """An opened remote engine (the engine itself opens its segment lazily, on the first read)."""

    session: str
    protocol: str
    closed: bool = False

    @property
    def label(self) -> str:
        return self.session

    def __repr__(self) -> str:
        return f"MooncakePeer({self.session}, {self.protocol}, closed={self.closed})"


@dataclass(eq=False, repr=False)  # keeps PreparedBatch's repr
class MooncakePrepared(PreparedBatch):
    """A validated batch: the engine's argument lists, built once and posted on every read."""

    peer: MooncakePeer
    chunks: list[tuple[list[int], list[int], list[int]]]  # (local, remote, lengths), at most max_batch each
    inflight: Future | None = field(default=None, repr=False)


class MooncakeTransport(Transport):
    """One Mooncake engine per transport; see the module docstring (including what it does not check).

    ``protocol``: ``auto`` (``rdma`` where RDMA devices exist, else ``tcp``), ``tcp`` or ``rdma``.
    ``devices``: comma-separated RDMA device filter for the engine (``""``: all). ``max_batch``: reads
    per engine batch; ``depth``: engine batches in flight at once (the engine's tcp lanes reject more
    outstanding reads than their queues hold, ~1024 per peer, so ``max_batch * depth`` stays within).
    """

    name = "mooncake"
    conformance_skips: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "auth": "the Mooncake engine has no peer authentication; the token is not used",
            "forged": "over tcp the Mooncake engine serves any address a peer names (no server-side check); "
            "over rdma the NIC's memory keys would refuse it",
            "deregister": "one-sided: the serving engine does not refuse reads of a deregistered buffer over tcp",
            "leaks": "closing an engine takes ~1 s (its handshake listener wakes once a second), so 100 cycles "
            "take minutes; tests/transports/test_mooncake.py counts fds, OS threads and registrations "
            "over 10 cycles",
        }
    )

    @checked_options
    def __init__(
        self,
        token: bytes | str | None = None,
        host: str = "127.0.0.1",
        *,
        protocol: Annotated[str, OneOf(PROTOCOLS)] = "auto",
        devices: str = "",
        max_batch: Positive = 256,
        depth: Positive = 4,
    ) -> None:
        super().__init__(token=token, host=host)
        self.max_batch, self.depth = max_batch, depth
        self.protocol = ("rdma" if rdma_devices() else "tcp") if protocol == "auto" else protocol
        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", self.protocol, devices) != 0:
            self._engine = None
            raise TransportError(f"mooncake: engine failed to start on {host} with protocol {self.protocol}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._regions: dict[int, Region] = {}
        self._peers: set[MooncakePeer] = set()
        self._prepared: set[MooncakePrepared] = set()
        # The engine's completion wait has no deadline argument: it runs here and read() waits on it.
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="wbridge-mooncake")

    # -- serving -----------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, *, device: str = "cpu") -> Region:
        check_host_memory("mooncake", addr, nbytes, device)
        with self._lock:
            self._check_open()
            if self._engine.register_memory(addr, nbytes) != 0:
                raise TransportError(f"mooncake: engine {self.session} refused to register {nbytes} bytes at {addr:#x}")
            rid = next(_ids)
            desc = self._descriptor(session=self.session, protocol=self.protocol, region=rid, addr=addr, nbytes=nbytes)
            region = Region(rid, addr, nbytes, device, desc, handle=self)
            self._regions[rid] = region
        return region

    def deregister(self, region: Region) -> None:
        with self._lock:
            if self._regions.pop(region.id, None) is None or self._engine is None:
                return
            self._wait_idle(region.addr, region.nbytes)
            self._engine.unregister_memory(region.addr)

    def endpoint(self) -> bytes:
        self._check_open()
        return self._descriptor(session=self.session, protocol=self.protocol)

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    # -- reading -----------------------------------------------------------------------------
    def connect(self, endpoint: bytes, *, timeout: float) -> MooncakePeer:
        d = self._peer_descriptor(endpoint, ("session", "protocol"))
        session = _session_field(d)
        if d["protocol"] != self.protocol:
            raise TransportError(f"mooncake: peer {session} speaks {d['protocol']!r}, this side {self.protocol!r}")
        self._check_open()
        host, port = session.rsplit(":", 1)
        try:  # the engine opens the segment lazily; find a dead endpoint now, within the timeout
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except OSError as e:
            raise TransportError(f"mooncake: cannot reach peer {session}: {e}") from e
        peer = MooncakePeer(session, self.protocol)
        with self._lock:
            self._check_open()
            self._peers.add(peer)
        return peer

    def prepare(
        self, peer: MooncakePeer, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> MooncakePrepared:
        if peer.closed:
            raise TransportError(f"mooncake: peer {peer.session} is disconnected")
        remote_addr, remote_size = [], []
        for i, desc in enumerate(remote_regions):
            d = self._peer_descriptor(desc, ("session", "addr", "nbytes"))
            if _session_field(d) != peer.session:
                raise TransportError(f"mooncake: remote region {i} belongs to {d['session']}, not peer {peer.session}")
            remote_addr.append(int_field("mooncake", d, "addr", 1))
            remote_size.append(int_field("mooncake", d, "nbytes", 1))
        for r in local_regions:
            if r.handle is not self or r.id not in self._regions:
                raise TransportError(f"mooncake: destination region {r.id} is not registered with this transport")
        self._check_bounds(batch, remote_size, [r.nbytes for r in local_regions], peer.session)
        local_base = np.array([r.addr for r in local_regions], dtype=np.int64)
        remote_base = np.array(remote_addr, dtype=np.int64)
        local = (local_base[batch.dst_region] + batch.dst_offset).tolist()
        remote = (remote_base[batch.src_region] + batch.src_offset).tolist()
        lengths = batch.nbytes.tolist()
        step = self.max_batch
        chunks = [
            (local[i : i + step], remote[i : i + step], lengths[i : i + step]) for i in range(0, len(lengths), step)
        ]
        prep = MooncakePrepared(peer, len(batch), batch.total_bytes, chunks=chunks)
        with self._lock:
            self._check_open()
            self._prepared.add(prep)
        return prep

    def read(self, prepared: MooncakePrepared, *, timeout: float) -> None:
        peer = prepared.peer
        with self._lock:
            self._check_open()
            prepared.check_readable("mooncake")
            if prepared.inflight is not None and not prepared.inflight.done():
                raise TransportError(
                    f"mooncake: an earlier read from {peer.session} has not finished yet (it timed out); retry later"
                )
            if not prepared.chunks:
                return
            fut = self._worker.submit(self._post, peer.session, prepared.chunks)
            prepared.inflight = fut
        try:
            status = fut.result(timeout=timeout)
        except FutureTimeout:
            raise TransportError(
                f"mooncake: read of {prepared.count} ops ({prepared.nbytes} bytes) from "
                f"peer {peer.session} did not finish within {timeout}s"
            ) from None
        if status != 0:
            raise TransportError(
                f"mooncake: batch read of {prepared.count} ops ({prepared.nbytes} bytes) "
                f"from peer {peer.session} failed (engine status {status}; peer gone or "
                f"address not served)"
            )

    def _post(self, session: str, chunks: list) -> int:
        """Runs on the worker thread: async engine batches, ``depth`` in flight; 0, or the first failure
        (after every batch already posted has ended, so nothing writes into memory afterwards)."""
        engine, inflight, status = self._engine, deque(), 0
        for local, remote, lengths in chunks:
            if len(inflight) == self.depth:
                status = status or engine.get_batch_transfer_status([inflight.popleft()])
            if status:
                break
            batch = engine.batch_transfer_async_read(session, local, remote, lengths)
            if batch == 0:  # refused at submission (unknown segment, full queues)
                status = -1
                break
            inflight.append(batch)
        if inflight:
            done = engine.get_batch_transfer_status(list(inflight))
            status = status or done
        return status

    def release(self, prepared: MooncakePrepared) -> None:
        with self._lock:
            prepared.released = True
            self._prepared.discard(prepared)

    def disconnect(self, peer: MooncakePeer) -> None:
        with self._lock:
            peer.closed = True
            self._peers.discard(peer)

    def close(self) -> None:
        if not self._begin_close():
            return
        # An engine call still in flight writes into registered memory: let it end (the engine's own
        # transfer timeout bounds it) before unregistering and destroying the engine.
        self._worker.shutdown(wait=True)
        with self._lock:
            for p in list(self._prepared):
                p.released = True
            self._prepared.clear()
            for p in list(self._peers):
                p.closed = True
            self._peers.clear()
            for region in list(self._regions.values()):
                self._engine.unregister_memory(region.addr)
            self._regions.clear()
            self._engine = None  # the engine's destructor stops its threads and listeners

    def _wait_idle(self, addr: int, nbytes: int, limit: float = 60.0) -> None:
        """Waits for in-flight reads that write into ``[addr, addr + nbytes)`` (called with the lock held)."""
        end = time.monotonic() + limit
        for p in self._prepared:
            if p.inflight is not None and not p.inflight.done():
                try:
                    p.inflight.result(timeout=max(0.0, end - time.monotonic()))
                except FutureTimeout:
                    _log.warning(
                        "mooncake: deregistering %#x while a read from %s is still running", addr, p.peer.session
                    )

    def __repr__(self) -> str:
        return (
            f"MooncakeTransport({self.session}, protocol={self.protocol}, regions={len(self._regions)}, "
            f"peers={len(self._peers)}, authenticated=False, closed={self._closed})"
        )


def _session_field(d: dict) -> str:
    session = str_field("mooncake", d, "session")
    host, sep, port = session.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransportError(f"mooncake: descriptor session must be host:port, got {session!r:.80}")
    return session
