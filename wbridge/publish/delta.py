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

The scan is one pass over the two slots as 4-byte pairs, block by block on the host: their
byte-wise difference, a mask of the changed pairs (packed into the positions bitmap as it goes),
its set indices, and a gather of just those pairs' differences (``scan``; on a GPU the same in
torch, only the changed pairs come to the host); the coding then works on the changed pairs alone
(``protocol.delta.encode``). The header
says ``WRITING`` while the buffer is rewritten and ``NONE`` where the version has no delta (no base,
or more changes than the buffer holds: readers then pull in full).
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
    """

    buffers: list[Any]
    geo: Geometry
    regions: dict[str, list[Any]] = field(default_factory=dict)
    work: _format.Workspace = field(default_factory=_format.Workspace, repr=False)
    held: dict[int, Staged] = field(default_factory=dict)
    scratch: Any = None

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
        return self.buffers[i][:HEADER_BYTES].numpy().view(np.uint64)

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
        found = scan(prev, cur, self.geo.capacity * 2, self.work)
        if found is None:  # more changed pairs than 4 bits each fit
            head[3] = DELTA_NONE
            return none
        coded = _format.encode(found.at, found.diffs, self.geo, self.work, found.bitmap)
        if coded.nbytes > self.geo.capacity:
            head[3] = DELTA_NONE
            return none
        _format.write(self.buffers[i].numpy(), coded)
        head[3] = DELTA_STABLE  # last: the header says "stable" only once every byte is in place
        return Encoding(coded.pairs, coded.nbytes, time.thread_time() - t0)


SCAN_BLOCK = 1 << 20  # pairs compared at a time (4 MiB of each slot): temporaries stay small


@dataclass(frozen=True)
class Changes:
    """What ``scan`` found: the changed pairs' indices (ascending, int64), their byte differences
    ``cur - prev`` (uint8 ``[n, 4]``), and, from a host scan, the bitmap of the changed pairs
    (uint8, a bit per pair of the slot, little-endian): views of the workspace."""

    at: np.ndarray
    diffs: np.ndarray
    bitmap: np.ndarray | None


def scan(prev: Any, cur: Any, most: int, ws: _format.Workspace | None = None) -> Changes | None:
    """The pairs (4 bytes) where ``cur`` differs from ``prev`` (uint8 tensors of one size); None
    where more than ``most`` changed. A short last pair is compared padded with zeros. On the host,
    block by block (``SCAN_BLOCK`` pairs): the byte-wise difference of the two slots, a mask of
    its non-zero 32-bit words (packed into the bitmap as well), the mask's set indices (8-pair
    groups first where few are set: ``protocol.delta.nonzero``), then a gather of just those
    pairs' differences (torch's gather: twice numpy's take here). One difference and one gather
    cost less than a compare and a gather from each slot."""
    import torch

    ws = ws or _format.Workspace()
    size = int(cur.numel())
    whole = size // PAIR * PAIR
    full, pairs = whole // PAIR, -(-size // PAIR)
    short = whole < size and bool(torch.any(prev[whole:] != cur[whole:]))
    if cur.device.type == "cpu":
        a, b = prev.numpy(), cur.numpy()
        bitmap = ws.get("scan.bitmap", -(-pairs // 8), np.uint8)
        n = 0
        for s in range(0, full, SCAN_BLOCK):
            e = min(s + SCAN_BLOCK, full)
            d = ws.get("scan.d", PAIR * (e - s), np.uint8)
            np.subtract(b[PAIR * s : PAIR * e], a[PAIR * s : PAIR * e], out=d)
            mask = ws.mask("scan.mask", e - s)
            np.not_equal(d.view(np.uint32), 0, out=mask[: e - s])
            bitmap[s // 8 : -(-e // 8)] = np.packbits(mask[: e - s], bitorder="little")
            got = _format.nonzero(mask, ws, "scan")
            k = len(got)
            if n + k + short > most:
                return None
            # (straight into the arrays the coding reads: no list of pieces to concatenate)
            at = ws.get("scan.found", n + k + 1, np.int64, keep=n)
            diffs = ws.get("scan.values", n + k + 1, np.uint32, keep=n)
            np.add(got, s, out=at[n : n + k])
            out = torch.from_numpy(diffs[n : n + k].view(np.int32))
            torch.index_select(torch.from_numpy(d.view(np.int32)), 0, torch.from_numpy(got), out=out)
            n += k
        if pairs > full and full % 8 == 0:
            bitmap[full // 8] = 0  # (the short last pair's byte: no block packed it)
        if short:
            bitmap[full // 8] |= np.uint8(1 << (full % 8))
        at = ws.get("scan.found", n + 1, np.int64, keep=n)
        diffs = ws.get("scan.values", n + 1, np.uint32, keep=n).view(np.uint8)
        at[n] = full
        n += short
        at, diffs = at[:n], diffs[: PAIR * n]
    else:  # on the GPU: the same ops in torch, only the changed pairs come to the host
        a4, b4 = prev[:whole].view(torch.int32), cur[:whole].view(torch.int32)
        found = torch.nonzero(a4 != b4).squeeze(1)
        n = int(found.numel()) + short
        if n > most:
            return None
        rows_a, rows_b = prev[:whole].view(-1, PAIR), cur[:whole].view(-1, PAIR)
        at = np.append(found.cpu().numpy(), [full] * short).astype(np.int64)
        diffs = np.zeros(4 * n, np.uint8)
        diffs[: 4 * (n - short)] = (rows_b[found] - rows_a[found]).cpu().numpy().reshape(-1)
        bitmap = None
    if short:  # the slot's short last pair
        ta, tb = np.zeros(PAIR, np.uint8), np.zeros(PAIR, np.uint8)
        ta[: size - whole] = prev[whole:].cpu().numpy()
        tb[: size - whole] = cur[whole:].cpu().numpy()
        diffs[4 * (n - 1) :] = tb - ta
    return Changes(at, diffs.reshape(n, PAIR), bitmap)


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
