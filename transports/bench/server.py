"""``wbridge bench transport --serve``: one region of known bytes served on the chosen transports,
behind one authenticated control port.

The server binds only the address it is given (``host``: loopback unless told otherwise) for its
control port and its transports. A client that proves the token (``transports.bench.control``)
gets a hello: the region's size, device and pattern seed, and per transport its endpoint, region
descriptor and constructor options. It may then ask for a raw engine over the same region
(``{"op": "raw", "engine": "nixl"|"mooncake"}``, then ``{"op": "raw-done"}``) or a one-shot iperf3
server (``{"op": "iperf3"}``), and ends with ``{"op": "bye"}``. Clients are served one at a time
(a measurement shares the link with nobody); a client that fails the handshake is refused and
logged, and the server goes on.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any, TextIO

from .. import get
from .._util import token_key
from ..errors import TransportError
from . import control
from .memory import Buffer
from .raw import RawServed, iperf3_server, serve_raw
from .units import human

HANDSHAKE_TIMEOUT = 10.0
SESSION_IDLE = 600.0  # a client silent this long is dropped
SEED = 20250  # the region's pattern


def unspecified(host: str) -> bool:
    """Whether ``host`` is an all-interfaces address (``0.0.0.0``, ``::``), which peers cannot dial."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


class BenchServer:
    """A region served on transports behind a control port; ``close()`` is idempotent.

    - ``host``: the address the control port and the transports bind and advertise.
    - ``port``: the control port (0: any free one; ``port`` tells which).
    - ``token``: the shared secret (non-empty): clients prove it, tcp peers authenticate with it.
    - ``transports``: the transports to serve the region on.
    - ``size``: bytes of the region.
    - ``device``: ``cpu`` or ``cuda:N``, where the region lives.
    - ``options``: per-transport constructor keywords, ``{"tcp": {...}}``.
    - ``log``: where refusals and sessions are reported (stderr by default).
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        transports: list[str],
        size: int,
        *,
        device: str = "cpu",
        options: dict[str, dict] | None = None,
        log: TextIO | None = None,
    ) -> None:
        if not token:
            raise TransportError("bench server: a token is required (clients prove it before they learn anything)")
        if unspecified(host):
            raise TransportError(f"bench server: clients are told its host; {host} is no address to dial")
        self.host, self.key, self.size, self.log = host, token_key(token), size, log or sys.stderr
        self.options = {name: dict((options or {}).get(name, {})) for name in transports}
        self._transports: dict[str, Any] = {}
        self._served: dict[str, dict] = {}
        self._closed = False
        self._lock = threading.Lock()
        self.buffer: Buffer | None = None
        try:
            for name in transports:
                self._transports[name] = get(name)(token=token, host=host, **self.options[name])
            host_buffer = None
            if device == "cpu":
                for t in self._transports.values():  # memory the served transports reach best (local: memfd)
                    host_buffer = t.host_buffer(size)
                    if host_buffer is not None:
                        break
            self.buffer = Buffer(size, device, host_buffer)
            self.buffer.fill_pattern(SEED)
            for name, t in self._transports.items():
                region = t.register(self.buffer.addr, size, device=self.buffer.device)
                self._served[name] = {
                    "endpoint": t.endpoint().hex(),
                    "descriptor": region.descriptor.hex(),
                    "options": self.options[name],
                }
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            try:
                self._listener = socket.create_server((host, port), family=family, backlog=16)
            except OSError as e:
                raise TransportError(f"bench server: cannot listen on {host}:{port}: {e}") from e
        except BaseException:
            self.close()
            raise
        self.port = self._listener.getsockname()[1]

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def hello(self) -> dict:
        """What an authenticated client is told."""
        return {
            "size": self.size,
            "device": self.buffer.device,
            "seed": SEED,
            "transports": self._served,
            "raw": ["nixl", "mooncake", "iperf3"],
        }

    def _say(self, msg: str) -> None:
        print(f"wbridge bench transport: {msg}", file=self.log, flush=True)

    def serve_forever(self) -> None:
        """Serves clients one after another until ``close()`` (or an interrupt)."""
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                raise
            who = f"{addr[0]}:{addr[1]}"
            ch = control.accept(sock, who, self.key, HANDSHAKE_TIMEOUT)
            if ch is None:
                self._say(f"refused a client from {who}: it did not prove the token")
                continue
            self._say(f"client {who} connected")
            try:
                self._session(ch)
            except (TransportError, OSError, ConnectionError) as e:
                self._say(f"client {who}: session ended: {e}")
            finally:
                ch.close()
            self._say(f"client {who} done")

    def _session(self, ch: control.Channel) -> None:
        ch.send(self.hello())
        raw: RawServed | None = None
        iperf: subprocess.Popen | None = None
        try:
            while True:
                msg = ch.recv(SESSION_IDLE)
                op = msg.get("op")
                if op == "bye":
                    ch.send({"ok": True})
                    return
                if op == "raw":
                    if raw is not None:
                        raw.close()
                    try:
                        raw = serve_raw(str(msg.get("engine")), self.buffer, self.host)
                    except (TransportError, ImportError) as e:
                        ch.send({"error": f"raw {msg.get('engine')}: {e}"})
                        continue
                    ch.send({"ok": True, "info": raw.info})
                elif op == "raw-done":
                    if raw is not None:
                        raw.close()
                        raw = None
                    ch.send({"ok": True})
                elif op == "iperf3":
                    _reap(iperf)
                    try:
                        iperf, port = iperf3_server(self.host)
                    except TransportError as e:
                        ch.send({"error": str(e)})
                        continue
                    ch.send({"ok": True, "port": port})
                else:
                    ch.send({"error": f"unknown op {op!r}"})
        finally:
            if raw is not None:
                raw.close()
            _reap(iperf)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        listener = getattr(self, "_listener", None)
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        for t in self._transports.values():
            t.close()
        if self.buffer is not None:
            self.buffer.close()

    def __enter__(self) -> BenchServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        port = getattr(self, "port", None)
        return (
            f"BenchServer({self.host}:{port}, transports={list(self._transports)}, size={self.size}, "
            f"closed={self._closed})"
        )


def _reap(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def announce(server: BenchServer, token_env: str, as_json: bool, out: TextIO) -> None:
    """The one line a client can use: the address, the transports and how to pass the token."""
    connect = f"wbridge bench transport --connect {server.address}"
    env = "" if token_env == "WBRIDGE_TOKEN" else f" --token-env {token_env}"
    if as_json:
        line = {
            "serving": server.address,
            "transports": list(server.options),
            "size": server.size,
            "device": server.buffer.device,
            "token_env": token_env,
            "connect": connect + env,
            "pid": os.getpid(),
        }
        print(json.dumps(line), file=out, flush=True)
    else:
        print(
            f"wbridge bench transport: serving {human(server.size)} ({server.buffer.device}) on "
            f"{','.join(server.options)} at {server.address}; on the client: "
            f"{token_env}=<the same token> {connect}{env}",
            file=out,
            flush=True,
        )
