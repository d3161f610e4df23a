"""``wbridge bench transport --connect HOST:PORT``: reads a bench server's region over each transport
(and, with ``against_raw``, through the engine underneath) at each op size, from this host.

``run_client`` proves the token on the server's control port, learns what it serves, and for each
transport builds ``streams`` readers (``transports.bench.reads``) and measures each op size in turn.
With ``against_raw`` each transport's engine is measured right after it at each size, over the same
region: a NIXL agent's ``READ`` (nixl), the Mooncake engine's batched reads (mooncake), ``iperf3 -R``
moving as many bytes in writes of the op size (at most 1 MiB, iperf3's limit) (tcp).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .. import get
from ..errors import TransportError
from . import control
from .memory import Buffer
from .raw import ENGINES, IPERF3_MAX_LENGTH, READERS, iperf3_client
from .reads import Pattern, SizeResult, TransportReader, measure


def local_address(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (what its transports should bind and advertise)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))  # UDP: picks the route, sends nothing
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


@dataclass(frozen=True)
class ClientPlan:
    """What a client measures.

    - ``transports``: the transports to read through (empty: every one the server serves).
    - ``sizes``: op sizes, in order.
    - ``pattern``: how each size is read (its ``op_size`` is replaced by each of ``sizes``).
    - ``device``: where the destination lives (``cpu`` or ``cuda:N``).
    - ``span``: bytes of the region to read (None: all of it).
    - ``against_raw``: also measure the engine underneath each transport.
    - ``options``: per-transport constructor keywords for this side.
    """

    transports: tuple[str, ...]
    sizes: tuple[int, ...]
    pattern: Pattern
    device: str = "cpu"
    span: int | None = None
    against_raw: bool = False
    options: dict | None = None


def run_client(
    host: str,
    port: int,
    token: bytes,
    plan: ClientPlan,
    *,
    local_host: str | None = None,
    timeout: float = 60.0,
    progress: Callable[[SizeResult], None] | None = None,
) -> dict:
    """Measures ``plan`` against the bench server at ``host:port``; returns ``{"server", "rows"}``
    (rows: ``SizeResult.as_dict()`` plus ``transport``, ``engine`` (``wbridge`` or ``raw``: the engine
    under that transport), and ``vs_raw`` on wbridge rows where a raw row of the same size exists)."""
    local_host = local_host or local_address(host, port)
    ch = control.dial(host, port, token, timeout)
    try:
        hello = ch.recv(timeout)
        names = list(plan.transports) or list(hello["transports"])
        missing = [n for n in names if n not in hello["transports"]]
        if missing:
            raise TransportError(
                f"bench: the server at {host}:{port} serves {sorted(hello['transports'])}, not {missing}"
            )
        span = hello["size"] if plan.span is None else plan.span
        if span > hello["size"]:
            raise TransportError(f"bench: --size {span} is more than the {hello['size']} bytes the server serves")
        dest = Buffer(span, plan.device)
        rows: list[dict] = []
        try:
            for name in names:
                rows += _one_transport(ch, name, hello, dest, span, plan, token, local_host, host, timeout, progress)
        finally:
            dest.close()
        ch.request({"op": "bye"}, timeout)
    finally:
        ch.close()
    return {"server": f"{host}:{port}", "local": local_host, "size": hello["size"], "rows": rows}


def _one_transport(
    ch: control.Channel,
    name: str,
    hello: dict,
    dest: Buffer,
    span: int,
    plan: ClientPlan,
    token: bytes,
    local_host: str,
    server_host: str,
    timeout: float,
    progress: Callable[[SizeResult], None] | None,
) -> list[dict]:
    served = hello["transports"][name]
    opts = (plan.options or {}).get(name, {})

    def wbridge_reader(i: int, addr: int, nbytes: int, device: str) -> TransportReader:
        return TransportReader(
            name, served, addr, nbytes, device, token=token, host=local_host, options=opts, timeout=timeout
        )

    engine = ENGINES.get(name) if plan.against_raw else None
    raw_info = None
    if engine in READERS:
        raw_info = ch.request({"op": "raw", "engine": engine}, timeout)["info"]
    rows = []
    try:
        for op in plan.sizes:
            pattern = replace(plan.pattern, op_size=op)
            res = measure(wbridge_reader, dest, pattern, hello["seed"], span=span)
            row = {"engine": "wbridge", "transport": name, **res.as_dict()}
            rows.append(row)
            if progress:
                progress(res)
            raw = None
            if raw_info is not None:
                raw = measure(
                    lambda i, addr, n, dev: READERS[engine](raw_info, addr, n, dev, local_host),
                    dest,
                    pattern,
                    hello["seed"],
                    span=span,
                )
            elif engine == "iperf3":
                port = ch.request({"op": "iperf3"}, timeout)["port"]
                length = min(op, IPERF3_MAX_LENGTH)
                got = iperf3_client(
                    server_host, port, streams=res.streams, length=length, nbytes=res.bytes, timeout=timeout + 60
                )
                raw = replace(
                    res,
                    label="iperf3",
                    bytes=got["bytes"],
                    seconds=got["seconds"],
                    gbps=got["gbps"],
                    gbps_peak=None,  # iperf3 reports no peak nor latency (None: JSON's null)
                    lat_p50_us=None,
                    lat_p99_us=None,
                    checked_bytes=0,
                    verified=None,
                    round_seconds=[],
                )
            if raw is not None:
                rows.append({"engine": "raw", "transport": name, **raw.as_dict()})
                row["vs_raw"] = res.gbps / raw.gbps if raw.gbps > 0 else None
                if progress:
                    progress(raw)
    finally:
        if raw_info is not None:
            ch.request({"op": "raw-done"}, timeout)
    return rows


def device_refusal(transports: Sequence[str], device: str) -> str | None:
    """Why ``device`` cannot be used with ``transports`` (None: it can)."""
    if device == "cpu":
        return None
    host_only = [n for n in transports if "cuda" not in get(n).memory_kinds]
    if host_only:
        return f"{', '.join(host_only)} move host memory only; of the transports, nixl reaches GPU memory"
    return None
