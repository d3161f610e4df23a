"""``tcp://host:port``: torch's TCPStore, the embedded default, hosted by one publisher."""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from .. import _validate
from ..errors import StoreError, UsageError, WaitTimeout
from .base import DEFAULT_CONNECT_TIMEOUT, Lease, Store

# A value no caller writes: TcpStore.get's marker for "absent".
_ABSENT = b"\0wbridge-absent:" + os.urandom(16)


# How long a multi_get may wait for its keys: ``get_many`` checks first that they all exist, so this
# bounds only the race with a concurrent delete (then it reads them one by one).
_MULTI_GET_GUARD = datetime.timedelta(seconds=2)

# TCPStore's wire protocol for one WAIT (torch/csrc/distributed/c10d/TCPStoreBackend.hpp; TCPStore.cpp
# ``doWait``): the query byte, the number of keys, then each key (TCPStore's "/" prefix and the
# name) as a native uint64 length and its bytes; the server answers one byte once every key exists.
# CANCEL_WAIT withdraws a pending WAIT and is always answered WAIT_CANCELED (after STOP_WAITING
# where the key came first).
_WAIT, _CANCEL_WAIT = 6, 12
_STOP_WAITING, _WAIT_CANCELED = 0, 1

# One TCPStore connection at a time in this process, so that its new socket can be told apart:
# every socket this module opens to a store port (a TCPStore client's, a probe's) is opened and, for
# a probe, closed again under it. (A probe open while another thread connected was once taken for
# that thread's client: its calls then went to a connection the server never validated, and its
# waits missed the keys they waited for.)
_CONNECT_LOCK = threading.Lock()


def _probe(host: str, port: int, timeout: float, settle: float = 0.0) -> None:
    """Opens and closes one TCP connection to ``host:port`` (raises ``OSError`` where none can be
    made), under ``_CONNECT_LOCK``. With ``settle``, the connection must also stay open that long:
    the kernel completes a connection to a listening socket whose process is ending (killed, its
    sockets closing one by one) and resets it once the listener closes (``ConnectionResetError``)."""
    if not _CONNECT_LOCK.acquire(timeout=max(timeout, 0.01)):
        raise TimeoutError(f"another connect to a store held this process for {timeout:.1f}s")
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            if settle > 0:
                s.settimeout(settle)
                try:
                    got = s.recv(1)  # (a store answers nothing before the client speaks)
                except TimeoutError:
                    return
                if not got:
                    raise ConnectionResetError(errno.ECONNRESET, "accepted, then closed")
    finally:
        _CONNECT_LOCK.release()


class _Ambiguous(RuntimeError):
    """A new TCPStore client whose socket could not be told apart from another new one that also
    received data (the connect is made again)."""


def _socket_inodes() -> dict[str, int]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found[link] = int(fd)
    return found


def _bounded_tcpstore(make: Callable[[], object], port: int, timeout: float) -> tuple[object, list[socket.socket]]:
    """``make()`` builds a TCPStore within ``timeout``; its client socket to ``port`` then gets send
    and receive timeouts.

    torch's client sets none for most calls, so on a dead link they would block forever; with them a
    stuck call fails with torch's "Socket Timeout" (a RuntimeError). Its handshake ignores the
    timeout it is given: a hung server (stopped, its kernel still accepting) held a reconnect for
    minutes, so ``make()`` runs on a thread of its own and, past ``timeout``, its new sockets are
    shut down under it (the handshake then fails at once). Sockets are matched by inode, not fd
    number, because fd numbers are reused. Where another part of the process opened a connection to
    the port meanwhile (a health probe), the client's socket is the new one that has received data.
    """
    if not _CONNECT_LOCK.acquire(timeout=max(timeout, 0.01)):
        raise StoreError(f"store port {port}: another connect held this process for {timeout:.1f}s")
    try:
        before = _socket_inodes()
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["store"] = make()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e

        maker = threading.Thread(target=run, name=f"wbridge-connect:{port}", daemon=True)
        maker.start()
        maker.join(max(timeout, 0.01))
        if maker.is_alive():  # a hung handshake: cut it short
            for s in _new_sockets(before, port):
                with _quiet_os():
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            maker.join(5.0)
            raise StoreError(f"store port {port}: no answer to the connect handshake within {timeout:.1f}s")
        if "error" in box:
            raise box["error"]
        store = box["store"]
        socks = _new_sockets(before, port)
        if len(socks) > 1:  # others opened beside it: the client's is the one its handshake spoke on
            quiet = [s for s in socks if not _answered(s)]
            socks = [s for s in socks if s not in quiet]
            for s in quiet:
                s.close()  # (duplicates)
    finally:
        _CONNECT_LOCK.release()
    if len(socks) != 1:
        for s in socks:
            s.close()
        del store  # its own socket closes with it
        raise _Ambiguous(
            f"cannot tell the TCPStore client socket to port {port} apart: {len(socks)} new sockets to that "
            f"port that received data (another part of this process spoke to the store at the same moment)"
        )
    for s in socks:
        _set_timeouts(s, timeout)
    # keep the dups: setting their timeouts later bounds a single call by a caller's deadline
    return store, socks


def _new_sockets(before: dict[str, int], port: int) -> list[socket.socket]:
    """Duplicates of the TCP sockets to ``port`` opened since ``before`` (``_socket_inodes``)."""
    after = _socket_inodes()
    socks = []
    for inode in after.keys() - before.keys():
        try:
            s = socket.socket(fileno=os.dup(after[inode]))
        except OSError:
            continue
        try:
            if (
                s.family in (socket.AF_INET, socket.AF_INET6)
                and s.type == socket.SOCK_STREAM
                and s.getpeername()[1] == port
            ):
                socks.append(s)
                continue
        except OSError:
            pass
        s.close()
    return socks


# ``struct tcp_info`` (linux/tcp.h): ``tcpi_bytes_received``, a u64 at this offset (Linux 4.1 and later).
_TCPI_BYTES_RECEIVED = 128


def _answered(s: socket.socket) -> bool:
    """Whether ``s`` has received any data, or the kernel cannot say. A TCPStore client has: its
    constructor's last step is a ping the server answers. A connection that was only opened (a health
    probe) has not."""
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BYTES_RECEIVED + 8)
    except OSError:
        return True
    if len(info) < _TCPI_BYTES_RECEIVED + 8:
        return True
    return struct.unpack_from("Q", info, _TCPI_BYTES_RECEIVED)[0] > 0


@contextlib.contextmanager
def _quiet_os() -> Iterator[None]:
    try:
        yield
    except OSError:
        pass


# What torch's client says when the other end went away, and how to put it in words.
_LOST = (
    ("got 0 bytes", "closed"),
    ("connection was likely closed", "closed"),
    ("reset by peer", "reset"),
    ("broken pipe", "closed"),
    ("connection refused", "refused"),
)


def _lost(error: BaseException) -> str | None:
    """``"closed"``, ``"reset"`` or ``"refused"`` when ``error`` says the connection to the store was
    lost, else None."""
    if isinstance(error, ConnectionRefusedError):
        return "refused"
    if isinstance(error, ConnectionResetError):
        return "reset"
    text = str(error).lower()
    return next((how for marker, how in _LOST if marker in text), None)


_CHECK = (
    "the process that hosts the store (the publisher rank with host_store=True, or `wbridge store serve`) "
    "has not started, has exited or crashed, or cannot be reached; check that process's own error and log, "
    "and the network to"
)


def _gone(url: str, host: str, port: int, how: str) -> str:
    """The message for a store whose connection was lost (``how``): a probe tells whether the host
    still accepts connections, and the message says what to check either way."""
    try:
        _probe(host, port, 1.0, settle=0.25)  # (a store host being killed still completes connections)
    except OSError as e:
        probe = "refused" if isinstance(e, ConnectionRefusedError) else (e.strerror or type(e).__name__)
        return f"store host {url} is gone (connection {how}; a new connection: {probe}): {_CHECK} {host}:{port}"
    return (
        f"store {url} dropped this client's connection (connection {how}), although it accepts new ones: "
        f"if the store's process restarted, the next call joins the new store; else check the network to "
        f"{host}:{port}"
    )


def _answer(sock: socket.socket) -> int:
    """One answer byte of the store (its receive bounded by the socket's timeout)."""
    got = sock.recv(1)
    if not got:
        raise ConnectionError("the store closed the connection: got 0 bytes")
    return got[0]


def _set_timeouts(s: socket.socket, seconds: float) -> None:
    seconds = max(seconds, 0.01)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class TcpStore(Store):
    """``torch.distributed.TCPStore``. The host binds only ``host`` (never all interfaces)."""

    def __init__(
        self, host: str, port: int, *, is_host: bool, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    ) -> None:
        import torch.distributed as dist

        _validate.boolean(is_host, "TcpStore(is_host)")
        if not isinstance(host, str) or not host:
            raise UsageError(f"TcpStore(host) must be an address or host name, got {host!r:.80}")
        if is_host:
            _validate.host(host, "TcpStore (hosted here)")
        port = _validate.integer(port, "TcpStore(port)")
        if port > 65535:
            raise UsageError(f"TcpStore(port) must be in 0..65535, got {port}")
        connect_timeout = _validate.timeout(connect_timeout, "connect_timeout", positive=True)
        self.host, self.port, self.is_host = host, port, is_host
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[bytes | None, float]] = {}
        self._closed = False
        self._listen: socket.socket | None = None
        self._connect_timeout = connect_timeout
        self._socks: list[socket.socket] = []
        self._server: object | None = None  # the host's TCPStore server (with a client never used)
        self._server_socks: list[socket.socket] = []
        self._waiters: list[TcpStore] = []  # idle connections for blocking waits, one per waiting thread
        td = datetime.timedelta(seconds=connect_timeout)
        try:
            if is_host:
                # torch's server binds every interface; hand it a socket bound to `host` instead.
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                self._listen = sock
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, self.port))
                sock.listen(1024)
                self.port = sock.getsockname()[1]
                # The server's own client is never used for calls: a call that fails must drop its
                # connection (a late reply would answer the next request), and dropping the
                # server's would stop the store. Calls go through a client like everyone's.
                self._server, self._server_socks = _bounded_tcpstore(
                    lambda: dist.TCPStore(
                        host,
                        self.port,
                        None,
                        True,
                        timeout=td,
                        wait_for_workers=False,
                        master_listen_fd=sock.fileno(),
                        use_libuv=True,
                    ),
                    self.port,
                    connect_timeout,
                )
                # torch now owns the fd and closes it with the store; closing it again here could
                # close an unrelated file that reused the number.
                sock.detach()
                self._listen = None
                self._store, self._socks = self._connect(host, self.port, connect_timeout)
            else:
                self._store, self._socks = self._connect(host, self.port, connect_timeout)
        except (RuntimeError, OSError) as e:
            if self._listen is not None:
                self._listen.close()
                self._listen = None
            raise StoreError(f"cannot {'host' if is_host else 'reach'} store tcp://{host}:{port}: {e}") from e
        self.url = f"tcp://{host}:{self.port}"
        self._timeout = td

    @staticmethod
    def _connect(host: str, port: int, timeout: float):
        import torch.distributed as dist

        # TCPStore retries connecting until its timeout; probe first so a dead address fails fast
        # with a clear message instead of torch's retry log.
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                _probe(host, port, min(2.0, timeout))
                left = max(1.0, deadline - time.monotonic())
                return _bounded_tcpstore(
                    lambda left=left: dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=left)),
                    port,
                    timeout,
                )
            except (OSError, RuntimeError) as e:
                last = e
                time.sleep(0.1)
        if last is not None and _lost(last) == "refused":
            raise StoreError(
                f"store tcp://{host}:{port} unreachable after {timeout:.1f}s (connection refused: nothing listens "
                f"there): {_CHECK} {host}:{port}"
            ) from last
        raise StoreError(f"store tcp://{host}:{port} unreachable after {timeout:.1f}s: {last}") from last

    def _call(self, fn: Callable):
        """``fn(torch_store)``; its socket's timeouts bound it (by the caller's ``deadline()`` when one
        is set). A client whose call failed is dropped (a late reply would be read as the answer to
        the next request) and the next call reconnects, the host's like any other (its server stays)."""
        limit = self._connect_timeout
        deadline = self.caller_deadline()
        if deadline is not None:
            limit = min(limit, deadline - time.monotonic())
            if limit <= 0:
                raise WaitTimeout(f"store {self.url}: the caller's deadline passed")
        if not self._lock.acquire(timeout=limit):
            raise StoreError(f"store {self.url}: busy for {limit:.1f}s")
        try:
            if self._closed:
                raise StoreError(f"store {self.url} is closed")
            if self._store is None:
                self._store, self._socks = self._connect(self.host, self.port, limit)
            tight = limit < self._connect_timeout  # (else the sockets' timeouts are already that)
            if tight:
                for s in self._socks:
                    _set_timeouts(s, limit)
            try:
                return fn(self._store)
            except (RuntimeError, OSError, ValueError) as e:
                self._drop_client()
                said = str(e).splitlines()[0] if str(e) else repr(e)
                how = _lost(e)
                if how is not None:
                    raise StoreError(f"{_gone(self.url, self.host, self.port, how)} (torch: {said})") from e
                unknown = " (the call may or may not have been applied)" if "Timeout" in str(e) else ""
                raise StoreError(f"store {self.url}: {said}{unknown}") from e
            finally:
                if tight and self._store is not None:
                    for s in self._socks:
                        _set_timeouts(s, self._connect_timeout)
        finally:
            self._lock.release()

    def _drop_client(self) -> None:
        self._store = None
        for s in self._socks:
            s.close()
        self._socks = []

    def get(self, key: str) -> bytes | None:
        # One atomic round trip: compare_set(k, S, S) returns S when k is absent and k's value
        # otherwise. (check() then get() raced with delete and read a deleted key as b"".)
        def op(st):
            value = st.compare_set(key, _ABSENT, _ABSENT)
            return None if value == _ABSENT else value

        return self._call(op)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        # CHECK then MULTI_GET: torch's multi_get waits for missing keys, so it runs only when all
        # exist; a key deleted in between ends its wait at the guard (a clean cancel that keeps the
        # connection), and then, as when some key is absent, the keys are read one by one.
        keys = list(keys)
        if not keys:
            return []

        def op(st):
            if not st.check(keys):
                return None
            st.set_timeout(_MULTI_GET_GUARD)
            try:
                return [bytes(v) for v in st.multi_get(keys)]
            except RuntimeError as e:
                if str(e).startswith("wait timeout"):
                    return None
                raise

        values = self._call(op)
        if values is None:
            return [self.get(k) for k in keys]
        return values

    def wait(self, key: str, timeout: float) -> bytes:
        """Blocks in the server (a TCPStore WAIT) until ``key`` exists, on a connection of its own
        so that other threads' calls are not held up behind it."""
        deadline = time.monotonic() + timeout
        at = self.caller_deadline()
        if at is not None:
            deadline = min(deadline, at)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"timed out after {timeout:.1f}s waiting for store key {key!r}")
            waiter = self._take_waiter(left)
            try:
                found = waiter.wait_exists(key, left)
            except BaseException:
                waiter.close()
                raise
            self._give_back_waiter(waiter)
            if found:
                value = self.get(key)
                if value is not None:
                    return value  # else deleted again meanwhile: wait on

    def _take_waiter(self, within: float) -> TcpStore:
        """An idle waiting connection, or a new one connected ``within`` seconds."""
        with self._lock:
            if self._closed:
                raise StoreError(f"store {self.url} is closed")
            if self._waiters:
                return self._waiters.pop()
        return self._client(within)

    def _client(self, within: float | None = None) -> TcpStore:
        """Another client connection, connected within ``within`` seconds, the caller's deadline
        and ``connect_timeout``, whichever ends first (its later reconnects: ``connect_timeout``)."""
        limit = self._connect_timeout if within is None else min(within, self._connect_timeout)
        deadline = self.caller_deadline()
        if deadline is not None:
            limit = min(limit, deadline - time.monotonic())
            if limit <= 0:
                raise WaitTimeout(f"store {self.url}: the caller's deadline passed")
        client = TcpStore(self.host, self.port, is_host=False, connect_timeout=limit)
        client._connect_timeout = self._connect_timeout
        return client

    def _give_back_waiter(self, waiter: TcpStore) -> None:
        with self._lock:
            if not self._closed:
                self._waiters.append(waiter)
                return
        waiter.close()

    def wait_exists(self, key: str, timeout: float) -> bool:
        """One TCPStore WAIT for ``key``: True once it exists, False after ``timeout`` (the WAIT is
        then cancelled, so the connection stays usable).

        The WAIT goes out on this connection's socket and its timeout is kept here, by ``poll``:
        torch's ``wait(keys, timeout)`` logs two ``[c10d] waitForInput`` warnings whenever its
        timeout passes, and the waits of an idle channel (a trainer waiting for acks, a watcher for
        the next version) end that way every few seconds. Only waiting connections
        (``_take_waiter``) make this call, so nothing else is in flight on the socket."""
        name = ("/" + key).encode()
        query = struct.pack("=BQQ", _WAIT, 1, len(name)) + name

        def op(_store):
            sock = self._socks[0]
            sock.sendall(query)
            ready = select.poll()
            ready.register(sock, select.POLLIN)
            if ready.poll(max(0, int(timeout * 1000))):
                answer = _answer(sock)
                if answer != _STOP_WAITING:
                    raise ValueError(f"TCPStore answered WAIT with {answer}, not STOP_WAITING")
                return True
            sock.sendall(bytes([_CANCEL_WAIT]))
            answer = _answer(sock)
            if answer == _WAIT_CANCELED:
                return False
            if answer != _STOP_WAITING or _answer(sock) != _WAIT_CANCELED:  # the key came first
                raise ValueError(f"TCPStore answered CANCEL_WAIT with {answer}")
            return True

        with self.deadline(time.monotonic() + timeout + self._connect_timeout):
            return bool(self._call(op))

    def set(self, key: str, value: bytes) -> None:
        # TCPStore's SET gets no reply: it could still be in flight when set() returned, and a read
        # on another connection could overtake it (seen: 2 stale reads in 2000). The server handles
        # one connection's requests in order, so a round trip after it means it has been applied.
        def op(st):
            st.set(key, value)
            st.check([key])

        self._call(op)

    def compare_set(self, key: str, expected: bytes | None, value: bytes) -> bool:
        # TCPStore's compare_set sets when the key is absent and expected is empty.
        def op(st):
            if expected is None:
                if st.check([key]):
                    return False
                return st.compare_set(key, b"", value) == value
            return st.compare_set(key, expected, value) == value

        return bool(self._call(op))

    def add(self, key: str, delta: int) -> int:
        return int(self._call(lambda st: st.add(key, int(delta))))

    def delete(self, key: str) -> None:
        self._call(lambda st: st.delete_key(key))

    def lease(self, key: str, ttl: float) -> Lease:
        # Its own connection: a refresh stuck on a dead link must not hold up this client's calls.
        # It connects within connect_timeout and the caller's deadline;
        # each refresh is bounded by ttl (a later one retries).
        own = self._client()
        own.add(key, 1)

        def refresh() -> None:
            with own.deadline(time.monotonic() + ttl):
                own.add(key, 1)

        def revoke() -> None:
            try:
                own.set(key, b"-1")
            finally:
                own.close()

        return Lease(key, ttl, refresh=refresh, revoke=revoke)

    def judge_alive(self, key: str, value: bytes | None, ttl: float) -> bool:
        # TCPStore has no server-side expiry: a lease is a counter that its holder bumps; it is
        # alive while we see it change within ttl (by our own clock, so no clock skew matters).
        now = time.monotonic()
        if value is None or value == b"-1":
            self._seen.pop(key, None)
            return False
        prev = self._seen.get(key)
        if prev is None or prev[0] != value:
            self._seen[key] = (value, now)
            return True
        return now - prev[1] <= ttl

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
            server, self._server = self._server, None
            socks, self._socks = self._socks + self._server_socks, []
            self._server_socks = []
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.close()
        for sk in socks:
            sk.close()
        del store, server
        if self._listen is not None:
            self._listen.close()
            self._listen = None

    def __repr__(self) -> str:
        return f"TcpStore({self.url!r}, host={self.is_host}, closed={self._closed})"
