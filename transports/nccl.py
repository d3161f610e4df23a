"""``nccl``: the two-sided fallback. Reads become matched send/recv pairs in a per-connection process group.

Serving side: ``endpoint()`` starts a control listener on ``host`` (never all interfaces by default).
Each connection first runs a mutual HMAC challenge-response with the shared token (the token never
crosses the wire). Then, per connection:

- ``PREPARE`` (once per plan): the reader's batch as ``(region, offset, nbytes)`` entries; the server
  checks every entry against its registered regions and keeps it, or answers ``ERROR``;
- ``PULL`` (every read): the server re-checks that the regions are still registered and answers
  ``READY``. On the first pull of a connection both sides form a two-rank ``torch.distributed``
  process group (gloo for host memory, NCCL for CUDA memory), whose rendezvous store is served *over
  this authenticated connection* (no TCPStore, which would listen on all interfaces); later pulls
  name that group and reuse it (the server's ``READY`` says whether it still has it). The server
  sends, the reader receives; the reader reports ``END`` and the server answers ``DONE`` or ``ERROR``.

Reads of at least ``direct_bytes`` go as one send/recv each, straight between the registered memory
and the destination; smaller reads are gathered into one packed send on the serving side and
scattered from the packed receive buffer on the reading side (thousands of tiny sends would cost
more than the copies); both copies, and the views of the long reads, are built once per prepared
batch, and in host memory each copy is one ``CopyPlan`` (no Python call per read). Every wait is
bounded by the read's timeout. After an error both sides tear the group down and the control
connection is closed, so a peer that died mid-pull cannot wedge later pulls: the next ``read`` of
the same prepared batch reconnects, re-prepares and forms a new group.
"""

from __future__ import annotations

import itertools
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _auth
from . import _nccl_group as g
from . import _nccl_proto as p
from ._nccl_serve import Server, ServerConfig
from ._regions import RegionTable, Served
from ._util import hex_field, int_field, str_field, time_left, token_key, wake
from .base import (
    Positive,
    PreparedBatch,
    ReadBatch,
    Region,
    Seconds,
    Transport,
    checked_options,
)
from .errors import TransportError

try:
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - torch is a core dependency
    raise ImportError(f"the nccl transport needs torch.distributed ({e})") from e

_ids = itertools.count(1)


@dataclass(eq=False)
class NcclPeer:
    host: str
    port: int
    instance: bytes
    sock: socket.socket | None = None
    closed: bool = False
    generation: int = 0  # bumped on every (re)connection: prepared batches live per connection
    #: The process group formed with the serving side, kept across pulls (``group_id`` names it to
    #: the server; ``group_key`` is its (backend, device)); dropped with the connection.
    group: Any = None
    group_id: str = ""
    group_key: tuple = ()
    store: Any = None

    @property
    def label(self) -> str:
        return f"{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"NcclPeer({self.label}, connected={self.sock is not None}, closed={self.closed})"


@dataclass(eq=False)
class NcclPrepared(PreparedBatch):
    peer: NcclPeer
    id: int
    entries: bytes
    direct_views: list
    packed: g.Packed | None  # the short reads: one receive buffer, scattered after each pull
    backend: str
    device: str
    generation: int = -1  # the peer connection that knows this batch

    def __repr__(self) -> str:
        return (
            f"NcclPrepared({self.peer.label}, reads={self.count}, bytes={self.nbytes}, backend={self.backend}, "
            f"released={self.released})"
        )


class NcclTransport(Transport):
    """Two-sided reads over per-pull process groups; see the module docstring.

    ``direct_bytes``: reads at least this long get their own send/recv (smaller ones are packed).
    ``max_timeout``: the longest pull the serving side takes part in. ``handshake_timeout``: seconds
    a new connection has to authenticate.
    """

    name = "nccl"
    memory_kinds = ("cpu", "cuda")

    @checked_options
    def __init__(
        self,
        token: bytes | str | None = None,
        host: str = "127.0.0.1",
        *,
        direct_bytes: Positive = 64 << 10,
        max_timeout: Seconds = 600.0,
        handshake_timeout: Seconds = 10.0,
    ) -> None:
        super().__init__(token=token, host=host)
        self._key = token_key(token)
        self.direct_bytes, self.max_timeout, self.handshake_timeout = direct_bytes, max_timeout, handshake_timeout
        self._regions: dict[int, Region] = {}
        self._table = RegionTable("nccl")
        self._server: Server | None = None
        self._peers: set[NcclPeer] = set()

    @staticmethod
    def usable() -> bool:
        return dist.is_available() and hasattr(dist, "ProcessGroupGloo")

    # -- serving -----------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, *, device: str = "cpu") -> Region:
        g.check_device(device)
        if type(addr) is not int or addr <= 0 or type(nbytes) is not int or nbytes <= 0:  # noqa: E721
            raise TransportError(f"nccl: cannot register {nbytes!r} bytes at {addr!r}")
        tensor = g.tensor(addr, nbytes, device)
        with self._lock:
            self._check_open()
            rid = next(_ids)
            desc = self._descriptor(instance=self._instance().hex(), region=rid, nbytes=nbytes, device=device)
            region = Region(rid, addr, nbytes, device, desc, handle=(self, tensor))
            self._regions[rid] = region
            self._table.add(rid, Served(nbytes, addr, tensor, device))
        return region

    def _instance(self) -> bytes:
        if self._server is None:
            self._server = Server(
                ServerConfig(self._key, self._table, self.host, self.handshake_timeout, self.max_timeout)
            )
        return self._server.instance

    def deregister(self, region: Region, timeout: float = 60.0) -> None:
        """Stops serving ``region``; a pull sending from it finishes first (``timeout`` seconds at most)."""
        with self._lock:
            if self._regions.pop(region.id, None) is None:
                return
        self._table.remove(region.id, timeout)

    def endpoint(self) -> bytes:
        with self._lock:
            self._check_open()
            instance = self._instance()
            return self._descriptor(host=self._server.host, port=self._server.port, instance=instance.hex())

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    @property
    def num_connections(self) -> int:
        return len(self._server.conns) if self._server else 0

    # -- reading -----------------------------------------------------------------------------
    def connect(self, endpoint: bytes, *, timeout: float) -> NcclPeer:
        d = self._peer_descriptor(endpoint, ("host", "port", "instance"))
        peer = NcclPeer(
            str_field("nccl", d, "host"),
            int_field("nccl", d, "port", 1, 65535),
            hex_field("nccl", d, "instance", p.INSTANCE),
        )
        with self._lock:
            self._check_open()
            self._peers.add(peer)
        try:
            self._open(peer, time.monotonic() + timeout)
        except BaseException:
            self.disconnect(peer)
            raise
        return peer

    def _open(self, peer: NcclPeer, deadline: float) -> None:
        def handshake(sock: socket.socket) -> None:
            sock.settimeout(time_left(deadline, "nccl", peer.label, "authenticate"))
            send, recv = p.handshake_io(sock)
            _auth.client_handshake(send, recv, self._key, p.LABEL, peer.instance, f"nccl: peer {peer.label}")
            sock.settimeout(None)

        sock = _auth.dial("nccl", peer.host, peer.port, deadline, handshake)
        peer.sock = sock
        peer.generation += 1

    def prepare(
        self, peer: NcclPeer, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> NcclPrepared:
        ids, sizes, devices = [], [], []
        for i, desc in enumerate(remote_regions):
            d = self._peer_descriptor(desc, ("instance", "region", "nbytes", "device"))
            if hex_field("nccl", d, "instance", p.INSTANCE) != peer.instance:
                raise TransportError(f"nccl: remote region {i} is not served by peer {peer.label}")
            ids.append(int_field("nccl", d, "region", 1))
            sizes.append(int_field("nccl", d, "nbytes", 1))
            g.check_device(str_field("nccl", d, "device"))
            devices.append(d["device"])
        for r in local_regions:
            if not isinstance(r.handle, tuple) or r.handle[0] is not self or r.id not in self._regions:
                raise TransportError(f"nccl: destination region {r.id} is not registered with this transport")
        self._check_bounds(batch, sizes, [r.nbytes for r in local_regions], peer.label)
        backend = g.backend_for([r.device for r in local_regions], "the destination")
        used = sorted({devices[i] for i in np.unique(batch.src_region).tolist()}) if len(batch) else []
        if used and g.backend_for(used, f"peer {peer.label}") != backend:
            raise TransportError(f"nccl: peer {peer.label} serves {used} but the destination is {backend} memory")
        device = local_regions[0].device if local_regions else "cpu"
        dst = [r.handle[1] for r in local_regions]
        direct, packed = g.split(batch.nbytes, self.direct_bytes)
        dr, do, n = batch.dst_region.tolist(), batch.dst_offset.tolist(), batch.nbytes.tolist()
        direct_views = [dst[dr[i]][do[i] : do[i] + n[i]] for i in direct.tolist()]
        small = g.packed(
            dst,
            [r.addr for r in local_regions],
            device,
            batch.dst_region[packed],
            batch.dst_offset[packed],
            batch.nbytes[packed],
            gather=False,
        )
        entries = np.empty(len(batch), dtype=p.ENTRY)
        entries["region"] = np.asarray(ids, dtype=np.int64)[batch.src_region] if len(batch) else []
        entries["offset"], entries["nbytes"] = batch.src_offset, batch.nbytes
        prep = NcclPrepared(
            peer,
            len(batch),
            batch.total_bytes,
            id=next(_ids),
            entries=entries.tobytes(),
            direct_views=direct_views,
            packed=small,
            backend=backend,
            device=device,
        )
        with self._lock:
            self._check_open()
        if len(batch):
            self._prepare_remote(prep, time.monotonic() + self.handshake_timeout)
        return prep

    def _prepare_remote(self, prep: NcclPrepared, deadline: float) -> None:
        peer = prep.peer
        if peer.closed:
            raise TransportError(f"nccl: peer {peer.label} is disconnected")
        if peer.sock is None:
            self._open(peer, deadline)
        try:
            peer.sock.settimeout(time_left(deadline, "nccl", peer.label, "prepare"))
            p.send(peer.sock, p.PREPARE, {"id": prep.id, "direct": self.direct_bytes}, prep.entries)
            kind, msg, _ = p.recv(peer.sock, (p.OK,))
            peer.sock.settimeout(None)
        except (OSError, ConnectionError) as e:
            self._drop(peer)
            raise TransportError(f"nccl: peer {peer.label} lost while preparing: {e!r}") from e
        if kind == p.ERROR:
            raise TransportError(f"nccl: peer {peer.label} refused the batch: {msg.get('message')}")
        prep.generation = peer.generation

    def read(self, prepared: NcclPrepared, *, timeout: float) -> None:
        peer = prepared.peer
        deadline = time.monotonic() + timeout
        self._check_open()
        prepared.check_readable("nccl")
        if prepared.count == 0:
            return
        if peer.sock is None or prepared.generation != peer.generation:
            self._prepare_remote(prepared, deadline)
        sock = peer.sock
        key = (prepared.backend, prepared.device)
        try:
            sock.settimeout(time_left(deadline, "nccl", peer.label, "pull"))
            if peer.group is None or peer.group_key != key:
                self._end_group(peer)
                peer.group_id, peer.group_key = uuid.uuid4().hex, key
            p.send(sock, p.PULL, {"id": prepared.id, "timeout": timeout, "group": peer.group_id})
            kind, msg, _ = p.recv(sock, (p.READY,))
            if kind == p.ERROR:
                raise TransportError(f"nccl: peer {peer.label} refused the pull: {msg.get('message')}")
            if msg.get("new", True) or peer.group is None:  # one group per connection, formed once
                g.destroy(peer.group)
                peer.group = None
                peer.store = p.SocketStore(sock, deadline)
                peer.group = g.make_group(peer.store, 1, prepared.backend, self.host, self.max_timeout, prepared.device)
            peer.store.deadline = deadline  # NCCL may still call the store (lazy communicators)
            bufs = prepared.direct_views + ([prepared.packed.buffer] if prepared.packed is not None else [])
            g.wait(
                g.post(peer.group, prepared.backend, prepared.device, bufs, 0, send=False),
                deadline,
                f"pull from peer {peer.label}",
            )
            if prepared.packed is not None:
                prepared.packed.run()
            sock.settimeout(time_left(deadline, "nccl", peer.label, "pull"))
            p.send(sock, p.END, {"ok": True})
            kind, msg, _ = p.recv(sock, (p.DONE,))
            sock.settimeout(None)
            if kind == p.ERROR:
                raise TransportError(f"nccl: peer {peer.label} reports: {msg.get('message')}")
        except (OSError, ConnectionError, RuntimeError, TransportError) as e:
            self._drop(peer)  # the connection's state is unknown now: the next read starts afresh
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"nccl: pull from peer {peer.label} failed: {e!r}") from e

    @staticmethod
    def _end_group(peer: NcclPeer) -> None:
        g.destroy(peer.group)
        peer.group, peer.store, peer.group_id, peer.group_key = None, None, "", ()

    def _drop(self, peer: NcclPeer) -> None:
        self._end_group(peer)
        sock, peer.sock = peer.sock, None
        if sock is not None:
            wake(sock)
            sock.close()

    def release(self, prepared: NcclPrepared) -> None:
        if prepared.released:
            return
        prepared.released = True
        sock = prepared.peer.sock
        if sock is not None and prepared.generation == prepared.peer.generation:
            try:
                p.send(sock, p.RELEASE, {"id": prepared.id})
            except OSError:
                self._drop(prepared.peer)

    def disconnect(self, peer: NcclPeer) -> None:
        with self._lock:
            if peer.closed:
                return
            peer.closed = True
            self._peers.discard(peer)
        self._drop(peer)

    def close(self) -> None:
        if not self._begin_close():
            return
        with self._lock:
            server, self._server = self._server, None
        self._end_serving(list(self._peers), server, list(self._regions.values()), self.max_timeout)

    def __repr__(self) -> str:
        where = f"{self._server.host}:{self._server.port}" if self._server else "not serving"
        return f"NcclTransport({where}, regions={len(self._regions)}, peers={len(self._peers)}, closed={self._closed})"
