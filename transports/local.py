"""``local``: one-sided reads between processes on the same host, without the serving process's help.

Two ways to reach the publisher's memory, chosen per region by ``method``:

- ``memfd``: the publisher stages into ``host_buffer(n)``, a sealed memfd mapping. The reader opens
  ``/proc/<pid>/fd/<fd>``, maps it read-only once (at ``prepare``) and copies out of the mapping
  with a ``transports._copy.CopyPlan`` built at ``prepare``: plain memory copies, each family of
  equal, evenly spaced reads (the rows of a column slice) as one strided numpy copy, no Python
  call per read.
- ``vm``: any registered memory, read with ``process_vm_readv`` (batched iovecs, IOV_MAX per call,
  partial transfers resumed): one kernel copy, no mapping, about half the speed of ``memcpy`` here.

``method="auto"`` (the default) uses ``memfd`` for regions inside a host buffer, ``vm`` for the rest.

Security. Both ways need the kernel's ptrace access check to pass (same uid and, under Yama
``ptrace_scope=1``, the publisher's consent, which ``endpoint()`` gives with
``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``). That check is the real boundary: any process with
the same uid can already read this process's memory, and this transport does not pretend otherwise.
What the token adds: endpoints and region descriptors carry an HMAC with the token, so a poisoned
metadata store cannot point a reader at other memory of the publisher, nor at another process;
endpoints name the pid, its start time and a per-process nonce (read back from the publisher's
memory at ``connect``), so a recycled pid is never read. Every read is bounds-checked against the
(authenticated) descriptors. Being one-sided, ``deregister`` cannot revoke a mapping a reader already
holds; the publisher's slot leases (wbridge) decide when memory may change.

Liveness. A dead publisher fails ``process_vm_readv`` (``ESRCH``); a memfd mapping outlives its
publisher, so ``read`` also checks the publisher through a pidfd after copying and raises if it died.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import hmac
import json
import mmap
import os
import select
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, ClassVar

import numpy as np

from ._copy import CopyPlan, vm_read
from ._host import host_identity, read_text
from ._util import check_host_memory, coalesce, hex_field, int_field, peer_lock, token_key
from .base import (
    OneOf,
    ReadBatch,
    Region,
    Transport,
    checked_options,
    encode_descriptor,
)
from .errors import AuthError, TransportError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

NONCE_BYTES = 16
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
MAP_FAILED = ctypes.c_void_p(-1).value
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
METHODS = ("auto", "memfd", "vm")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), 0 if gone."""
    stat = read_text(f"/proc/{pid}/stat")
    try:
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return 0


def _sign(key: bytes, fields: dict) -> str:
    body = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
    return hmac.new(key, b"wbridge-local-v1\0" + body, hashlib.sha256).hexdigest()


def _signed(key: bytes, **fields: Any) -> bytes:
    return encode_descriptor("local", **fields, mac=_sign(key, {"transport": "local", **fields}))


def _check_signature(key: bytes, d: dict, what: str) -> None:
    got = d.get("mac")
    body = {k: v for k, v in d.items() if k != "mac"}
    if not isinstance(got, str) or not hmac.compare_digest(_sign(key, body), got):
        raise AuthError(f"local: {what} is not signed with our token (wrong token, or forged)")


def _want_huge_pages(mm: mmap.mmap) -> None:
    """Asks for transparent huge pages on a host buffer. It only takes effect where
    /sys/kernel/mm/transparent_hugepage/shmem_enabled allows ("advise" or "always"). With 4 KiB
    shmem pages ("never"), a 512 MiB read out of the mapping ran at 0.95-0.99x a one-thread
    anonymous memcpy on a 2-CPU, one-NUMA-node host (``benchmarks/transport_throughput.py``)."""
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass


@dataclass
class _HostBuffer:
    """A memfd mapping handed out by ``host_buffer``."""

    fd: int
    ino: int
    addr: int
    nbytes: int
    mm: mmap.mmap = field(repr=False)


@dataclass(eq=False)
class LocalPeer:
    """A publisher process on this host, checked to be the one its endpoint names."""

    pid: int
    nonce: bytes
    pidfd: int
    vm_error: str | None  # why process_vm_readv cannot read this peer, if it cannot
    maps: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict, repr=False)  # (fd, ino) -> (addr, len)
    closed: bool = False
    #: Held by ``read`` and ``disconnect``: a mapping is never unmapped under a running copy.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def label(self) -> str:
        return f"pid {self.pid}"

    def alive(self) -> bool:
        return not select.select([self.pidfd], [], [], 0)[0]


@dataclass(frozen=True, eq=False)
class LocalPrepared:
    """A validated batch: the copies out of mapped memfds, and ``process_vm_readv`` iovecs for the rest."""

    peer: LocalPeer
    copies: CopyPlan
    local_iov: np.ndarray = field(repr=False)  # (m, 2) uint64
    remote_iov: np.ndarray = field(repr=False)  # (m, 2) uint64
    nbytes: int

    def __repr__(self) -> str:
        return f"LocalPrepared(peer={self.peer.label}, memfd_reads={self.copies.count}, vm_reads={len(self.local_iov)})"


class LocalTransport(Transport):
    """Same-host one-sided reads; see the module docstring (including what the token does not protect).

    ``method``: ``auto`` (memfd where the region lives in a ``host_buffer``, else ``vm``), ``memfd``
    (refuse other regions) or ``vm`` (always ``process_vm_readv``). ``host`` is unused (no socket).
    """

    name = "local"
    conformance_skips: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "deregister": "one-sided: a reader that mapped or addresses a region needs nothing from the publisher",
            "stopped": "one-sided: a stopped (hung) publisher does not stop reads of its memory",
        }
    )
    conformance_variants: ClassVar[Mapping[str, dict]] = MappingProxyType({"memfd": {}, "vm": {"method": "vm"}})

    @checked_options
    def __init__(
        self,
        token: bytes | str | None = None,
        host: str = "127.0.0.1",
        *,
        method: Annotated[str, OneOf(METHODS)] = "auto",
    ) -> None:
        super().__init__(token=token, host=host)
        self.method = method
        self._key = token_key(token)
        self._nonce = os.urandom(NONCE_BYTES)
        self._nonce_buf = ctypes.create_string_buffer(self._nonce, NONCE_BYTES)
        self._regions: dict[int, Region] = {}
        self._buffers: list[_HostBuffer] = []
        self._peers: set[LocalPeer] = set()
        self._next_id = 1

    @staticmethod
    def usable() -> bool:
        """Whether this kernel lets a process use ``process_vm_readv`` or memfds at all (cheap probe)."""
        probe = ctypes.create_string_buffer(b"wbridge!", 8)
        dst = ctypes.create_string_buffer(8)
        io = np.array([[ctypes.addressof(dst), 8]], dtype=np.uint64)
        ro = np.array([[ctypes.addressof(probe), 8]], dtype=np.uint64)
        try:
            vm_read(os.getpid(), io, ro)
            return True
        except TransportError:
            pass
        return hasattr(os, "memfd_create") and hasattr(os, "pidfd_open")

    @classmethod
    def same_host(cls, endpoint: bytes) -> bool:
        """Whether ``endpoint`` names a process whose pid this process can address (same boot, pid ns)."""
        try:
            d = cls._peer_descriptor(endpoint, ("boot", "pidns"))
        except TransportError:
            return False
        return (d["boot"], d["pidns"]) == host_identity()

    # -- serving -----------------------------------------------------------------------------
    def host_buffer(self, nbytes: int) -> mmap.mmap | None:
        """A sealed (fixed-size) memfd mapping of ``nbytes``: stage into it and readers map it directly.

        ``None`` for an empty buffer (nothing to map)."""
        if nbytes == 0:
            return None
        if nbytes < 0:
            raise TransportError(f"local: host buffer of {nbytes} bytes")
        fd = os.memfd_create("wbridge-local", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # readers can trust the size: no SIGBUS by truncation
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _want_huge_pages(mm)
        except OSError:
            os.close(fd)
            raise
        anchor = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(anchor)
        del anchor  # release the export so mm can be closed later
        with self._lock:
            self._check_open()
            self._buffers.append(_HostBuffer(fd, os.fstat(fd).st_ino, addr, nbytes, mm))
        return mm

    def register(self, addr: int, nbytes: int, *, device: str = "cpu") -> Region:
        check_host_memory("local", addr, nbytes, device)
        with self._lock:
            self._check_open()
            rid, self._next_id = self._next_id, self._next_id + 1
            memfd = None
            for b in self._buffers:
                if b.addr <= addr and addr + nbytes <= b.addr + b.nbytes:
                    memfd = [b.fd, b.ino, addr - b.addr, b.nbytes]
            desc = _signed(
                self._key, pid=os.getpid(), nonce=self._nonce.hex(), region=rid, addr=addr, nbytes=nbytes, memfd=memfd
            )
            region = Region(rid, addr, nbytes, device, desc)
            self._regions[rid] = region
        return region

    def deregister(self, region: Region) -> None:
        with self._lock:
            self._regions.pop(region.id, None)

    def endpoint(self) -> bytes:
        with self._lock:
            self._check_open()
        if read_text("/proc/sys/kernel/yama/ptrace_scope") == "1":
            _libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)  # consent; refused later reads say why
        boot, pidns = host_identity()
        pid = os.getpid()
        return _signed(
            self._key,
            pid=pid,
            start=_start_time(pid),
            boot=boot,
            pidns=pidns,
            nonce=self._nonce.hex(),
            nonce_addr=ctypes.addressof(self._nonce_buf),
        )

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    # -- reading -----------------------------------------------------------------------------
    def connect(self, endpoint: bytes, *, timeout: float) -> LocalPeer:
        d = self._peer_descriptor(endpoint, ("pid", "start", "boot", "pidns", "nonce", "nonce_addr", "mac"))
        _check_signature(self._key, d, "endpoint")
        pid = int_field("local", d, "pid", 1, 1 << 22)
        nonce = hex_field("local", d, "nonce", NONCE_BYTES)
        if (d["boot"], d["pidns"]) != host_identity():
            raise TransportError(f"local: peer pid {pid} is on another host or in another pid namespace; use tcp")
        if _start_time(pid) != int_field("local", d, "start"):
            raise TransportError(f"local: peer pid {pid} is gone (or its pid now names another process)")
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as e:
            raise TransportError(f"local: cannot watch peer pid {pid}: {e}") from e
        got = ctypes.create_string_buffer(NONCE_BYTES)
        lo = np.array([[ctypes.addressof(got), NONCE_BYTES]], dtype=np.uint64)
        ro = np.array([[int_field("local", d, "nonce_addr", 1), NONCE_BYTES]], dtype=np.uint64)
        vm_error = None
        try:
            vm_read(pid, lo, ro)
        except TransportError as e:
            vm_error = str(e)  # memfd reads may still work; prepare says so if a region needs vm
        if vm_error is None and got.raw != nonce:
            vm_error = f"local: pid {pid} does not hold the nonce its endpoint names"
        if vm_error is not None and (self.method == "vm" or "nonce" in vm_error):
            os.close(pidfd)
            raise TransportError(vm_error)
        peer = LocalPeer(pid, nonce, pidfd, vm_error)
        with self._lock:
            if self._closed:
                os.close(pidfd)
                self._check_open()
            self._peers.add(peer)
        return peer

    def prepare(
        self, peer: LocalPeer, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> LocalPrepared:
        with peer.lock:  # mappings are made here; disconnect must not run meanwhile
            if peer.closed:
                raise TransportError(f"local: peer {peer.label} is disconnected")
            src_base, sizes, mapped = self._resolve(peer, remote_regions)
        for r in local_regions:
            if r.device != "cpu":
                raise TransportError(f"local: destination region {r.id} is on {r.device}")
        self._check_bounds(batch, sizes, [r.nbytes for r in local_regions], peer.label)
        src = np.asarray(src_base, dtype=np.int64)[batch.src_region] + batch.src_offset
        dst = np.asarray([r.addr for r in local_regions], dtype=np.int64)[batch.dst_region] + batch.dst_offset
        via_map = np.asarray(mapped, dtype=bool)[batch.src_region]
        # Adjacent reads become one copy: long copies run at memcpy speed (non-temporal stores), 4 MiB ones do not.
        copies = CopyPlan.of(*coalesce(dst[via_map], src[via_map], batch.nbytes[via_map]))
        d, s, n = coalesce(dst[~via_map], src[~via_map], batch.nbytes[~via_map])
        local_iov = np.ascontiguousarray(np.stack([d, n], axis=1).astype(np.uint64))
        remote_iov = np.ascontiguousarray(np.stack([s, n], axis=1).astype(np.uint64))
        return LocalPrepared(peer, copies, local_iov, remote_iov, batch.total_bytes)

    def _resolve(self, peer: LocalPeer, remote_regions: Sequence[bytes]) -> tuple[list[int], list[int], list[bool]]:
        """Per remote region: where its bytes are read from here, its size, and whether it is mapped."""
        src_base, sizes, mapped = [], [], []
        for i, desc in enumerate(remote_regions):
            d = self._peer_descriptor(desc, ("pid", "nonce", "region", "addr", "nbytes", "memfd", "mac"))
            _check_signature(self._key, d, f"descriptor of remote region {i}")
            if d["pid"] != peer.pid or hex_field("local", d, "nonce", NONCE_BYTES) != peer.nonce:
                raise TransportError(f"local: remote region {i} does not belong to peer {peer.label}")
            nbytes = int_field("local", d, "nbytes", 1)
            addr = int_field("local", d, "addr", 1)
            sizes.append(nbytes)
            memfd = d["memfd"] if self.method != "vm" else None
            if memfd is not None:
                src_base.append(self._map(peer, memfd, nbytes, i))
                mapped.append(True)
            elif self.method == "memfd":
                raise TransportError(f"local: remote region {i} of {peer.label} is not in a memfd host buffer")
            else:
                if peer.vm_error:
                    raise TransportError(peer.vm_error)
                src_base.append(addr)
                mapped.append(False)
        return src_base, sizes, mapped

    def _map(self, peer: LocalPeer, memfd: Any, nbytes: int, i: int) -> int:
        """The local address of a remote region inside a memfd host buffer (mapped once per peer)."""
        if not (isinstance(memfd, list) and len(memfd) == 4 and all(type(v) is int and v >= 0 for v in memfd)):
            raise TransportError(f"local: remote region {i}: malformed memfd field {memfd!r:.80}")
        fd, ino, offset, size = memfd
        if offset + nbytes > size:
            raise TransportError(f"local: remote region {i} lies outside its host buffer")
        if (fd, ino) not in peer.maps:
            try:
                f = os.open(f"/proc/{peer.pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise TransportError(
                    f"local: cannot open host buffer fd {fd} of {peer.label} ({e}): the kernel's "
                    f"ptrace access check failed; use the tcp transport"
                ) from e
            try:
                st = os.fstat(f)
                seals = fcntl.fcntl(f, fcntl.F_GET_SEALS)
                if st.st_ino != ino or st.st_size != size or seals & _SEALS != _SEALS:
                    raise TransportError(
                        f"local: fd {fd} of {peer.label} is not the sealed host buffer its descriptor names"
                    )
                addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | MAP_POPULATE, f, 0)
                if addr in (None, MAP_FAILED):
                    raise TransportError(
                        f"local: cannot map host buffer of {peer.label}: {os.strerror(ctypes.get_errno())}"
                    )
            finally:
                os.close(f)
            peer.maps[(fd, ino)] = (addr, size)
        return peer.maps[(fd, ino)][0] + offset

    def read(self, prepared: LocalPrepared, *, timeout: float) -> None:
        peer = prepared.peer
        deadline = time.monotonic() + timeout
        with peer_lock("local", peer, timeout):
            if not peer.alive():
                raise TransportError(f"local: peer {peer.label} exited")
            prepared.copies.run()
            if len(prepared.local_iov):
                vm_read(peer.pid, prepared.local_iov, prepared.remote_iov, deadline)
            # A mapping outlives the publisher: bytes copied from a dead peer are not a completed read.
            if not peer.alive():
                raise TransportError(f"local: peer {peer.label} exited during the read")
        if time.monotonic() > deadline:
            raise TransportError(f"local: read from {peer.label} took longer than {timeout}s")

    def disconnect(self, peer: LocalPeer) -> None:
        with peer.lock, self._lock:
            if peer.closed:
                return
            peer.closed = True
            self._peers.discard(peer)
            maps, peer.maps = peer.maps, {}
            for addr, size in maps.values():
                _libc.munmap(addr, size)
            os.close(peer.pidfd)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, buffers = list(self._peers), self._buffers
            self._buffers, self._regions = [], {}
        for p in peers:
            self.disconnect(p)
        for b in buffers:
            try:
                b.mm.close()
            except BufferError:
                pass  # still viewed by the caller (numpy); the mapping goes when the last view does
            os.close(b.fd)

    def __repr__(self) -> str:
        return (
            f"LocalTransport(pid={os.getpid()}, method={self.method}, regions={len(self._regions)}, "
            f"host_buffers={len(self._buffers)}, peers={len(self._peers)}, closed={self._closed})"
        )
