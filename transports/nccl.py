"""``nccl``: the two-sided fallback. Reads become matched send/recv pairs in a per-pull process group.

Serving side: ``endpoint()`` starts a control listener on ``host`` (never all interfaces by default).
Each connection first runs a mutual HMAC challenge-response with the shared token (the token never
crosses the wire). Then, per connection:

- ``PREPARE`` (once per plan): the reader's batch as ``(region, offset, nbytes)`` entries; the server
  checks every entry against its registered regions and keeps it, or answers ``ERROR``;
- ``PULL`` (every read): the server re-checks that the regions are still registered and answers
  ``READY``; both sides then form a fresh two-rank ``torch.distributed`` process group for this pull
  epoch (gloo for host memory, NCCL for CUDA memory), whose rendezvous store is served *over this
  authenticated connection* (no TCPStore, which would listen on all interfaces). The server sends,
  the reader receives; the reader reports ``END`` and the server answers ``DONE`` or ``ERROR``.

Reads of at least ``direct_bytes`` go as one send/recv each, straight between the registered memory
and the destination; smaller reads are gathered into one packed send on the serving side and
scattered from the packed receive buffer on the reading side (thousands of tiny sends would cost
more than the copies). Every wait is bounded by the read's timeout; the group is torn down after
every pull, so a peer that died mid-pull cannot wedge later pulls. After an error the control
connection is closed; the next ``read`` of the same prepared batch reconnects and re-prepares.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import itertools
import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._util import hex_field, int_field, memory_view, str_field, token_key
from ._wire import recv_exact as _recv_exact
from .base import ReadBatch, Region, Transport, check_batch_bounds, decode_descriptor, encode_descriptor
from .errors import AuthError, TransportError

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - torch is a core dependency
    raise ImportError(f"the nccl transport needs torch.distributed ({e})") from e

_log = logging.getLogger(__name__)
_ids = itertools.count(1)

MAGIC = b"WBNC"
HEADER = struct.Struct("<4sB3xQ")
MAX_PAYLOAD = 64 << 20
NONCE = 32
INSTANCE = 16
#: Wire message types.
HELLO, CHALLENGE, AUTH, OK, ERROR, PREPARE, RELEASE, PULL, READY, STORE, END, DONE = range(1, 13)
ENTRY = np.dtype([("region", "<i8"), ("offset", "<i8"), ("nbytes", "<i8")])


# -- framing and authentication ---------------------------------------------------------------
def _send(sock: socket.socket, kind: int, payload: dict | None = None, raw: bytes = b"") -> None:
    body = json.dumps(payload or {}, separators=(",", ":")).encode()
    sock.sendall(HEADER.pack(MAGIC, kind, 4 + len(body) + len(raw)) + struct.pack("<I", len(body)) + body + raw)


def _recv(sock: socket.socket, expect: Sequence[int] | None = None) -> tuple[int, dict, bytes]:
    magic, kind, length = HEADER.unpack(_recv_exact(sock, HEADER.size))
    if magic != MAGIC or length > MAX_PAYLOAD or length < 4:
        raise ConnectionError(f"malformed frame (magic {magic!r}, {length} bytes)")
    data = _recv_exact(sock, length)
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


def _mac(key: bytes, role: bytes, instance: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, b"wbridge-nccl-v1\0" + role + b"\0" + instance + first + second, hashlib.sha256).digest()


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: Any) -> bytes:
    if not isinstance(s, str):
        raise ConnectionError("malformed frame (expected base64 text)")
    return base64.b64decode(s, validate=True)


# -- memory as tensors and the per-epoch process group -----------------------------------------
class _CudaMemory:
    """Exposes ``nbytes`` of device memory at ``addr`` to ``torch.as_tensor`` (no copy)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def _tensor(addr: int, nbytes: int, device: str) -> torch.Tensor:
    if device == "cpu":
        return torch.frombuffer(memory_view(addr, nbytes), dtype=torch.uint8)
    return torch.as_tensor(_CudaMemory(addr, nbytes), device=device)


def _backend(devices: Sequence[str], who: str) -> str:
    kinds = {"cuda" if d.startswith("cuda") else d for d in devices}
    if kinds <= {"cpu"}:
        return "gloo"
    if kinds == {"cuda"}:
        return "nccl"
    raise TransportError(f"nccl: {who} mixes host and CUDA memory ({sorted(set(devices))}); stage into one kind")


def _check_device(device: str) -> None:
    if device == "cpu":
        return
    if device.startswith("cuda:") and device[5:].isdigit():
        return
    raise TransportError(f"nccl: unsupported device {device!r} (cpu or cuda:N)")


def _make_group(store: Any, rank: int, backend: str, host: str, timeout: float, device: str) -> Any:
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


def _destroy(pg: Any) -> None:
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


def _post(pg: Any, backend: str, device: str, tensors: list, peer: int, send: bool) -> list:
    """Posts one send (or recv) per tensor, tag = position: the batch_isend_irecv of a bare group."""
    op = pg.send if send else pg.recv
    if backend == "nccl" and hasattr(pg, "_start_coalescing"):
        dev = torch.device(device)
        pg._start_coalescing(dev)
        for i, t in enumerate(tensors):
            op([t], peer, i)
        return [pg._end_coalescing(dev)]
    return [op([t], peer, i) for i, t in enumerate(tensors)]


def _wait(works: list, deadline: float, what: str) -> None:
    for w in works:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(f"nccl: {what} timed out")
        try:
            w.wait(datetime.timedelta(seconds=left))
        except RuntimeError as e:
            raise TransportError(f"nccl: {what} failed: {e}") from e


class _SocketStore(dist.Store):
    """The reader's rendezvous store: every call is answered by the serving side over the connection."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def _call(self, op: str, **kw: Any) -> dict:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TransportError("nccl: rendezvous timed out")
        self._sock.settimeout(left)
        _send(self._sock, STORE, {"op": op, **kw})
        kind, payload, _ = _recv(self._sock, (OK,))
        if kind == ERROR:
            raise TransportError(f"nccl: rendezvous store: {payload.get('message')}")
        return payload

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key=key, value=_b64(bytes(value)))

    def get(self, key: str) -> bytes:
        return _unb64(self._call("get", key=key)["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key=key, amount=int(amount))["value"])

    def check(self, keys: list) -> bool:
        return bool(self._call("check", keys=[k for k in keys])["value"])

    def wait(self, keys: list, timeout: Any = None) -> None:
        self._call("wait", keys=[k for k in keys])

    def set_timeout(self, timeout: Any) -> None:
        pass


class _EpochStore(dist.Store):
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


def _split(nbytes: np.ndarray, direct: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the reads sent on their own and of those packed together (same rule on both sides)."""
    big = nbytes >= direct
    return np.flatnonzero(big), np.flatnonzero(~big)


# -- serving side -------------------------------------------------------------------------------
@dataclass(eq=False)
class _Served:
    tensor: Any
    nbytes: int
    device: str
    users: int = 0


@dataclass(eq=False)
class _Plan:
    """A reader's prepared batch, as the serving side keeps it."""

    region: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    direct: int


class _Server:
    """Control listener plus one thread per authenticated connection."""

    def __init__(self, owner: NcclTransport, host: str) -> None:
        self.owner = owner
        self.listener = socket.create_server((host, 0))
        self.host, self.port = self.listener.getsockname()[:2]
        self.instance = os.urandom(INSTANCE)
        self.conns: dict[socket.socket, threading.Thread] = {}
        self.lock = threading.Lock()
        self.stopping = False
        self.thread = threading.Thread(target=self._accept, name="wbridge-nccl-accept", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                if self.stopping:
                    conn.close()
                    return
                t = threading.Thread(target=self._run, args=(conn,), name="wbridge-nccl-conn", daemon=True)
                self.conns[conn] = t
            t.start()

    def _run(self, conn: socket.socket) -> None:
        try:
            if self._handshake(conn):
                self._loop(conn)
        except (OSError, ConnectionError, ValueError, TransportError) as e:
            _log.debug("nccl: connection ended: %r", e)
        finally:
            conn.close()
            with self.lock:
                self.conns.pop(conn, None)

    def _handshake(self, conn: socket.socket) -> bool:
        conn.settimeout(self.owner.handshake_timeout)
        _, hello, _ = _recv(conn, (HELLO,))
        client_nonce = _unb64(hello.get("nonce"))
        nonce = os.urandom(NONCE)
        key = self.owner._key
        _send(
            conn,
            CHALLENGE,
            {"nonce": _b64(nonce), "proof": _b64(_mac(key, b"server", self.instance, client_nonce, nonce))},
        )
        _, auth, _ = _recv(conn, (AUTH,))
        if not hmac.compare_digest(_unb64(auth.get("proof")), _mac(key, b"client", self.instance, nonce, client_nonce)):
            _send(conn, ERROR, {"message": "authentication failed"})
            return False
        _send(conn, OK)
        conn.settimeout(None)
        return True

    def _loop(self, conn: socket.socket) -> None:
        plans: dict[int, _Plan] = {}
        while True:
            kind, msg, raw = _recv(conn, (PREPARE, RELEASE, PULL))
            if kind == PREPARE:
                try:
                    plans[int(msg["id"])] = self._plan(msg, raw)
                    _send(conn, OK)
                except TransportError as e:
                    _send(conn, ERROR, {"message": str(e)})
            elif kind == RELEASE:
                plans.pop(int(msg.get("id", -1)), None)
            elif kind == PULL:
                plan = plans.get(int(msg.get("id", -1)))
                if plan is None:
                    _send(conn, ERROR, {"message": "unknown prepared batch"})
                    continue
                self._pull(conn, plan, msg)
            else:
                return

    def _plan(self, msg: dict, raw: bytes) -> _Plan:
        if len(raw) % ENTRY.itemsize or not raw:
            raise TransportError("batch entries are malformed")
        e = np.frombuffer(raw, dtype=ENTRY)
        direct = int(msg.get("direct", 0))
        if direct <= 0:
            raise TransportError("direct threshold must be positive")
        table = self.owner._served
        ids = np.unique(e["region"]).tolist()
        missing = [i for i in ids if i not in table]
        if missing:
            raise TransportError(f"regions {missing[:5]} are not served here")
        sizes = np.array([table[int(i)].nbytes for i in e["region"]], dtype=np.int64) if len(e) else np.zeros(0)
        bad = (e["offset"] < 0) | (e["nbytes"] <= 0) | (e["offset"] + e["nbytes"] > sizes)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TransportError(
                f"read {i} (region {int(e['region'][i])} offset {int(e['offset'][i])} nbytes "
                f"{int(e['nbytes'][i])}) falls outside the registered region"
            )
        devices = {table[int(i)].device for i in ids}
        _backend(sorted(devices), "the serving side")
        return _Plan(e["region"].copy(), e["offset"].copy(), e["nbytes"].copy(), direct)

    def _pull(self, conn: socket.socket, plan: _Plan, msg: dict) -> None:
        timeout = min(float(msg.get("timeout", 60.0)), self.owner.max_timeout)
        deadline = time.monotonic() + timeout
        served = self.owner._acquire(np.unique(plan.region).tolist())
        if served is None:
            _send(conn, ERROR, {"message": "a region of this batch was deregistered"})
            return
        try:
            device = next(iter(served.values())).device
            backend = _backend([s.device for s in served.values()], "the serving side")
            store = _EpochStore(deadline)
            result: dict = {}
            worker = threading.Thread(
                target=self._send_epoch,
                name="wbridge-nccl-epoch",
                daemon=True,
                args=(store, plan, served, backend, device, deadline, result),
            )
            _send(conn, READY, {"backend": backend})
            worker.start()
            try:
                ended = self._serve_store(conn, store, deadline)
            finally:
                store.abort.set()
                worker.join(max(0.0, deadline - time.monotonic()) + 5.0)
            error = result.get("error") or (None if not worker.is_alive() else "send did not finish")
            if ended:
                _send(conn, ERROR if error else DONE, {"message": error} if error else {})
            elif error:
                raise TransportError(error)
        finally:
            self.owner._release(served)

    def _serve_store(self, conn: socket.socket, store: Any, deadline: float) -> bool:
        """Answers the reader's store calls until it reports END (True) or the time runs out."""
        while True:
            conn.settimeout(max(0.001, deadline - time.monotonic()) + 5.0)
            kind, msg, _ = _recv(conn, (STORE, END))
            if kind == END:
                conn.settimeout(None)
                return True
            if kind != STORE:
                return False
            try:
                op = msg.get("op")
                if op == "set":
                    store.set(str(msg["key"]), _unb64(msg["value"]))
                    reply: dict = {}
                elif op == "get":
                    reply = {"value": _b64(store.get(str(msg["key"])))}
                elif op == "add":
                    reply = {"value": store.add(str(msg["key"]), int(msg["amount"]))}
                elif op == "check":
                    reply = {"value": store.check([str(k) for k in msg["keys"]])}
                elif op == "wait":
                    store.wait(
                        [str(k) for k in msg["keys"]],
                        datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())),
                    )
                    reply = {}
                else:
                    raise TransportError(f"unknown store call {op!r}")
                _send(conn, OK, reply)
            except (RuntimeError, KeyError, TypeError, ValueError) as e:
                _send(conn, ERROR, {"message": f"store call failed: {e}"})

    def _send_epoch(
        self, store: Any, plan: _Plan, served: dict, backend: str, device: str, deadline: float, result: dict
    ) -> None:
        pg = None
        try:
            pg = _make_group(store, 0, backend, self.host, deadline - time.monotonic(), device)
            direct, packed = _split(plan.nbytes, plan.direct)
            views = [
                served[int(plan.region[i])].tensor[int(plan.offset[i]) : int(plan.offset[i] + plan.nbytes[i])]
                for i in direct
            ]
            if len(packed):
                views.append(
                    torch.cat(
                        [
                            served[int(plan.region[i])].tensor[
                                int(plan.offset[i]) : int(plan.offset[i] + plan.nbytes[i])
                            ]
                            for i in packed
                        ]
                    )
                )
            _wait(_post(pg, backend, device, views, 1, send=True), deadline, "send")
        except BaseException as e:  # noqa: BLE001 - reported to the reader and the log
            result["error"] = f"serving side: {e}"
        finally:
            _destroy(pg)
            del pg

    def close(self, timeout: float) -> None:
        with self.lock:
            self.stopping = True
            conns = dict(self.conns)
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.thread.join(timeout)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in conns.values():
            t.join(timeout)


# -- reading side -------------------------------------------------------------------------------
@dataclass(eq=False)
class NcclPeer:
    host: str
    port: int
    instance: bytes
    sock: socket.socket | None = None
    closed: bool = False
    generation: int = 0  # bumped on every (re)connection: prepared batches live per connection

    @property
    def label(self) -> str:
        return f"{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"NcclPeer({self.label}, connected={self.sock is not None}, closed={self.closed})"


@dataclass(eq=False)
class NcclPrepared:
    peer: NcclPeer
    id: int
    entries: bytes
    direct_views: list
    packed: Any  # receive buffer of the small reads, or None
    scatter: list  # (destination view, start, stop) in the packed buffer
    backend: str
    device: str
    count: int
    nbytes: int
    generation: int = -1  # the peer connection that knows this batch
    released: bool = False

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
    supports_cuda = True

    def __init__(
        self,
        token: bytes | str | None = None,
        host: str = "127.0.0.1",
        *,
        direct_bytes: int = 64 << 10,
        max_timeout: float = 600.0,
        handshake_timeout: float = 10.0,
    ) -> None:
        super().__init__(token=token, host=host)
        if direct_bytes <= 0:
            raise TransportError("nccl: direct_bytes must be positive")
        self._key = token_key(token)
        self.direct_bytes, self.max_timeout, self.handshake_timeout = direct_bytes, max_timeout, handshake_timeout
        self._regions: dict[int, Region] = {}
        self._served: dict[int, _Served] = {}
        self._cond = threading.Condition(self._lock)
        self._server: _Server | None = None
        self._peers: set[NcclPeer] = set()

    @staticmethod
    def usable() -> bool:
        return dist.is_available() and hasattr(dist, "ProcessGroupGloo")

    # -- serving -----------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, *, device: str = "cpu") -> Region:
        _check_device(device)
        if type(addr) is not int or addr <= 0 or type(nbytes) is not int or nbytes <= 0:  # noqa: E721
            raise TransportError(f"nccl: cannot register {nbytes!r} bytes at {addr!r}")
        tensor = _tensor(addr, nbytes, device)
        with self._lock:
            self._check_open()
            rid = next(_ids)
            desc = encode_descriptor("nccl", instance=self._instance().hex(), region=rid, nbytes=nbytes, device=device)
            region = Region(rid, addr, nbytes, device, desc, handle=(self, tensor))
            self._regions[rid] = region
            self._served[rid] = _Served(tensor, nbytes, device)
        return region

    def _instance(self) -> bytes:
        if self._server is None:
            self._server = _Server(self, self.host)
        return self._server.instance

    def deregister(self, region: Region, timeout: float = 60.0) -> None:
        with self._cond:
            if self._regions.pop(region.id, None) is None:
                return
            entry = self._served.pop(region.id)
            end = time.monotonic() + timeout  # a pull sending from the region finishes first
            while entry.users and time.monotonic() < end:
                self._cond.wait(end - time.monotonic())

    def _acquire(self, ids: list) -> dict | None:
        with self._cond:
            if any(int(i) not in self._served for i in ids):
                return None
            out = {int(i): self._served[int(i)] for i in ids}
            for s in out.values():
                s.users += 1
            return out

    def _release(self, served: dict) -> None:
        with self._cond:
            for s in served.values():
                s.users -= 1
            self._cond.notify_all()

    def endpoint(self) -> bytes:
        with self._lock:
            self._check_open()
            instance = self._instance()
            return encode_descriptor("nccl", host=self._server.host, port=self._server.port, instance=instance.hex())

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    @property
    def num_connections(self) -> int:
        return len(self._server.conns) if self._server else 0

    # -- reading -----------------------------------------------------------------------------
    def connect(self, endpoint: bytes, *, timeout: float) -> NcclPeer:
        d = decode_descriptor("nccl", endpoint, ("host", "port", "instance"))
        peer = NcclPeer(
            str_field("nccl", d, "host"),
            int_field("nccl", d, "port", 1, 65535),
            hex_field("nccl", d, "instance", INSTANCE),
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
        try:
            sock = socket.create_connection((peer.host, peer.port), timeout=_left(deadline, peer, "connect"))
        except OSError as e:
            raise TransportError(f"nccl: cannot connect to peer {peer.label}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = os.urandom(NONCE)
            _send(sock, HELLO, {"nonce": _b64(nonce)})
            sock.settimeout(_left(deadline, peer, "authenticate"))
            kind, msg, _ = _recv(sock, (CHALLENGE,))
            if kind == ERROR:
                raise TransportError(f"nccl: peer {peer.label} refused the handshake: {msg.get('message')}")
            server_nonce = _unb64(msg.get("nonce"))
            if not hmac.compare_digest(
                _unb64(msg.get("proof")), _mac(self._key, b"server", peer.instance, nonce, server_nonce)
            ):
                raise AuthError(f"nccl: peer {peer.label} failed to prove the shared token")
            _send(sock, AUTH, {"proof": _b64(_mac(self._key, b"client", peer.instance, server_nonce, nonce))})
            kind, msg, _ = _recv(sock, (OK,))
            if kind == ERROR:
                raise AuthError(f"nccl: peer {peer.label} rejected our token")
            sock.settimeout(None)
        except BaseException as e:
            sock.close()
            if isinstance(e, (OSError, ConnectionError)) and not isinstance(e, TransportError):
                raise TransportError(f"nccl: handshake with peer {peer.label} failed: {e!r}") from e
            raise
        peer.sock = sock
        peer.generation += 1

    def prepare(
        self, peer: NcclPeer, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> NcclPrepared:
        ids, sizes, devices = [], [], []
        for i, desc in enumerate(remote_regions):
            d = decode_descriptor("nccl", desc, ("instance", "region", "nbytes", "device"))
            if hex_field("nccl", d, "instance", INSTANCE) != peer.instance:
                raise TransportError(f"nccl: remote region {i} is not served by peer {peer.label}")
            ids.append(int_field("nccl", d, "region", 1))
            sizes.append(int_field("nccl", d, "nbytes", 1))
            _check_device(str_field("nccl", d, "device"))
            devices.append(d["device"])
        for r in local_regions:
            if not isinstance(r.handle, tuple) or r.handle[0] is not self or r.id not in self._regions:
                raise TransportError(f"nccl: destination region {r.id} is not registered with this transport")
        check_batch_bounds("nccl", batch, sizes, [r.nbytes for r in local_regions], peer.label)
        backend = _backend([r.device for r in local_regions], "the destination")
        used = sorted({devices[i] for i in np.unique(batch.src_region).tolist()}) if len(batch) else []
        if used and _backend(used, f"peer {peer.label}") != backend:
            raise TransportError(f"nccl: peer {peer.label} serves {used} but the destination is {backend} memory")
        device = local_regions[0].device if local_regions else "cpu"
        dst = [r.handle[1] for r in local_regions]
        direct, packed = _split(batch.nbytes, self.direct_bytes)
        dr, do, n = batch.dst_region.tolist(), batch.dst_offset.tolist(), batch.nbytes.tolist()
        direct_views = [dst[dr[i]][do[i] : do[i] + n[i]] for i in direct.tolist()]
        scatter, pos = [], 0
        for i in packed.tolist():
            scatter.append((dst[dr[i]][do[i] : do[i] + n[i]], pos, pos + n[i]))
            pos += n[i]
        buf = torch.empty(pos, dtype=torch.uint8, device=device) if pos else None
        entries = np.empty(len(batch), dtype=ENTRY)
        entries["region"] = np.asarray(ids, dtype=np.int64)[batch.src_region] if len(batch) else []
        entries["offset"], entries["nbytes"] = batch.src_offset, batch.nbytes
        prep = NcclPrepared(
            peer,
            next(_ids),
            entries.tobytes(),
            direct_views,
            buf,
            scatter,
            backend,
            device,
            len(batch),
            batch.total_bytes,
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
            peer.sock.settimeout(_left(deadline, peer, "prepare"))
            _send(peer.sock, PREPARE, {"id": prep.id, "direct": self.direct_bytes}, prep.entries)
            kind, msg, _ = _recv(peer.sock, (OK,))
            peer.sock.settimeout(None)
        except (OSError, ConnectionError) as e:
            self._drop(peer)
            raise TransportError(f"nccl: peer {peer.label} lost while preparing: {e!r}") from e
        if kind == ERROR:
            raise TransportError(f"nccl: peer {peer.label} refused the batch: {msg.get('message')}")
        prep.generation = peer.generation

    def read(self, prepared: NcclPrepared, *, timeout: float) -> None:
        peer = prepared.peer
        deadline = time.monotonic() + timeout
        self._check_open()
        if prepared.released or peer.closed:
            raise TransportError(f"nccl: read of a released batch or closed peer {peer.label}")
        if prepared.count == 0:
            return
        if peer.sock is None or prepared.generation != peer.generation:
            self._prepare_remote(prepared, deadline)
        sock = peer.sock
        pg = None
        try:
            sock.settimeout(_left(deadline, peer, "pull"))
            epoch = uuid.uuid4().hex
            _send(sock, PULL, {"id": prepared.id, "timeout": timeout, "epoch": epoch})
            kind, msg, _ = _recv(sock, (READY,))
            if kind == ERROR:
                raise TransportError(f"nccl: peer {peer.label} refused the pull: {msg.get('message')}")
            store = _SocketStore(sock, deadline)
            pg = _make_group(store, 1, prepared.backend, self.host, _left(deadline, peer, "pull"), prepared.device)
            bufs = prepared.direct_views + ([prepared.packed] if prepared.packed is not None else [])
            _wait(
                _post(pg, prepared.backend, prepared.device, bufs, 0, send=False),
                deadline,
                f"pull from peer {peer.label}",
            )
            for view, a, b in prepared.scatter:
                view.copy_(prepared.packed[a:b])
            sock.settimeout(_left(deadline, peer, "pull"))
            _send(sock, END, {"ok": True})
            kind, msg, _ = _recv(sock, (DONE,))
            sock.settimeout(None)
            if kind == ERROR:
                raise TransportError(f"nccl: peer {peer.label} reports: {msg.get('message')}")
        except (OSError, ConnectionError, RuntimeError, TransportError) as e:
            self._drop(peer)  # the connection's state is unknown now: the next read starts afresh
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"nccl: pull from peer {peer.label} failed: {e!r}") from e
        finally:
            _destroy(pg)
            del pg

    def _drop(self, peer: NcclPeer) -> None:
        sock, peer.sock = peer.sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def release(self, prepared: NcclPrepared) -> None:
        if prepared.released:
            return
        prepared.released = True
        sock = prepared.peer.sock
        if sock is not None and prepared.generation == prepared.peer.generation:
            try:
                _send(sock, RELEASE, {"id": prepared.id})
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
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, server = list(self._peers), self._server
            self._server = None
        for p in peers:
            self.disconnect(p)
        if server is not None:
            server.close(self.max_timeout)
        for region in list(self._regions.values()):
            self.deregister(region)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("nccl: transport is closed")

    def __repr__(self) -> str:
        where = f"{self._server.host}:{self._server.port}" if self._server else "not serving"
        return f"NcclTransport({where}, regions={len(self._regions)}, peers={len(self._peers)}, closed={self._closed})"


def _left(deadline: float, peer: NcclPeer, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransportError(f"nccl: {what} with peer {peer.label} timed out")
    return left
