"""``nixl``: one-sided ``READ`` transfers through an NVIDIA NIXL agent with the UCX backend.

Serving side: one agent per transport; ``register`` registers the buffer with the agent once
(``DRAM`` for host memory, ``VRAM`` for ``cuda:N``) and its descriptor carries the address, size,
memory type and the agent's *partial metadata* for that registration (connection info plus the
remote key), so a region registered after ``endpoint()`` was published is still readable. The
endpoint carries the agent's name and full metadata. No pickle: descriptors are JSON and the
metadata blobs base64; NIXL parses the blobs.

Reading side: ``connect`` loads the peer's metadata; ``prepare`` loads each region's partial
metadata, checks every read against the descriptors, and builds the prepared descriptor lists
(``prep_xfer_dlist`` for both sides) and the transfer request (``make_prepped_xfer``) once; every
``read`` re-posts that same request and polls it until done or ``timeout``.

Teardown order matters to NIXL (a handle released after its agent crashes the process at exit):
transfer requests, then prepared lists, then remote agents, then registrations, then the agent.
``release``/``disconnect``/``close`` follow it and are idempotent.

UCX opens TCP listeners for its own wire-up. Unless ``UCX_NET_DEVICES`` is already set, the backend
is created with the network devices limited to the interface that owns ``host`` (``lo`` for
loopback) plus the RDMA ports (which open no TCP listener), so nothing listens on other interfaces;
a transport bound to loopback then reaches other hosts over RDMA only. NIXL has no peer
authentication (the token is not used); on the same host UCX may read through shared memory or
CMA, which no registration check guards: see ``conformance_skips``.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import ipaddress
import itertools
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, ClassVar

import numpy as np

from ._host import rdma_ports
from ._util import int_field, str_field
from .base import (
    PreparedBatch,
    Range,
    ReadBatch,
    Region,
    Transport,
    checked_options,
)
from .errors import TransportError

# The nixl-cu12 wheel bundles UCX with its own libibverbs/libnl but not libefa. Where the system has
# libefa (the ibverbs-providers package, which Mooncake's libibverbs1 pulls in), UCX's ib_efa module
# loads it, which drags the system libibverbs/libnl in next to the bundled copies, and the process
# segfaults in libnl's destructor at exit. UCX reads this option once, when its library loads, so it
# is set before the import; a value the user set wins (AWS EFA users: see docs/transports.md).
os.environ.setdefault("UCX_MODULES", "^*efa*")

try:
    from nixl_cu12 import nixl_agent, nixl_agent_config
    from nixl_cu12._api import nixlBind as _bindings
except ImportError:
    from nixl import nixl_agent, nixl_agent_config  # other builds of the same API
    from nixl._api import nixlBind as _bindings

# NIXL's Python logger prints an INFO line per agent and backend to *stdout* (its own handler), which
# corrupts machine-readable output such as ``wbridge bench transport --json``; warnings still show.
logging.getLogger("nixl").setLevel(logging.WARNING)

_log = logging.getLogger(__name__)
_ids = itertools.count(1)
_env_lock = threading.Lock()
MAX_METADATA = 1 << 20
# the longest an idle agent's progress thread sleeps between two looks at its UCX workers (us)
PROGRESS_WAKE_US = 1000
SIOCGIFADDR = 0x8915


def _interface_of(host: str) -> str | None:
    """The network interface that owns IPv4 address ``host`` (``lo`` for loopback), or None."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if ip.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == str(ip):
                return name
    return None


def _net_devices(host: str) -> str | None:
    """What ``UCX_NET_DEVICES`` should be for a backend bound to ``host`` (None: leave UCX's default)."""
    iface = _interface_of(host)
    if iface is None:
        return None
    # RDMA ports open no TCP listener, and a reader bound to loopback still reads remote peers over them
    return ",".join([iface, *rdma_ports()])


def _quiet_progress(agent: Any, name: str) -> None:
    """Give ``agent`` (no backend yet) a progress thread that sleeps while nothing happens.

    nixl's Python wrapper builds its C++ agent with ``pthrDelay = 0`` and exposes no setting for it.
    The UCX backend's progress thread waits in ``poll()`` on its workers' event descriptors with that
    delay as the timeout, so 0 is a busy loop: every agent spins a core for its whole life, idle or
    not (5.0 CPU-s in 5 idle seconds; 0.1 with ``PROGRESS_WAKE_US``). UCX events still wake the
    thread at once; the delay is only the period of the wake-up NIXL keeps for events ``poll()``
    misses. The C++ agent is rebuilt here with the wrapper's other settings, before any backend
    exists (a backend takes the delay when it is created)."""
    config = _bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = _bindings.NIXL_THREAD_SYNC_NONE  # the wrapper's choice without a listen thread
    config.pthrDelay = PROGRESS_WAKE_US
    config.lthrDelay = 100000
    config.captureTelemetry = False
    agent.agent = _bindings.nixlAgent(name, config)


def new_agent(name: str, host: str, backend: str = "UCX") -> tuple[Any, str | None]:
    """A NIXL agent called ``name`` with ``backend`` started, its network devices limited to the
    interface of ``host`` plus the RDMA ports (see the module docstring), and the ``UCX_NET_DEVICES``
    value it started with (None: UCX's default). ``TransportError`` if the backend does not start."""
    agent = nixl_agent(name, nixl_agent_config(enable_listen_thread=False, backends=[]))
    _quiet_progress(agent, name)
    devices = os.environ.get("UCX_NET_DEVICES") or _net_devices(host)
    with _env_lock:  # UCX takes its configuration from the environment only, when the backend starts
        saved = os.environ.get("UCX_NET_DEVICES")
        if devices:
            os.environ["UCX_NET_DEVICES"] = devices
        try:
            agent.create_backend(backend, {})
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            raise TransportError(f"nixl: cannot start the {backend} backend: {e!r}") from e
        finally:
            if saved is None:
                os.environ.pop("UCX_NET_DEVICES", None)
            else:
                os.environ["UCX_NET_DEVICES"] = saved
    return agent, devices


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(kind: str, d: dict, key: str) -> bytes:
    v = str_field(kind, d, key, 4 * MAX_METADATA // 3 + 4)
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise TransportError(f"{kind}: descriptor field {key!r} is not base64") from None


def _device(device: str) -> tuple[str, int]:
    """(``DRAM``, 0) for ``cpu``, (``VRAM``, N) for ``cuda:N``."""
    if device == "cpu":
        return "DRAM", 0
    if device.startswith("cuda"):
        _, _, n = device.partition(":")
        if n == "" or n.isdigit():
            return "VRAM", int(n or 0)
    raise TransportError(f"nixl: unsupported device {device!r} (cpu or cuda:N)")


@dataclass(eq=False)
class NixlPeer:
    """A remote agent whose metadata this agent loaded."""

    name: str
    regions: set = field(default_factory=set)  # region ids whose partial metadata is loaded
    closed: bool = False

    @property
    def label(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"NixlPeer({self.name}, regions={len(self.regions)}, closed={self.closed})"


@dataclass(eq=False, repr=False)  # keeps PreparedBatch's repr
class NixlPrepared(PreparedBatch):
    """Prepared lists and transfer requests (one per memory-type pair), re-posted on every read."""

    peer: NixlPeer
    dlists: list[Any] = field(default_factory=list)
    xfers: list[Any] = field(default_factory=list)
    posted: bool = False  # NIXL refuses a status check of a request never posted


class NixlTransport(Transport):
    """One NIXL agent (UCX backend) per transport; see the module docstring.

    ``backend``: the NIXL backend plugin (``UCX``). ``poll_max``: the longest sleep between two
    completion checks of a read (seconds).
    """

    name = "nixl"
    memory_kinds = ("cpu", "cuda")
    conformance_skips: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "auth": "NIXL has no peer authentication; the token is not used",
            "deregister": "one-sided: on the same host UCX reads through CMA/shared memory, which a deregistration "
            "on the serving side does not revoke",
            "stopped": "one-sided: a stopped (hung) publisher does not stop reads of its memory on the same host",
            "leaks": "starting a NIXL agent and its UCX context takes ~0.3 s and a first connection ~0.2 s, so 100 "
            "cycles take over a minute; tests/transports/test_nixl.py counts fds, OS threads and "
            "registrations over 10 cycles",
        }
    )

    @checked_options
    def __init__(
        self,
        token: bytes | str | None = None,
        host: str = "127.0.0.1",
        *,
        backend: str = "UCX",
        poll_max: Annotated[float, Range(0.0, 1.0, open_low=True)] = 1e-3,
    ) -> None:
        super().__init__(token=token, host=host)
        self.backend = backend
        self.poll_max = poll_max
        self.agent_name = f"wbridge-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent, self.net_devices = new_agent(self.agent_name, host, backend)
        self._regions: dict[int, Region] = {}
        self._peers: dict[str, list[NixlPeer]] = {}
        self._prepared: set[NixlPrepared] = set()

    # -- serving -----------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, *, device: str = "cpu") -> Region:
        mem, dev = _device(device)
        if type(addr) is not int or addr <= 0 or type(nbytes) is not int or nbytes <= 0:  # noqa: E721
            raise TransportError(f"nixl: cannot register {nbytes!r} bytes at {addr!r}")
        with self._lock:
            self._check_open()
            try:
                reg = self._agent.register_memory([(addr, nbytes, dev, "")], mem)
                md = self._agent.get_partial_agent_metadata(reg, True)
            except Exception as e:  # noqa: BLE001
                raise TransportError(
                    f"nixl: agent {self.agent_name} cannot register {nbytes} bytes of {mem} at {addr:#x}: {e!r}"
                ) from e
            rid = next(_ids)
            desc = self._descriptor(
                agent=self.agent_name, region=rid, addr=addr, nbytes=nbytes, mem=mem, dev=dev, md=_b64(md)
            )
            region = Region(rid, addr, nbytes, device, desc, handle=(self, reg))
            self._regions[rid] = region
        return region

    def deregister(self, region: Region) -> None:
        with self._lock:
            if self._regions.pop(region.id, None) is None or self._agent is None:
                return
            self._agent.deregister_memory(region.handle[1])

    def endpoint(self) -> bytes:
        with self._lock:
            self._check_open()
            md = self._agent.get_agent_metadata()
        return self._descriptor(agent=self.agent_name, md=_b64(md))

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    # -- reading -----------------------------------------------------------------------------
    def connect(self, endpoint: bytes, *, timeout: float) -> NixlPeer:
        d = self._peer_descriptor(endpoint, ("agent", "md"))
        name, md = str_field("nixl", d, "agent"), _unb64("nixl", d, "md")
        with self._lock:
            self._check_open()
            if name == self.agent_name:
                raise TransportError("nixl: an agent cannot read from itself through connect; use a second transport")
            loaded = self._load(name, md)
            peer = NixlPeer(loaded)
            self._peers.setdefault(loaded, []).append(peer)
        return peer

    def _load(self, name: str, md: bytes) -> str:
        try:
            loaded = self._agent.add_remote_agent(md)
        except Exception as e:  # noqa: BLE001
            raise TransportError(f"nixl: metadata of peer {name} does not load: {e!r}") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            raise TransportError(f"nixl: metadata names agent {loaded!r}, the descriptor {name!r}")
        return loaded

    def prepare(
        self, peer: NixlPeer, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> NixlPrepared:
        remote = []
        for i, desc in enumerate(remote_regions):
            d = self._peer_descriptor(desc, ("agent", "region", "addr", "nbytes", "mem", "dev", "md"))
            if d["agent"] != peer.name:
                raise TransportError(f"nixl: remote region {i} belongs to agent {d['agent']!r}, not peer {peer.name}")
            if d["mem"] not in ("DRAM", "VRAM"):
                raise TransportError(f"nixl: remote region {i} has unknown memory type {d['mem']!r}")
            remote.append(
                (
                    int_field("nixl", d, "region", 1),
                    int_field("nixl", d, "addr", 1),
                    int_field("nixl", d, "nbytes", 1),
                    d["mem"],
                    int_field("nixl", d, "dev", 0, 1 << 16),
                    _unb64("nixl", d, "md"),
                )
            )
        for r in local_regions:
            if not isinstance(r.handle, tuple) or r.handle[0] is not self or r.id not in self._regions:
                raise TransportError(f"nixl: destination region {r.id} is not registered with this transport")
        self._check_bounds(batch, [x[2] for x in remote], [r.nbytes for r in local_regions], peer.name)
        with self._lock:
            self._check_open()
            if peer.closed:
                raise TransportError(f"nixl: peer {peer.name} is disconnected")
            for rid, *_, md in remote:
                if rid not in peer.regions:
                    self._load(peer.name, md)
                    peer.regions.add(rid)
            prep = NixlPrepared(peer, len(batch), batch.total_bytes)
            try:
                self._build(prep, batch, remote, local_regions)
            except BaseException:
                self._free(prep)
                raise
            self._prepared.add(prep)
        return prep

    def _build(self, prep: NixlPrepared, batch: ReadBatch, remote: list, local_regions: Sequence[Region]) -> None:
        """One prepared (local, remote) list pair and one transfer request per memory-type pair."""
        l_mem = np.array([_device(r.device)[0] for r in local_regions])
        r_mem = np.array([x[3] for x in remote])
        l_base = np.array([r.addr for r in local_regions], dtype=np.uint64)
        l_dev = np.array([_device(r.device)[1] for r in local_regions], dtype=np.uint64)
        r_base = np.array([x[1] for x in remote], dtype=np.uint64)
        r_dev = np.array([x[4] for x in remote], dtype=np.uint64)
        pair = np.char.add(l_mem[batch.dst_region], r_mem[batch.src_region]) if len(batch) else np.array([])
        for key in np.unique(pair):
            sel = np.flatnonzero(pair == key)
            src, dst, n = batch.src_region[sel], batch.dst_region[sel], batch.nbytes[sel].astype(np.uint64)
            local = np.stack([l_base[dst] + batch.dst_offset[sel].astype(np.uint64), n, l_dev[dst]], axis=1)
            rem = np.stack([r_base[src] + batch.src_offset[sel].astype(np.uint64), n, r_dev[src]], axis=1)
            idx = np.arange(len(sel), dtype=np.int32)
            try:
                lh = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, str(l_mem[dst[0]]))
                prep.dlists.append(lh)
                rh = self._agent.prep_xfer_dlist(prep.peer.name, rem, str(r_mem[src[0]]))
                prep.dlists.append(rh)
                prep.xfers.append(self._agent.make_prepped_xfer("READ", lh, idx, rh, idx))
            except Exception as e:  # noqa: BLE001
                raise TransportError(
                    f"nixl: peer {prep.peer.name} refused {len(sel)} reads ({key}): {e!r} "
                    "(outside its registered memory, or its metadata is stale)"
                ) from e

    def read(self, prepared: NixlPrepared, *, timeout: float) -> None:
        peer = prepared.peer
        deadline = time.monotonic() + timeout
        with self._lock:
            self._check_open()
            prepared.check_readable("nixl")
            pending = list(prepared.xfers)
            if prepared.posted and "PROC" in [self._state(x, peer, post=False) for x in pending]:
                raise TransportError(f"nixl: an earlier read from {peer.name} is still in flight (it timed out)")
            prepared.posted = True
            for x in pending:
                if self._state(x, peer, post=True) == "ERR":
                    raise TransportError(f"nixl: posting a read from peer {peer.name} failed")
        wait = 1e-5
        while pending:
            with self._lock:
                self._check_open()
                states = [self._state(x, peer, post=False) for x in pending]
            if "ERR" in states:
                raise TransportError(f"nixl: read of {prepared.count} ops from peer {peer.name} failed")
            pending = [x for x, s in zip(pending, states) if s != "DONE"]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise TransportError(
                    f"nixl: read of {prepared.count} ops ({prepared.nbytes} bytes) from peer "
                    f"{peer.name} did not finish within {timeout}s"
                )
            time.sleep(wait)
            wait = min(wait * 2, self.poll_max)

    def _state(self, x: Any, peer: NixlPeer, *, post: bool) -> str:
        """``DONE``/``PROC``/``ERR`` of a request, posting it first when ``post``; NIXL errors become ERR."""
        try:
            return self._agent.transfer(x) if post else self._agent.check_xfer_state(x)
        except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError
            raise TransportError(f"nixl: peer {peer.name}: {e!r}") from e

    def release(self, prepared: NixlPrepared) -> None:
        with self._lock:
            self._free(prepared)

    def _free(self, prepared: NixlPrepared) -> None:
        """Transfer requests first, then the prepared lists (called with the lock held)."""
        if prepared.released:
            return
        prepared.released = True
        self._prepared.discard(prepared)
        for h in [*prepared.xfers, *prepared.dlists]:
            try:
                h.release()
            except Exception as e:  # noqa: BLE001 - an uncancellable request: NIXL frees it with the agent
                _log.warning("nixl: releasing %r for peer %s failed: %r", h, prepared.peer.name, e)
        prepared.xfers.clear()
        prepared.dlists.clear()

    def disconnect(self, peer: NixlPeer) -> None:
        with self._lock:
            if peer.closed:
                return
            peer.closed = True
            for p in [p for p in self._prepared if p.peer is peer]:
                self._free(p)
            same = self._peers.get(peer.name, [])
            if peer in same:
                same.remove(peer)
            if not same and self._agent is not None:
                self._peers.pop(peer.name, None)
                try:
                    self._agent.remove_remote_agent(peer.name)
                except Exception as e:  # noqa: BLE001
                    _log.warning("nixl: removing peer %s failed: %r", peer.name, e)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in list(self._prepared):
                self._free(p)
            for name, peers in list(self._peers.items()):
                for peer in peers:
                    peer.closed = True
                try:
                    self._agent.remove_remote_agent(name)
                except Exception as e:  # noqa: BLE001
                    _log.warning("nixl: removing peer %s failed: %r", name, e)
            self._peers.clear()
            for region in list(self._regions.values()):
                self._agent.deregister_memory(region.handle[1])
            self._regions.clear()
            self._agent = None  # last: the agent's destructor tears down UCX

    def __repr__(self) -> str:
        return (
            f"NixlTransport({self.agent_name}, backend={self.backend}, net_devices={self.net_devices}, "
            f"regions={len(self._regions)}, peers={sum(map(len, self._peers.values()))}, "
            f"closed={self._closed})"
        )
