"""The ``nccl`` transport's serving side: the control listener and one thread per authenticated
connection, which keeps the reader's prepared batches and sends them on every pull."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _auth
from . import _nccl_group as g
from . import _nccl_proto as p
from ._regions import RegionTable
from ._util import wake
from .errors import TransportError

_log = logging.getLogger("transports.nccl")


@dataclass(eq=False)
class Plan:
    """A reader's prepared batch, as the serving side keeps it."""

    ids: np.ndarray  # the regions it reads, unique
    index: np.ndarray  # per read: its region's position in ``ids``
    offset: np.ndarray
    nbytes: np.ndarray
    direct: int
    direct_views: list = field(default_factory=list, repr=False)  # one tensor per long read
    packed: g.Packed | None = None  # the short reads, gathered into one send buffer every pull


@dataclass(eq=False)
class Group:
    """The process group of one connection, kept across pulls while the reader asks for it by ``id``."""

    id: str = ""
    key: tuple = ()  # (backend, device)
    pg: Any = None
    store: Any = None

    def end(self) -> None:
        g.destroy(self.pg)
        self.pg, self.store, self.id = None, None, ""


@dataclass(frozen=True)
class ServerConfig:
    """What the serving side needs from its transport: token key, regions, host and time limits."""

    key: bytes
    table: RegionTable
    host: str
    handshake_timeout: float
    max_timeout: float


class Server:
    """Control listener plus one thread per authenticated connection."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.listener = socket.create_server((cfg.host, 0))
        self.host, self.port = self.listener.getsockname()[:2]
        self.instance = os.urandom(p.INSTANCE)
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
        except (OSError, ConnectionError, ValueError, TypeError, KeyError, OverflowError, TransportError) as e:
            _log.debug("nccl: connection ended: %r", e)  # a malformed message ends its connection only
        except Exception:  # noqa: BLE001 - whatever a peer sends costs its connection, never the server
            _log.exception("nccl: internal error serving a connection")
        finally:
            conn.close()
            with self.lock:
                self.conns.pop(conn, None)

    def _handshake(self, conn: socket.socket) -> bool:
        conn.settimeout(self.cfg.handshake_timeout)
        send, recv = p.handshake_io(conn)
        if not _auth.server_handshake(send, recv, self.cfg.key, p.LABEL, self.instance):
            return False
        conn.settimeout(None)
        return True

    def _loop(self, conn: socket.socket) -> None:
        plans: dict[int, Plan] = {}
        group = Group()
        try:
            self._serve_requests(conn, plans, group)
        finally:
            group.end()

    def _serve_requests(self, conn: socket.socket, plans: dict[int, Plan], group: Group) -> None:
        while True:
            kind, msg, raw = p.recv(conn, (p.PREPARE, p.RELEASE, p.PULL))
            if kind == p.PREPARE:
                try:
                    plans[int(msg["id"])] = self._plan(msg, raw)
                    p.send(conn, p.OK)
                except TransportError as e:
                    p.send(conn, p.ERROR, {"message": str(e)})
            elif kind == p.RELEASE:
                plans.pop(int(msg.get("id", -1)), None)
            elif kind == p.PULL:
                plan = plans.get(int(msg.get("id", -1)))
                if plan is None:
                    p.send(conn, p.ERROR, {"message": "unknown prepared batch"})
                    continue
                self._pull(conn, plan, msg, group)
            else:
                return

    def _plan(self, msg: dict, raw: bytes) -> Plan:
        if len(raw) % p.ENTRY.itemsize or not raw:
            raise TransportError("batch entries are malformed")
        e = np.frombuffer(raw, dtype=p.ENTRY)
        direct = int(msg.get("direct", 0))
        if direct <= 0:
            raise TransportError("direct threshold must be positive")
        ids, index = np.unique(e["region"], return_inverse=True)
        entries, why = self.cfg.table.acquire(ids)
        if entries is None:
            raise TransportError(f"not served here: {why}")
        self.cfg.table.release(entries)
        sizes = np.array([x.nbytes for x in entries], dtype=np.int64)[index]
        off, n = e["offset"], e["nbytes"]
        # Overflow-safe: never offset + nbytes (it wraps past 2**63); a wrapped difference only
        # arises where the offset is already refused as negative.
        bad = (off < 0) | (n <= 0) | (off > sizes) | (n > sizes - off)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TransportError(
                f"read {i} (region {int(e['region'][i])} offset {int(e['offset'][i])} nbytes "
                f"{int(e['nbytes'][i])}) falls outside the registered region"
            )
        g.backend_for(sorted({x.device for x in entries}), "the serving side")
        plan = Plan(ids, index, e["offset"].copy(), e["nbytes"].copy(), direct)
        # Region ids are never reused, and every pull re-acquires them: what is built here stays valid.
        long, short = g.split(plan.nbytes, direct)
        off, n = plan.offset, plan.nbytes
        plan.direct_views = [entries[int(index[i])].handle[int(off[i]) : int(off[i] + n[i])] for i in long]
        tensors, addrs = [x.handle for x in entries], [x.addr for x in entries]
        plan.packed = g.packed(tensors, addrs, entries[0].device, index[short], off[short], n[short], gather=True)
        return plan

    def _pull(self, conn: socket.socket, plan: Plan, msg: dict, group: Group) -> None:
        asked = float(msg.get("timeout", 60.0))
        if not asked > 0:  # (NaN too)
            p.send(conn, p.ERROR, {"message": f"pull timeout must be > 0, got {asked}"})
            return
        timeout = min(asked, self.cfg.max_timeout)
        deadline = time.monotonic() + timeout
        served, _ = self.cfg.table.acquire(plan.ids)
        if served is None:
            p.send(conn, p.ERROR, {"message": "a region of this batch was deregistered"})
            return
        try:
            device = served[0].device
            backend = g.backend_for([s.device for s in served], "the serving side")
            wanted = str(msg.get("group", ""))
            fresh = not (group.pg is not None and wanted and group.id == wanted and group.key == (backend, device))
            if fresh:  # the reader has no group with us (first pull, or after an error): form one
                group.end()
                group.id, group.key, group.store = wanted, (backend, device), p.EpochStore(deadline)
            group.store.deadline = deadline
            group.store.abort.clear()
            result: dict = {}
            worker = threading.Thread(
                target=self._send_epoch,
                name="wbridge-nccl-epoch",
                daemon=True,
                args=(group, fresh, plan, deadline, result),
            )
            p.send(conn, p.READY, {"backend": backend, "new": fresh})
            worker.start()
            try:
                ended = self._serve_store(conn, group.store, deadline)
            finally:
                group.store.abort.set()
                worker.join(max(0.0, deadline - time.monotonic()) + 5.0)
            error = result.get("error") or (None if not worker.is_alive() else "send did not finish")
            if error:
                group.end()  # its state is unknown: the next pull forms a new one
            if ended:
                p.send(conn, p.ERROR if error else p.DONE, {"message": error} if error else {})
            elif error:
                raise TransportError(error)
        finally:
            self.cfg.table.release(served)

    def _serve_store(self, conn: socket.socket, store: Any, deadline: float) -> bool:
        """Answers the reader's store calls until it reports END (True) or the time runs out."""
        while True:
            conn.settimeout(max(0.001, deadline - time.monotonic()) + 5.0)
            kind, msg, _ = p.recv(conn, (p.STORE, p.END))
            if kind == p.END:
                conn.settimeout(None)
                return True
            if kind != p.STORE:
                return False
            try:
                op = msg.get("op")
                if op == "set":
                    store.set(str(msg["key"]), p.unb64(msg["value"]))
                    reply: dict = {}
                elif op == "get":
                    reply = {"value": p.b64(store.get(str(msg["key"])))}
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
                p.send(conn, p.OK, reply)
            except (RuntimeError, KeyError, TypeError, ValueError) as e:
                p.send(conn, p.ERROR, {"message": f"store call failed: {e}"})

    def _send_epoch(self, group: Group, fresh: bool, plan: Plan, deadline: float, result: dict) -> None:
        try:
            backend, device = group.key
            if fresh:
                group.pg = g.make_group(group.store, 0, backend, self.host, self.cfg.max_timeout, device)
            views = list(plan.direct_views)
            if plan.packed is not None:
                plan.packed.run()
                views.append(plan.packed.buffer)
            g.wait(g.post(group.pg, backend, device, views, 1, send=True), deadline, "send")
        except BaseException as e:  # noqa: BLE001 - reported to the reader and the log
            result["error"] = f"serving side: {e}"

    def close(self, timeout: float) -> None:
        with self.lock:
            self.stopping = True
            conns = dict(self.conns)
        wake(self.listener)
        self.listener.close()
        self.thread.join(timeout)
        for c in conns:
            wake(c)
        for t in conns.values():
            t.join(timeout)
