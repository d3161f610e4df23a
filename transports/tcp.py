"""``tcp``: the built-in transport. Reads served from registered host memory over parallel TCP streams.

Serving side: ``endpoint()`` starts a listener on ``host`` (loopback unless told otherwise; never all
interfaces by default) with one thread per authenticated connection. Each connection runs the
protocol of ``transports._wire``: a mutual HMAC challenge-response with the shared token (the token
never crosses the wire), then READ requests answered with DATA frames sent straight from the
registered memory (``writev`` over iovec columns built with numpy: no copy and no Python object
per read; reads whose sources continue one another go as one piece; a READ of at most
``FEW_ENTRIES`` reads is checked entry by entry instead). A read that falls outside a
registered region is refused with an ERROR frame; malformed frames close the connection.

Reading side: ``connect`` opens ``streams`` authenticated connections to a peer; ``prepare`` checks
bounds, splits long reads, balances the pieces over the streams by bytes (a small batch over fewer of
them: ``STREAM_MIN_BYTES``) and packs the READ frames once (a batch of at most ``FEW_ENTRIES`` reads
that needs no split: one frame, directly); ``read`` posts them (two frames in flight per stream) and
receives each DATA frame straight into the destination memory (``readv`` over iovec columns of the
destination, built once at ``prepare``).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np

from . import _auth, _iov
from . import _wire as w
from ._preauth import PreauthGate
from ._regions import RegionTable, Served
from ._util import (
    check_host_memory,
    coalesce,
    hex_field,
    int_field,
    peer_lock,
    split_and_balance,
    str_field,
    time_left,
    token_key,
    wake,
)
from .base import (
    Positive,
    Range,
    ReadBatch,
    Region,
    Seconds,
    Transport,
    checked_options,
)
from .errors import AuthError, TransportError

INSTANCE_BYTES = 16
# A batch spreads over at most one stream per this many bytes: handing a stream its frames costs a
# thread hop (0.1-0.3 ms on a loaded host), more than reading this much on a stream already going
# (a delta pull's headers and tables, a few KiB in 4 reads, took 1.3 ms over 4 streams, 0.3 on one).
STREAM_MIN_BYTES = 256 << 10
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """What one server connection needs; plain data so fuzzers can drive ``serve_connection``."""

    key: bytes
    instance: bytes
    regions: RegionTable
    handshake_timeout: float = 10.0
    frame_timeout: float = 30.0


def _send_error(sock: socket.socket, message: str) -> None:
    try:
        sock.sendall(w.frame(w.FrameType.ERROR, message.encode()[: w.MAX_ERROR_BYTES]))
    except OSError:
        pass


def _close_gracefully(sock: socket.socket, limit: int = 1 << 20, timeout: float = 1.0) -> None:
    """Half-closes, then drains (bounded) what the peer still sends, so the kernel does not answer it
    with a reset that would discard our ERROR frame before the peer reads it."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(timeout)
        drained = 0
        while drained < limit:
            chunk = sock.recv(65536)
            if not chunk:
                return
            drained += len(chunk)
    except OSError:
        pass


def _server_handshake(sock: socket.socket, cfg: ServerConfig) -> bool:
    send, recv = w.handshake_io(sock, client=False)
    return _auth.server_handshake(send, recv, cfg.key, w.LABEL, cfg.instance)


def _serve_read(sock: socket.socket, cfg: ServerConfig, payload: bytes) -> None:
    """Validates every entry of a READ, then answers with one DATA frame, or with one ERROR frame."""
    entries = w.unpack_entries(payload)
    few = len(entries) <= FEW_ENTRIES
    ids = sorted(set(entries["region"].tolist())) if few else np.unique(entries["region"])
    served, why = cfg.regions.acquire(np.asarray(ids, dtype=np.uint64))
    if served is None:
        _send_error(sock, f"read refused: {why}")
        return
    try:
        pieces = _few_pieces(entries.tolist(), ids, served) if few else _pieces(entries, ids, served)
        if isinstance(pieces, str):
            _send_error(sock, f"read refused: {pieces}")
            return
        header = np.frombuffer(w.pack_header(w.FrameType.DATA, int(pieces[:, 1].sum())), dtype=np.uint8)
        # One gather write per IOV_MAX pieces, straight from the registered memory.
        iov = np.concatenate((np.array([[header.ctypes.data, header.nbytes]], dtype=np.uint64), pieces))
        sock.settimeout(cfg.frame_timeout)
        _iov.send_iov(sock, iov, lambda: cfg.frame_timeout)
    finally:
        cfg.regions.release(served)


#: A READ of at most this many entries is checked with Python ints: numpy's cost per call, paid
#: some twenty times, was most of a small read's (0.25-0.45 ms of a server idle between reads).
FEW_ENTRIES = 8


def _pieces(entries: np.ndarray, ids: np.ndarray, served: list) -> np.ndarray | str:
    """The iovecs of a READ's ``entries`` in the regions ``served`` (those of ``ids``), reads whose
    sources continue one another as one piece; or why one is refused."""
    index = np.searchsorted(ids, entries["region"])
    sizes = np.array([e.nbytes for e in served], dtype=np.uint64)[index]
    off, n = entries["offset"], entries["nbytes"]
    bad = (n == 0) | (off > sizes) | (n > sizes - np.minimum(off, sizes))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return _outside(i, int(entries["region"][i]), int(off[i]), int(n[i]), int(sizes[i]))
    src = np.array([e.addr for e in served], dtype=np.uint64)[index] + off
    _, src, n = coalesce(np.cumsum(n) - n, src, n)
    return _iov.iovecs(src, n)


def _few_pieces(entries: list[tuple[int, int, int]], ids: list[int], served: list) -> np.ndarray | str:
    """``_pieces`` of a few ``(region, offset, nbytes)`` entries, with Python ints."""
    region = dict(zip(ids, served))
    pieces = []
    for i, (rid, off, n) in enumerate(entries):
        size = region[rid].nbytes
        if n == 0 or off > size or n > size - off:
            return _outside(i, rid, off, n, size)
        pieces.append((region[rid].addr + off, n))
    return np.array(pieces, dtype=np.uint64)


def _outside(i: int, rid: int, off: int, n: int, size: int) -> str:
    return f"entry {i} (region {rid}, offset {off}, nbytes {n}) is outside the region of {size} bytes"


def serve_connection(
    sock: socket.socket, cfg: ServerConfig, stopping: Callable[[], bool] = lambda: False, gate: Any = None
) -> str:
    """Runs one connection until the peer leaves, misbehaves or the server stops; returns why it ended.
    ``gate`` (a ``PreauthGate``) is told once the peer passed the handshake.

    Never raises for anything the peer sends: every failure ends in closing this connection only.
    """
    try:
        sock.settimeout(cfg.handshake_timeout)
        if not _server_handshake(sock, cfg):
            _close_gracefully(sock)
            return "authentication failed"
        if gate is not None:
            gate.passed(sock)
        while not stopping():
            sock.settimeout(None)  # an authenticated client may idle between pulls
            if not sock.recv(1, socket.MSG_PEEK):
                return "peer closed"
            sock.settimeout(cfg.frame_timeout)  # but a frame, once started, must arrive promptly
            kind, payload = w.recv_frame(sock, (w.FrameType.READ,))
            _serve_read(sock, cfg, payload)
        return "server stopping"
    except w.ProtocolError as e:
        _send_error(sock, f"protocol error: {e}")
        _close_gracefully(sock)
        return f"protocol error: {e}"
    except (OSError, ConnectionError) as e:  # timeouts, resets, EOF
        return f"connection error: {e!r}"
    except Exception as e:  # noqa: BLE001 - a bug must cost one connection, not the server
        _log.exception("tcp: internal error serving a connection")
        _send_error(sock, "internal error")
        return f"internal error: {e!r}"
    finally:
        try:
            sock.close()
        except OSError:
            pass


class _Server:
    """The listener and its connection threads."""

    def __init__(self, host: str, port: int, cfg: ServerConfig, max_connections: int, bind: str | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.sock = socket.create_server((bind or host, port), family=family, backlog=128)
        except OSError as e:
            raise TransportError(f"tcp: cannot listen on {bind or host}:{port}: {e}") from e
        self.host, self.port = host, self.sock.getsockname()[1]
        self.cfg = cfg
        self.max_connections = max_connections
        self._stopping = False
        self.internal_errors = 0  # connections that ended in a server bug (the fuzz tests want 0)
        self._conns: dict[threading.Thread, socket.socket] = {}
        self._lock = threading.Lock()
        self._gate = PreauthGate(cfg.handshake_timeout)  # not yet authenticated: their own cap
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"wbridge-tcp-accept-{self.port}", daemon=True)
        self._acceptor.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError as e:
                if self._stopping:
                    return  # listener shut down by close()
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.1)  # out of descriptors or memory: keep serving once some are free
                    continue
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                _log.error("tcp: listener on %s:%s failed: %s", self.host, self.port, e)
                return
            with self._lock:
                if self._stopping or len(self._conns) - len(self._gate) >= self.max_connections:
                    conn.close()
                    continue
                self._gate.admit(conn)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t = threading.Thread(target=self._run, args=(conn,), name="wbridge-tcp-conn", daemon=True)
                self._conns[t] = conn
            t.start()

    def _run(self, conn: socket.socket) -> None:
        try:
            why = serve_connection(conn, self.cfg, lambda: self._stopping, self._gate)
            if why.startswith("internal error"):
                self.internal_errors += 1
        finally:
            self._gate.passed(conn)
            with self._lock:
                self._conns.pop(threading.current_thread(), None)

    def close(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._gate.close()
        for s in [self.sock] + self._shutdown_all():
            wake(s)  # wakes accept()/recv() blocked in other threads
        self._acceptor.join(timeout)
        self.sock.close()
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._conns)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _shutdown_all(self) -> list[socket.socket]:
        with self._lock:
            return list(self._conns.values())


@dataclass(frozen=True)
class _Frame:
    """One pre-packed READ and where its DATA lands (iovecs, neighbouring destinations merged)."""

    request: bytes
    iov: np.ndarray = field(repr=False)
    nbytes: int


@dataclass(eq=False)
class TcpPeer:
    """An open peer: ``streams`` authenticated connections to one endpoint."""

    host: str
    port: int
    instance: bytes
    socks: list[socket.socket | None]
    pool: ThreadPoolExecutor | None = field(repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    closed: bool = False

    @property
    def label(self) -> str:
        return f"{self.host}:{self.port}"

    def __repr__(self) -> str:
        up = sum(s is not None for s in self.socks)
        return f"TcpPeer({self.label}, streams={up}/{len(self.socks)}, closed={self.closed})"


@dataclass(frozen=True, eq=False)
class TcpPrepared:
    """A validated batch packed into READ frames per stream; reused by every ``read``."""

    peer: TcpPeer
    frames: tuple[tuple[_Frame, ...], ...] = field(repr=False)
    nreads: int
    nbytes: int

    def __repr__(self) -> str:
        return (
            f"TcpPrepared(peer={self.peer.label}, reads={self.nreads}, bytes={self.nbytes}, streams={len(self.frames)})"
        )


class TcpTransport(Transport):
    """Reads over authenticated TCP; see the module docstring. Host memory only.

    ``token`` is the shared secret (``None`` only on loopback: then anyone on this host may read the
    registered regions). ``host``: the address the listener binds and advertises (never a wildcard).
    Options (``transport_options={"tcp": {...}}``):

    - ``port``: the listening port (0: any free one).
    - ``streams``: parallel connections per peer (1 to 64).
    - ``split_bytes``: reads longer than this are cut so the streams balance.
    - ``frame_bytes``: the most bytes one READ frame asks for.
    - ``window``: READ frames in flight per stream.
    - ``handshake_timeout``, ``frame_timeout``: seconds a peer may take to authenticate, and to send a frame.
    - ``max_connections``: authenticated connections served at once.
    - ``bind_all``: listen on every interface (``0.0.0.0``, or ``::`` for an IPv6 ``host``) while
      advertising ``host``; needs a token. The one way to listen on all interfaces: ``host`` itself
      is never a wildcard.
    """

    name = "tcp"

    @checked_options
    def __init__(
        self,
        token: bytes | str | None = None,
        host: str = "127.0.0.1",
        port: Annotated[int, Range(0, 65535)] = 0,
        streams: Annotated[int, Range(1, 64)] = 4,
        *,
        split_bytes: Positive = 4 << 20,
        frame_bytes: Annotated[int, Range(1, w.MAX_READ_BYTES)] = 64 << 20,
        window: Positive = 2,
        handshake_timeout: Seconds = 10.0,
        frame_timeout: Seconds = 30.0,
        max_connections: Positive = 1024,
        bind_all: bool = False,
    ) -> None:
        super().__init__(token=token, host=host)
        self._key = token_key(token)
        self.bind_all = bind_all
        self.port, self.streams = port, streams
        self.split_bytes, self.frame_bytes, self.window = split_bytes, frame_bytes, window
        self.handshake_timeout, self.frame_timeout = handshake_timeout, frame_timeout
        self.max_connections = max_connections
        self._instance = os.urandom(INSTANCE_BYTES)
        self._table = RegionTable("tcp")
        self._regions: dict[int, Region] = {}
        self._next_id = 1
        self._server: _Server | None = None
        self._peers: set[TcpPeer] = set()

    @classmethod
    def check_combination(cls, options: Mapping[str, Any], token: object) -> None:
        if options.get("bind_all") and not token:
            raise TransportError("tcp: bind_all=True listens on every interface: it needs a token")

    # -- serving -----------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, *, device: str = "cpu") -> Region:
        check_host_memory("tcp", addr, nbytes, device)
        with self._lock:
            self._check_open()
            rid, self._next_id = self._next_id, self._next_id + 1
            desc = self._descriptor(instance=self._instance.hex(), region=rid, nbytes=nbytes)
            region = Region(rid, addr, nbytes, device, desc)
            self._regions[rid] = region
            self._table.add(rid, Served(nbytes, addr))
        return region

    def deregister(self, region: Region) -> None:
        with self._lock:
            if self._regions.pop(region.id, None) is None:
                return
        self._table.remove(region.id, timeout=self.frame_timeout)

    def endpoint(self) -> bytes:
        with self._lock:
            self._check_open()
            if self._server is None:
                if self._key == b"" and not _is_loopback(self.host):
                    raise TransportError(f"tcp: refusing to serve on {self.host} without a token; pass token=...")
                cfg = ServerConfig(self._key, self._instance, self._table, self.handshake_timeout, self.frame_timeout)
                wildcard = ("::" if ":" in self.host else "0.0.0.0") if self.bind_all else None
                self._server = _Server(self.host, self.port, cfg, self.max_connections, bind=wildcard)
            return self._descriptor(host=self.host, port=self._server.port, instance=self._instance.hex())

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    @property
    def num_connections(self) -> int:
        """Connections the serving side holds open now."""
        return self._server.connections if self._server else 0

    # -- reading -----------------------------------------------------------------------------
    def connect(self, endpoint: bytes, *, timeout: float) -> TcpPeer:
        d = self._peer_descriptor(endpoint, ("host", "port", "instance"))
        host, port = str_field("tcp", d, "host"), int_field("tcp", d, "port", 1, 65535)
        instance = hex_field("tcp", d, "instance", INSTANCE_BYTES)
        with self._lock:
            self._check_open()
            peer = TcpPeer(
                host,
                port,
                instance,
                [None] * self.streams,
                ThreadPoolExecutor(self.streams - 1, "wbridge-tcp-stream") if self.streams > 1 else None,
            )
            self._peers.add(peer)
        deadline = time.monotonic() + timeout
        try:
            for i in range(self.streams):
                peer.socks[i] = self._open_stream(peer, deadline)
        except BaseException:
            self.disconnect(peer)
            raise
        return peer

    def _open_stream(self, peer: TcpPeer, deadline: float) -> socket.socket:
        def handshake(sock: socket.socket) -> None:
            send, recv = w.handshake_io(
                sock, client=True, time_left=lambda: time_left(deadline, "tcp", peer.label, "authenticate")
            )
            _auth.client_handshake(send, recv, self._key, w.LABEL, peer.instance, f"tcp: peer {peer.label}")

        return _auth.dial("tcp", peer.host, peer.port, deadline, handshake)

    def prepare(
        self, peer: TcpPeer, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> TcpPrepared:
        remote_ids, remote_sizes = [], []
        for i, desc in enumerate(remote_regions):
            d = self._peer_descriptor(desc, ("instance", "region", "nbytes"))
            if hex_field("tcp", d, "instance", INSTANCE_BYTES) != peer.instance:
                raise TransportError(f"tcp: remote region {i} is not served by peer {peer.label}")
            remote_ids.append(int_field("tcp", d, "region", 1))
            remote_sizes.append(int_field("tcp", d, "nbytes", 1))
        for r in local_regions:
            if r.device != "cpu":
                raise TransportError(f"tcp: destination region {r.id} is on {r.device}; tcp reads into host memory")
        self._check_bounds(batch, remote_sizes, [r.nbytes for r in local_regions], peer.label)
        if 0 < len(batch) <= FEW_ENTRIES and batch.total_bytes <= min(self.split_bytes, self.frame_bytes):
            return self._prepare_few(peer, remote_ids, local_regions, batch)
        dst_base = np.array([r.addr for r in local_regions], dtype=np.int64)
        rid = np.asarray(remote_ids, dtype=np.int64)
        streams = max(1, min(self.streams, -(-batch.total_bytes // STREAM_MIN_BYTES)))
        op, start, stream = split_and_balance(batch.nbytes, streams, self.split_bytes)
        size = np.minimum(batch.nbytes[op] - start, self.split_bytes)
        src_reg, src_off = rid[batch.src_region[op]], batch.src_offset[op] + start
        dst = dst_base[batch.dst_region[op]] + batch.dst_offset[op] + start
        frames: list[tuple[_Frame, ...]] = [() for _ in range(self.streams)]
        for s in range(streams):
            a, b = np.searchsorted(stream, [s, s + 1])  # each stream takes a consecutive run of pieces
            frames[s] = tuple(self._pack_frames(src_reg[a:b], src_off[a:b], dst[a:b], size[a:b]))
        return TcpPrepared(peer, tuple(frames), len(batch), batch.total_bytes)

    def _prepare_few(
        self, peer: TcpPeer, remote_ids: list[int], local_regions: Sequence[Region], batch: ReadBatch
    ) -> TcpPrepared:
        """``prepare`` of a batch of a few reads that need no split (one READ frame on the first
        stream), with Python ints: numpy's cost per call was most of such a prepare."""
        rows = zip(
            *(
                c.tolist()
                for c in (batch.src_region, batch.src_offset, batch.dst_region, batch.dst_offset, batch.nbytes)
            )
        )
        entries, iov = [], []
        for sr, so, dr, do, n in rows:
            entries.append((remote_ids[sr], so, n))
            iov.append((local_regions[dr].addr + do, n))
        request = w.frame(w.FrameType.READ, np.array(entries, dtype="<u8").tobytes())  # (``w.ENTRY`` rows)
        frame = _Frame(request, np.array(iov, dtype=np.uint64).reshape(-1, 2), batch.total_bytes)
        frames = ((frame,), *(() for _ in range(self.streams - 1)))
        return TcpPrepared(peer, frames, len(batch), batch.total_bytes)

    def _pack_frames(self, src_reg: np.ndarray, src_off: np.ndarray, dst: np.ndarray, size: np.ndarray) -> list[_Frame]:
        """READ frames of at most ``MAX_ENTRIES`` pieces and ``frame_bytes`` (or one longer piece) each."""
        ends = np.cumsum(size)
        out, i = [], 0
        while i < len(size):
            before = int(ends[i - 1]) if i else 0
            j = min(i + w.MAX_ENTRIES, int(np.searchsorted(ends, before + self.frame_bytes, side="right")))
            j = max(j, i + 1)
            request = w.frame(w.FrameType.READ, w.pack_entries(src_reg[i:j], src_off[i:j], size[i:j]))
            d, _, n = coalesce(dst[i:j], np.cumsum(size[i:j]) - size[i:j], size[i:j])
            out.append(_Frame(request, _iov.iovecs(d, n), int(ends[j - 1]) - before))
            i = j
        return out

    def read(self, prepared: TcpPrepared, *, timeout: float) -> None:
        peer = prepared.peer
        deadline = time.monotonic() + timeout
        with peer_lock("tcp", peer, timeout):
            jobs = [s for s in range(len(prepared.frames)) if prepared.frames[s]]
            futures = (
                [peer.pool.submit(self._run_stream, peer, s, prepared.frames[s], deadline) for s in jobs[:-1]]
                if peer.pool
                else []
            )
            errors: list[BaseException] = []
            if jobs:
                try:
                    self._run_stream(peer, jobs[-1], prepared.frames[jobs[-1]], deadline)
                except BaseException as e:  # noqa: BLE001 - collected and re-raised below
                    errors.append(e)
            for f in futures:
                try:
                    f.result(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)
            if errors:
                for e in errors:
                    if isinstance(e, AuthError):
                        raise e
                for e in errors:
                    if isinstance(e, TransportError):
                        raise e
                raise TransportError(f"tcp: read from peer {peer.label} failed: {errors[0]!r}") from errors[0]

    def _run_stream(self, peer: TcpPeer, s: int, frames: Sequence[_Frame], deadline: float) -> None:
        """Sends the READ frames of stream ``s``, ``window`` ahead, and receives each DATA in place."""
        sock = peer.socks[s]
        try:
            if sock is None:  # broken by an earlier error: reconnect within this read's deadline
                sock = peer.socks[s] = self._open_stream(peer, deadline)
            sent = 0
            for k, fr in enumerate(frames):
                while sent < len(frames) and sent < k + self.window:
                    sock.settimeout(time_left(deadline, "tcp", peer.label, "send"))
                    sock.sendall(frames[sent].request)
                    sent += 1
                sock.settimeout(time_left(deadline, "tcp", peer.label, "read"))
                kind, payload = w.recv_frame(sock, (w.FrameType.DATA, w.FrameType.ERROR))
                if kind is w.FrameType.ERROR:
                    raise TransportError(f"tcp: peer {peer.label} refused a read: {payload.decode(errors='replace')}")
                got = int.from_bytes(payload, "little")
                if got != fr.nbytes:
                    raise w.ProtocolError(f"peer {peer.label} sent DATA of {got} bytes for a READ of {fr.nbytes}")
                _iov.recv_iov(sock, fr.iov, lambda: time_left(deadline, "tcp", peer.label, "read"))
        except BaseException as e:
            # The stream's state is unknown (frames in flight): drop it; the next read reconnects.
            peer.socks[s] = None
            if sock is not None:
                sock.close()
            if isinstance(e, TransportError):
                raise
            if isinstance(e, socket.timeout):
                raise TransportError(f"tcp: read from peer {peer.label} timed out") from e
            if isinstance(e, (OSError, ConnectionError)):
                raise TransportError(f"tcp: connection to peer {peer.label} lost: {e!r}") from e
            raise

    def disconnect(self, peer: TcpPeer) -> None:
        with self._lock:
            if peer.closed:
                return
            peer.closed = True
            self._peers.discard(peer)
        for i, sock in enumerate(peer.socks):
            if sock is not None:
                wake(sock)
                sock.close()
                peer.socks[i] = None
        if peer.pool is not None:
            peer.pool.shutdown(wait=True)

    def close(self) -> None:
        if not self._begin_close():
            return
        with self._lock:
            server, self._server = self._server, None
        self._end_serving(list(self._peers), server, list(self._regions.values()), self.frame_timeout)

    def __repr__(self) -> str:
        where = f"{self._server.host}:{self._server.port}" if self._server else "not serving"
        where += ", bind_all" if self.bind_all else ""
        return (
            f"TcpTransport({where}, streams={self.streams}, regions={len(self._regions)}, "
            f"peers={len(self._peers)}, closed={self._closed})"
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
