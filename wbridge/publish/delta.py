"""Delta updates, publisher side: the ring of delta buffers and the scan that fills them.

A publisher with ``Staging(delta=Delta(history=k))`` keeps a ring of ``k`` delta buffers in
registered memory next to its staging slots. After version ``v`` is snapshotted into slot
``v % slots``, and when the slot of ``v - 1`` still holds ``v - 1`` of the same registration, it
compares the two staging slots (never the live tensors: the trainer's stall does not grow) and
writes what changed into buffer ``v % k``, in ``v``'s slot byte order, coded as
``wbridge.protocol.delta`` says (the format and its codec live there). Where ``v - 1`` was packed
for other readers (another packing generation), its bytes are first moved to where ``v``'s packing
holds them (``remap``): a new reader layout, a repack, a late joiner or a rejoin costs no
subscriber its base. The chunk checksums of every staged slot are cut at its cells
(``wbridge.protocol.checksum.slot_sums``), so a reader packed for verifies whole chunks only.

On the host the scan and the coding are one compiled pass over the two slots as 4-byte pairs
(each changed pair's index, code byte ``k`` and raw bytes stored as it compares), then passes
over the changed pairs alone (``protocol.delta.encode_slots``); on a GPU the scan is torch
(``scan``: only the changed pairs come to the host) and the coding the same passes after the
codes of their byte differences (``protocol.delta.encode``). The slots are staged in huge pages
where the kernel allows them (``_tensors.alloc_bytes``): the scan walks 20 MB per 10 MB slot.
The header says ``WRITING`` while the buffer is rewritten and ``NONE`` where the version has no
delta (no base, or more changes than the buffer holds: readers then pull in full).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.builder import build_plan
from planner.errors import PlanError
from planner.layout import RankLayout
from transports._copy import CopyPlan

from .._lifecycle import quietly
from .._tensors import address, alloc_bytes
from ..protocol import delta as _format
from ..protocol.delta import (
    DELTA_MAGIC,
    DELTA_NONE,
    DELTA_STABLE,
    DELTA_WRITING,
    HEADER_BYTES,
    PAIR,
    Geometry,
    geometry,
)


@dataclass(frozen=True)
class Encoding:
    """What one ``DeltaRing.encode`` did: changed pairs (-1: no delta for the version, readers pull
    in full), bytes of the coded streams, and the CPU seconds the scan and coding took on the
    calling thread (one core's time: a loaded host's waits for a core are not in it)."""

    pairs: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Staged:
    """What one staging slot holds: its version, packing generation and slot layout."""

    v: int
    gen: int
    layout: RankLayout | None


@dataclass
class DeltaRing:
    """The ``k`` delta buffers of one registration, their served regions, and which version (and
    packing generation) each staging slot holds, so ``v``'s delta is encoded only from ``v - 1``.

    - ``buffers``: torch uint8 host buffers, one per ring position (``geo.buffer_bytes`` each).
    - ``geo``: the delta geometry of the registration's slots (``protocol.delta.geometry``).
    - ``regions``: transport name -> ring position -> registered region.
    - ``work``: the arrays the scan and the coding reuse from version to version.
    - ``held``: staging slot -> what it holds (``Staged``).
    - ``scratch``: the previous slot remapped to a new packing (``remap``), once the packing changed.
    - ``extents``: per ring position, the bytes its delta fills from the buffer's start (header,
      tables and streams; 0: none). A version's record carries them (``protocol.version``), so a
      reader of whole slots reads each delta it needs in one read of exactly those bytes.

    Numpy views of the buffers and of the host slots it encodes from are made once and kept: the
    encode runs right after the snapshot's copy has evicted every cache, where each torch call to
    make a view cost tens of microseconds.
    """

    buffers: list[Any]
    geo: Geometry
    regions: dict[str, list[Any]] = field(default_factory=dict)
    work: _format.Workspace = field(default_factory=_format.Workspace, repr=False)
    held: dict[int, Staged] = field(default_factory=dict)
    scratch: Any = None
    extents: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.extents = [0] * len(self.buffers)
        self._arrays = [b.numpy() for b in self.buffers]
        self._heads = [a[:HEADER_BYTES].view(np.uint64) for a in self._arrays]
        self._views: dict[int, tuple[Any, np.ndarray | None]] = {}  # id of a slot -> (slot, ``_host(slot)``)

    def _host(self, t: Any) -> np.ndarray | None:
        """The numpy view of slot ``t`` where it is host memory, else None (a GPU's); made once (kept
        with ``t``, so its id stays its own)."""
        kept = self._views.get(id(t))
        if kept is None or kept[0] is not t:
            if len(self._views) >= 8:  # (a new registration's slots, or remap scratch: drop the old)
                self._views.clear()
            kept = self._views[id(t)] = (t, t.numpy() if t.device.type == "cpu" else None)
        return kept[1]

    def remap(self, prev: Any, cur: Any, was: RankLayout | None, now: RankLayout | None) -> Any:
        """``prev`` (a slot laid out as ``was``) with its bytes moved to where ``now`` holds them,
        in a scratch buffer whose other bytes are ``cur``'s; None where that cannot be done (a slot
        on a GPU, a layout unknown or not plannable). Runs once per change of packing."""
        if was is None or now is None or cur.device.type != "cpu":
            return None
        try:
            plan = build_plan([was], now)
        except PlanError:
            return None
        if self.scratch is None or int(self.scratch.numel()) != int(cur.numel()):
            self.scratch = alloc_bytes(int(cur.numel()), "cpu")
        scratch = self.scratch
        scratch.copy_(cur)
        ops = [s for s in plan.sources if len(s)]
        if any(np.any(s.src_region != 0) or np.any(s.dst_region != 0) for s in ops):
            return None
        if ops:
            src = np.concatenate([s.src_offset for s in ops]) + address(prev)
            dst = np.concatenate([s.dst_offset for s in ops]) + address(scratch)
            CopyPlan.of(dst, src, np.concatenate([s.nbytes for s in ops])).run()
        return scratch

    def header(self, i: int) -> np.ndarray:
        return self._heads[i]

    def encode(
        self, slots: list[Any], v: int, nslots: int, epoch: int, gen: int, layout: RankLayout | None = None
    ) -> Encoding:
        """Encodes ``v`` (in slot ``v % nslots``, laid out as ``layout``: packing generation
        ``gen``) against ``v - 1`` into ring buffer ``v % k``, in ``v``'s slot byte order. Where
        ``v - 1`` was packed for other readers (another generation), its bytes are first moved to
        where ``v``'s packing holds them (``remap``), so a new reader layout costs no one their base."""
        t0 = time.thread_time()
        slot = v % nslots
        base = self.held.get((v - 1) % nslots) if nslots >= 2 else None
        self.held[slot] = Staged(v, gen, layout)
        i = v % len(self.buffers)
        head = self.header(i)
        self.extents[i] = 0
        head[:] = 0
        head[:8] = (DELTA_MAGIC, v, v - 1, DELTA_WRITING, epoch, gen, self.geo.nchunks, 0)
        none = Encoding(-1, 0, 0.0)
        if base is None or base.v != v - 1:
            head[3] = DELTA_NONE
            return none
        prev, cur = slots[(v - 1) % nslots][0], slots[slot][0]
        if base.gen != gen:
            prev = self.remap(prev, cur, base.layout, layout)
            if prev is None:
                head[3] = DELTA_NONE
                return none
        most = self.geo.capacity * 2  # (more changed pairs than 4 bits each fit: no delta)
        host = self._host(cur)
        if host is not None:
            coded = _format.encode_slots(self._host(prev), host, self.geo, most, self.work)
        else:
            found = scan(prev, cur, most)
            coded = None if found is None else _format.encode(found.at, found.diffs, self.geo, self.work)
        if coded is None:
            head[3] = DELTA_NONE
            return none
        if coded.nbytes > self.geo.capacity:
            head[3] = DELTA_NONE
            return none
        self.extents[i] = _format.write(self._arrays[i], coded)
        head[3] = DELTA_STABLE  # last: the header says "stable" only once every byte is in place
        return Encoding(coded.pairs, coded.nbytes, time.thread_time() - t0)


@dataclass(frozen=True)
class Changes:
    """What ``scan`` found: the changed pairs' indices (ascending, int64) and their byte
    differences ``cur - prev`` (uint8 ``[n, 4]``)."""

    at: np.ndarray
    diffs: np.ndarray


def scan(prev: Any, cur: Any, most: int) -> Changes | None:
    """The pairs (4 bytes) where ``cur`` differs from ``prev`` (uint8 tensors of one size, on any
    device), in torch: only the changed pairs come to the host. None where more than ``most``
    changed. A short last pair is compared padded with zeros. (A host ring codes its slots in one
    compiled pass instead: ``protocol.delta.encode_slots``.)"""
    import torch

    size = int(cur.numel())
    whole = size // PAIR * PAIR
    full = whole // PAIR
    short = whole < size and bool(torch.any(prev[whole:] != cur[whole:]))
    a4, b4 = prev[:whole].view(torch.int32), cur[:whole].view(torch.int32)
    found = torch.nonzero(a4 != b4).squeeze(1)
    n = int(found.numel()) + short
    if n > most:
        return None
    rows_a, rows_b = prev[:whole].view(-1, PAIR), cur[:whole].view(-1, PAIR)
    at = np.append(found.cpu().numpy(), [full] * short).astype(np.int64)
    diffs = np.zeros(4 * n, np.uint8)
    diffs[: 4 * (n - short)] = (rows_b[found] - rows_a[found]).cpu().numpy().reshape(-1)
    if short:  # the slot's short last pair
        ta, tb = np.zeros(PAIR, np.uint8), np.zeros(PAIR, np.uint8)
        ta[: size - whole] = prev[whole:].cpu().numpy()
        tb[: size - whole] = cur[whole:].cpu().numpy()
        diffs[4 * (n - 1) :] = tb - ta
    return Changes(at, diffs.reshape(n, PAIR))


def build_ring(
    transports: Mapping[str, Any], slot_bytes: int, k: int, old: DeltaRing | None, staging_buffer: Any
) -> DeltaRing | None:
    """The delta ring of a registration whose slots are ``slot_bytes``, registered with every
    served transport (``old``'s buffers reused where they fit); None where no delta can exist."""
    geo = geometry(slot_bytes)
    if geo is None:
        return None
    size = geo.buffer_bytes
    if old is not None and len(old.buffers) == k and all(int(b.numel()) == size for b in old.buffers):
        buffers = old.buffers
    else:
        buffers = [staging_buffer(transports, size, "cpu") for _ in range(k)]
    ring = DeltaRing(buffers, geo)
    for i in range(k):
        ring.header(i)[:] = 0
        ring.header(i)[:8] = (DELTA_MAGIC, 0, 0, DELTA_NONE, 0, 0, geo.nchunks, 0)
    try:
        for name, t in transports.items():
            ring.regions[name] = [t.register(address(b), int(b.numel()), device="cpu") for b in buffers]
    except BaseException:
        release_ring(ring, transports)
        raise
    return ring


def release_ring(ring: DeltaRing | None, transports: Mapping[str, Any]) -> None:
    if ring is None:
        return
    regions, ring.regions = ring.regions, {}
    for name, per in regions.items():
        for r in per:
            quietly(transports[name].deregister, r)


__all__ = ["Changes", "DeltaRing", "Encoding", "build_ring", "release_ring", "scan"]
