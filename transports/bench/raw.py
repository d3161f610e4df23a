"""The engines underneath, with no wbridge code around them (``--against raw``): a NIXL agent's
``READ``, the Mooncake engine's batched reads, and ``iperf3`` for tcp.

Serving side (in the bench server, on a client's request): ``serve_raw(engine, buffer, host)``
registers the served region with a bare engine and returns what a reader needs (``RawServed``);
``iperf3_server(host)`` starts a one-shot ``iperf3 -s`` bound to ``host``.

Reading side: ``RawNixlReader`` and ``RawMooncakeReader`` read the same ops as a wbridge transport's
reader (``transports.bench.reads.Reader``: prepare once, post many), and ``iperf3_client`` sends the
same bytes from the server to the client (``-R``) with the op size (at most 1 MiB) as iperf3's write length.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._host import rdma_devices
from .._util import free_port
from ..errors import TransportError
from .memory import Buffer

#: the raw engine each transport is compared with
ENGINES = {"nixl": "nixl", "mooncake": "mooncake", "tcp": "iperf3"}
IPERF3_MAX_LENGTH = 1 << 20  # iperf3 refuses longer writes
MOONCAKE_BATCH = 512  # reads per engine call (the engine's tcp lanes queue about 1024 per peer)


@dataclass(eq=False)
class RawServed:
    """A served region registered with a bare engine; ``close()`` releases it (idempotent).

    - ``engine``: ``nixl`` or ``mooncake``.
    - ``info``: what a reader needs (JSON: metadata or session, the region's address and memory type).
    - ``handle``: the engine and its registration, kept alive until ``close``.
    """

    engine: str
    info: dict
    handle: Any = field(default=None, repr=False)

    def close(self) -> None:
        if self.handle is None:
            return
        obj, reg = self.handle
        self.handle = None
        if self.engine == "nixl":
            obj.deregister_memory(reg)
        else:
            obj.unregister_memory(reg)


def _mem(device: str) -> tuple[str, int]:
    return ("DRAM", 0) if device == "cpu" else ("VRAM", int(device.partition(":")[2] or 0))


def _mooncake_engine(host: str) -> tuple[Any, str]:
    from mooncake.engine import TransferEngine

    protocol = "rdma" if rdma_devices() else "tcp"
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
        raise TransportError(f"raw mooncake: the engine did not start on {host} ({protocol})")
    return engine, protocol


def serve_raw(engine: str, buf: Buffer, host: str) -> RawServed:
    """Registers ``buf`` with a bare ``engine`` (``nixl`` or ``mooncake``) bound to ``host``."""
    if engine == "nixl":
        from ..nixl import new_agent

        agent, _ = new_agent(f"wbridge-bench-raw-{uuid.uuid4().hex[:8]}", host)
        mem, dev = _mem(buf.device)
        reg = agent.register_memory([(buf.addr, buf.nbytes, dev, "")], mem)
        info = {"md": agent.get_agent_metadata().hex(), "addr": buf.addr, "mem": mem, "dev": dev}
        return RawServed("nixl", info, (agent, reg))
    if engine == "mooncake":
        if buf.device != "cpu":
            raise TransportError("raw mooncake reads host memory only")
        eng, protocol = _mooncake_engine(host)
        if eng.register_memory(buf.addr, buf.nbytes) != 0:
            raise TransportError(f"raw mooncake: the engine refused to register {buf.nbytes} bytes")
        info = {"session": f"{host}:{eng.get_rpc_port()}", "addr": buf.addr, "protocol": protocol}
        return RawServed("mooncake", info, (eng, buf.addr))
    raise TransportError(f"no raw engine {engine!r}; known: nixl, mooncake (and iperf3 for tcp)")


class RawNixlReader:
    """Reads a served region through a bare NIXL agent: one ``READ`` request per prepared batch.

    - ``info``: the server's ``RawServed.info``.
    - ``addr``, ``nbytes``, ``device``: the local memory the reads land in.
    - ``host``: the local address (its interface is the one UCX uses).
    """

    label = "nixl-raw"

    def __init__(self, info: dict, addr: int, nbytes: int, device: str, host: str) -> None:
        logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout
        from ..nixl import new_agent

        self._agent, _ = new_agent(f"wbridge-bench-raw-reader-{uuid.uuid4().hex[:8]}", host)
        self._mem, dev = _mem(device)
        self._base, self._dev = addr, dev
        self._reg = self._agent.register_memory([(addr, nbytes, dev, "")], self._mem)
        self._remote = info
        name = self._agent.add_remote_agent(bytes.fromhex(info["md"]))
        self._peer = name.decode() if isinstance(name, bytes) else str(name)

    def prepare(self, src: np.ndarray, dst: np.ndarray, nbytes: int) -> Any:
        n = np.full(len(src), nbytes, dtype=np.uint64)
        local = np.stack([self._base + dst.astype(np.uint64), n, np.full_like(n, self._dev)], 1)
        remote = np.stack([self._remote["addr"] + src.astype(np.uint64), n, np.full_like(n, self._remote["dev"])], 1)
        return self._agent.initialize_xfer(
            "READ",
            self._agent.get_xfer_descs(local, self._mem),
            self._agent.get_xfer_descs(remote, self._remote["mem"]),
            self._peer,
        )

    def read(self, handle: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = self._agent.transfer(handle)
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TransportError(f"raw nixl: a read did not finish within {timeout}s")
            state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransportError(f"raw nixl: READ ended {state}")

    def release(self, handle: Any) -> None:
        handle.release()

    def close(self) -> None:
        if self._agent is None:
            return
        self._agent.remove_remote_agent(self._peer)
        self._agent.deregister_memory(self._reg)
        self._agent = None  # last: the agent's destructor tears down UCX


class RawMooncakeReader:
    """Reads a served region through a bare Mooncake engine: ``batch_transfer_sync_read`` of each
    prepared batch (``read``), or ``transfer_sync_read`` per op (``read_each``).

    - ``info``: the server's ``RawServed.info``.
    - ``addr``, ``nbytes``, ``device``: the local memory the reads land in (host memory).
    - ``host``: the local address the engine binds.
    """

    label = "mooncake-raw"

    def __init__(self, info: dict, addr: int, nbytes: int, device: str, host: str) -> None:
        if device != "cpu":
            raise TransportError("raw mooncake reads into host memory only")
        self._engine, protocol = _mooncake_engine(host)
        if protocol != info["protocol"]:
            raise TransportError(f"raw mooncake: the server speaks {info['protocol']}, this host {protocol}")
        self._base, self._remote, self._session = addr, info["addr"], info["session"]
        if self._engine.register_memory(addr, nbytes) != 0:
            raise TransportError(f"raw mooncake: the engine refused to register {nbytes} bytes")

    def prepare(self, src: np.ndarray, dst: np.ndarray, nbytes: int) -> Any:
        local = (self._base + dst).tolist()
        remote = (self._remote + src).tolist()
        return local, remote, [nbytes] * len(local)

    def read(self, handle: Any, timeout: float) -> None:
        local, remote, lengths = handle
        for i in range(0, len(lengths), MOONCAKE_BATCH):
            s = slice(i, i + MOONCAKE_BATCH)
            if self._engine.batch_transfer_sync_read(self._session, local[s], remote[s], lengths[s]) != 0:
                raise TransportError(f"raw mooncake: batch_transfer_sync_read from {self._session} failed")

    def read_each(self, handle: Any, timeout: float) -> None:
        for a, b, n in zip(*handle):
            if self._engine.transfer_sync_read(self._session, a, b, n) != 0:
                raise TransportError(f"raw mooncake: transfer_sync_read from {self._session} failed")

    def release(self, handle: Any) -> None:
        pass

    def close(self) -> None:
        if self._engine is None:
            return
        self._engine.unregister_memory(self._base)
        self._engine = None  # releases the engine


READERS = {"nixl": RawNixlReader, "mooncake": RawMooncakeReader}


def iperf3_server(host: str) -> tuple[subprocess.Popen, int]:
    """A one-shot ``iperf3 -s`` bound to ``host`` on a free port; ``TransportError`` without iperf3."""
    exe = shutil.which("iperf3")
    if exe is None:
        raise TransportError("iperf3 is not installed on the server (apt-get install iperf3)")
    port = free_port(host)
    proc = subprocess.Popen(
        [exe, "-s", "-1", "-B", host, "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return proc, port


def iperf3_client(host: str, port: int, *, streams: int, length: int, nbytes: int, timeout: float) -> dict:
    """``nbytes`` sent from the server to this host (``-R``) in ``streams`` streams of ``length``-byte
    writes: ``{"bytes", "seconds", "gbps"}`` as iperf3 measured them at the receiver."""
    exe = shutil.which("iperf3")
    if exe is None:
        raise TransportError("iperf3 is not installed on this host (apt-get install iperf3)")
    argv = [exe, "-c", host, "-p", str(port), "-R", "-J", "-P", str(streams), "-l", str(length), "-n", str(nbytes)]
    deadline = time.monotonic() + timeout
    while True:  # the server needs a moment to listen: retry while the connection is refused
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        try:
            got = json.loads(out.stdout)["end"]["sum_received"]
            return {"bytes": int(got["bytes"]), "seconds": float(got["seconds"]), "gbps": got["bits_per_second"] / 8e9}
        except (ValueError, KeyError, TypeError):
            text = out.stdout + out.stderr
            if "refused" not in text or time.monotonic() > deadline:
                raise TransportError(f"iperf3 to {host}:{port} failed: {text.strip()[-300:]}") from None
        time.sleep(0.1)


def iperf3_loopback(size: int, streams: int = 1, timeout: float = 120.0) -> float | None:
    """GB/s of ``iperf3`` moving ``size`` bytes over loopback; ``None`` where iperf3 is missing or fails."""
    try:
        proc, port = iperf3_server("127.0.0.1")
    except TransportError:
        return None
    try:
        return iperf3_client("127.0.0.1", port, streams=streams, length=128 << 10, nbytes=size, timeout=timeout)["gbps"]
    except TransportError:
        return None
    finally:
        proc.kill()
        proc.wait(10)


__all__ = ["ENGINES", "READERS", "RawServed", "iperf3_client", "iperf3_loopback", "iperf3_server", "serve_raw"]
