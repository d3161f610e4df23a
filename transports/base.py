"""The transport interface: register memory, exchange descriptors, post batches of one-sided reads.

Transports move bytes between memory regions of processes. They know nothing of layouts, plans or
versions: a read is "``nbytes`` from offset ``a`` of remote region ``i`` to offset ``b`` of local
region ``j``".

Call protocol
-------------
Serving side (a publisher rank)::

    t = TcpTransport(token=b"secret", host="10.0.0.5")
    region = t.register(addr, nbytes)           # once per buffer; region.descriptor is bytes
    endpoint = t.endpoint()                     # bytes; publish endpoint + region descriptors
    ...                                         # reads are served in the background
    t.deregister(region); t.close()             # close() is idempotent

Reading side (a subscriber)::

    t = TcpTransport(token=b"secret")
    dst = t.register(addr, nbytes)              # destination memory, once
    peer = t.connect(endpoint, timeout=30.0)    # once per remote endpoint
    prep = t.prepare(peer, [desc0, desc1], [dst], batch)   # once per plan: validates bounds
    t.read(prep, timeout=60.0)                  # every pull: post all reads, wait, or raise
    t.release(prep); t.disconnect(peer); t.close()

``batch`` indexes ``remote_regions`` and ``local_regions`` by position. ``prepare`` checks every
read against the sizes in the descriptors and the local regions and raises ``TransportError``
before anything moves; the serving side checks again and refuses reads outside a registered region.
``read`` either completes every read of the batch or raises ``TransportError`` (``AuthError`` for
a failed handshake); after an error the destination bytes of that batch are unspecified.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .errors import TransportError


@dataclass(frozen=True, eq=False, init=False)
class ReadBatch:
    """Reads from one peer, held as one read-only ``(5, n)`` ``int64`` table whose rows are the
    columns below, in this order: one allocation to check and freeze, and no column can differ in
    length from the others. Each argument is one value per read:

    src_region: index into the remote region descriptors given to ``prepare``
    src_offset: byte offset inside that remote region
    dst_region: index into the local regions given to ``prepare``
    dst_offset: byte offset inside that local region
    nbytes: bytes to read
    """

    table: np.ndarray

    def __init__(self, src_region: Any, src_offset: Any, dst_region: Any, dst_offset: Any, nbytes: Any) -> None:
        cols = [
            np.ravel(np.asarray(c, dtype=np.int64)) for c in (src_region, src_offset, dst_region, dst_offset, nbytes)
        ]
        lengths = sorted({len(c) for c in cols})
        if len(lengths) > 1:
            raise TransportError(f"read batch columns differ in length: {lengths}")
        table = np.stack(cols)
        table.setflags(write=False)
        object.__setattr__(self, "table", table)

    src_region = property(lambda self: self.table[0])
    src_offset = property(lambda self: self.table[1])
    dst_region = property(lambda self: self.table[2])
    dst_offset = property(lambda self: self.table[3])
    nbytes = property(lambda self: self.table[4])

    def __len__(self) -> int:
        return self.table.shape[1]

    def __repr__(self) -> str:
        return f"ReadBatch(reads={len(self)}, bytes={self.total_bytes})"

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int, int, int, int]]) -> ReadBatch:
        """A batch from ``(src_region, src_offset, dst_region, dst_offset, nbytes)`` rows."""
        return cls(*np.asarray(rows, dtype=np.int64).reshape(-1, 5).T)


@dataclass(eq=False)
class Region:
    """A local registration: a handle, never sent anywhere. ``descriptor`` is what peers get."""

    id: int
    addr: int
    nbytes: int
    device: str
    descriptor: bytes
    handle: Any = field(default=None, repr=False)


@dataclass(eq=False)
class PreparedBatch:
    """What ``prepare`` returns where a transport keeps state per batch (a subclass adds what its
    ``read`` posts): the batch's peer and size, and whether it was released.

    peer: the peer the reads go to (messages name it by its ``label``; ``closed`` once disconnected)
    count: reads in the batch
    nbytes: bytes they move
    released: set once ``release`` (or the transport's ``close``) freed the batch
    """

    peer: Any
    count: int
    nbytes: int
    released: bool = field(default=False, kw_only=True)

    def check_readable(self, kind: str) -> None:
        """Raises ``TransportError`` when the batch was released or its peer disconnected."""
        if self.released or self.peer.closed:
            raise TransportError(f"{kind}: read of a released batch or closed peer {self.peer.label}")

    def __repr__(self) -> str:
        name, label = type(self).__name__, self.peer.label
        return f"{name}({label}, reads={self.count}, bytes={self.nbytes}, released={self.released})"


def encode_descriptor(kind: str, **fields: Any) -> bytes:
    return json.dumps({"transport": kind, **fields}, separators=(",", ":"), sort_keys=True).encode()


def decode_descriptor(kind: str, data: bytes, required: Sequence[str]) -> dict:
    """Parses and validates a descriptor that came from a peer (through an untrusted store)."""
    try:
        d = json.loads(bytes(data))
    except (ValueError, TypeError) as e:
        raise TransportError(f"{kind}: malformed descriptor: {e}") from None
    if not isinstance(d, dict) or d.get("transport") != kind:
        raise TransportError(
            f"{kind}: descriptor is for transport {d.get('transport') if isinstance(d, dict) else d!r}"
        )
    missing = [k for k in required if k not in d]
    if missing:
        raise TransportError(f"{kind}: descriptor lacks {missing}")
    return d


def check_batch_bounds(
    kind: str, batch: ReadBatch, remote_sizes: Sequence[int], local_sizes: Sequence[int], peer: str
) -> None:
    """Raises ``TransportError`` if any read of ``batch`` falls outside its regions."""
    if len(batch) == 0:
        return
    rs = np.asarray(remote_sizes, dtype=np.int64)
    ls = np.asarray(local_sizes, dtype=np.int64)
    bad = (
        (batch.src_region < 0)
        | (batch.src_region >= len(rs))
        | (batch.dst_region < 0)
        | (batch.dst_region >= len(ls))
        | (batch.nbytes <= 0)
        | (batch.src_offset < 0)
        | (batch.dst_offset < 0)
    )
    if not bad.any():
        bad = (batch.src_offset + batch.nbytes > rs[batch.src_region]) | (
            batch.dst_offset + batch.nbytes > ls[batch.dst_region]
        )
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TransportError(
            f"{kind}: read {i} to peer {peer} out of bounds: src region {int(batch.src_region[i])} "
            f"offset {int(batch.src_offset[i])} dst region {int(batch.dst_region[i])} offset "
            f"{int(batch.dst_offset[i])} nbytes {int(batch.nbytes[i])} (remote sizes {list(rs)}, "
            f"local sizes {list(ls)})"
        )


class Transport(ABC):
    """Base class; see the module docstring for the call protocol.

    Constructor keywords shared by every transport: ``token`` (bytes or None) authenticates peers
    where the transport supports it, ``host`` is the address a serving side binds or advertises
    (``127.0.0.1`` by default: nothing listens on all interfaces unless asked).
    """

    name: ClassVar[str] = "base"
    #: The kinds of memory this transport registers, serves and reads into directly: ``"cpu"``
    #: (host memory), plus ``"cuda"`` where it reaches device memory without a host bounce.
    #: wbridge stages tensors that live in a kind a transport lacks in host memory
    #: (``wbridge._selection``: the publisher's slots, the subscriber's read buffer).
    memory_kinds: ClassVar[tuple[str, ...]] = ("cpu",)

    def __init__(self, *, token: bytes | None = None, host: str = "127.0.0.1") -> None:
        self.token = token
        self.host = host
        self._closed = False
        self._lock = threading.Lock()

    # -- serving and registration ------------------------------------------------------------
    @abstractmethod
    def register(self, addr: int, nbytes: int, *, device: str = "cpu") -> Region:
        """Registers ``nbytes`` at ``addr`` (``device`` ``cpu`` or ``cuda:N``) for local or remote use."""

    def host_buffer(self, nbytes: int) -> Any | None:
        """A writable host buffer of ``nbytes`` that this transport serves best (shared memory, say),
        for a publisher to stage into; ``None`` means any memory will do. Register it as usual."""
        return None

    @abstractmethod
    def deregister(self, region: Region) -> None:
        """Stops serving ``region``; reads of it are refused from now on."""

    @abstractmethod
    def endpoint(self) -> bytes:
        """This process's serializable address for peers (listening address, agent metadata)."""

    # -- reading -----------------------------------------------------------------------------
    @abstractmethod
    def connect(self, endpoint: bytes, *, timeout: float) -> Any:
        """Opens a peer from its endpoint; authenticates where the transport does."""

    @abstractmethod
    def prepare(
        self, peer: Any, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> Any:
        """Validates ``batch`` and builds whatever can be reused by every ``read``."""

    @abstractmethod
    def read(self, prepared: Any, *, timeout: float) -> None:
        """Posts every read of a prepared batch and waits for all of them, or raises."""

    def release(self, prepared: Any) -> None:
        """Frees what ``prepare`` built. Default: nothing to free."""

    def disconnect(self, peer: Any) -> None:
        """Closes a peer opened by ``connect``. Default: nothing to close."""

    @abstractmethod
    def close(self) -> None:
        """Releases everything; idempotent."""

    def _begin_close(self) -> bool:
        """Marks the transport closed; False when it already was (``close`` then has nothing to do)."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _end_serving(self, peers: Sequence[Any], server: Any, regions: Sequence[Region], timeout: float) -> None:
        """The rest of ``close`` for a transport with a listener: ``peers`` disconnected, ``server``
        (if any) closed, waiting up to ``timeout`` for its connections, ``regions`` deregistered."""
        for peer in peers:
            self.disconnect(peer)
        if server is not None:
            server.close(timeout)
        for region in regions:
            self.deregister(region)

    def _check_open(self) -> None:
        """Raises ``TransportError`` once ``close`` was called."""
        if self._closed:
            raise TransportError(f"{self.name}: transport is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(host={self.host!r}, closed={self._closed})"
