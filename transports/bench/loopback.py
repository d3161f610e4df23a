"""The one-host mode: a bench server in a child process on loopback, read from this process
(``wbridge bench transport`` without ``--serve``/``--connect``), and ``run_bench``, the same as a
function for the benchmarks (``benchmarks/transport_throughput.py``, ``benchmarks/plots.py``)."""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import transports

from .. import get
from ..errors import TransportError
from .client import ClientPlan, run_client
from .reads import Pattern

TOKEN_ENV = "WBRIDGE_BENCH_LOOPBACK_TOKEN"


class LoopbackServer:
    """``python -m transports.bench --serve`` on 127.0.0.1 (any free port) in a child process; a
    context manager whose exit stops it (``status``: its exit status).

    - ``transports``, ``size``, ``device``: what it serves.
    - ``options``: per-transport constructor keywords, ``{"tcp": {...}}``.
    - ``timeout``: seconds to wait for it to start and to stop.
    """

    def __init__(
        self,
        transports_: list[str],
        size: int,
        *,
        device: str = "cpu",
        options: dict[str, dict] | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.token = secrets.token_hex(16)
        self.timeout, self.status = timeout, None
        argv = [sys.executable, "-m", "transports.bench", "--serve", "--host", "127.0.0.1", "--port", "0", "--json"]
        argv += ["--transport", ",".join(transports_), "--size", str(size), "--device", device]
        argv += ["--token-env", TOKEN_ENV]
        for name, opts in (options or {}).items():
            argv += [a for k, v in opts.items() for a in ("--option", f"{name}.{k}={json.dumps(v)}")]
        # the child imports this very copy of the package, its parent folder first on PYTHONPATH
        root = os.path.dirname(os.path.dirname(os.path.abspath(transports.__file__)))
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path, **{TOKEN_ENV: self.token})
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not line or not line[0].startswith("{"):
            self.close()
            raise TransportError(f"bench: the loopback server did not start: {self.stderr()}")
        self.port = int(json.loads(line[0])["serving"].rsplit(":", 1)[1])

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read()[-3000:].decode(errors="replace")

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.status = self.proc.returncode
        self.proc.stdout.close()
        self._err.close()
        return self.status

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._err.closed:
            self.close()

    def __repr__(self) -> str:
        return f"LoopbackServer(port={getattr(self, 'port', None)}, pid={self.proc.pid}, status={self.proc.poll()})"


def run_loopback(transports_: list[str], size: int, device: str, plan: ClientPlan, **kw) -> dict:
    """``plan`` read from a loopback server serving ``transports_``; ``run_client``'s result plus
    ``server_status``."""
    with LoopbackServer(transports_, size, device=device, options=plan.options) as server:
        res = run_client("127.0.0.1", server.port, server.token.encode(), plan, local_host="127.0.0.1", **kw)
        res["server_status"] = server.close()
    return res


def run_bench(
    transport: str,
    size: int,
    op_size: int,
    streams: int = 4,
    *,
    repeat: int = 5,
    options: dict | None = None,
    timeout: float = 120.0,
) -> dict:
    """Reads ``size`` bytes in ops of ``op_size`` from a loopback server ``repeat`` times (after one
    untimed read), each time the whole region in one batch; returns the figures.

    ``streams`` goes to transports that take it (tcp: connections); ``options`` are extra constructor
    keywords (both sides). Keys: ``transport, size, op_size, ops, streams, options, repeat,
    seconds`` (each timed read), ``gbps`` (median), ``gbps_best``, ``verified``, ``server_status``.
    """
    if size <= 0 or op_size <= 0:
        raise ValueError("size and op_size must be positive")
    opts = dict(options or {})
    if get(transport).takes("streams"):
        opts.setdefault("streams", streams)
    nops = size // op_size
    if nops * op_size != size:
        raise ValueError(f"size {size} is not a whole number of {op_size}-byte ops")
    pattern = Pattern(op_size, depth=nops, streams=1, duration=None, repeat=repeat, timeout=timeout)
    plan = ClientPlan((transport,), (op_size,), pattern, options={transport: opts})
    res = run_loopback([transport], size, "cpu", plan, timeout=timeout)
    row = res["rows"][0]
    gbps = [size / s / 1e9 for s in row["round_seconds"]]
    return {
        "transport": transport,
        "size": size,
        "op_size": op_size,
        "ops": nops,
        "streams": opts.get("streams"),
        "options": {k: v for k, v in opts.items() if k != "streams"},
        "repeat": repeat,
        "seconds": row["round_seconds"],
        "gbps": statistics.median(gbps),
        "gbps_best": max(gbps),
        "verified": row["verified"],
        "server_status": res["server_status"],
    }


def memcpy_ceiling(size: int, repeat: int = 5) -> float:
    """GB/s of a single-thread numpy copy of ``size`` bytes into a destination already touched."""
    src = np.full(size, 1, dtype=np.uint8)
    dst = np.full(size, 2, dtype=np.uint8)
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times[1:]) / 1e9
