"""Delta updates, publisher side: the on-wire format of a version's delta and its encoding.

A publisher with ``delta=True`` keeps a ring of ``k`` delta buffers in registered memory next to its
staging slots. After version ``v`` is snapshotted into slot ``v % slots``, and when the slot of
``v - 1`` still holds ``v - 1`` of the same registration, it compares the two staging slots (never
the live tensors: the trainer's stall does not grow) as 2-byte words and writes what changed into
buffer ``v % k``, in ``v``'s slot byte order. Where ``v - 1`` was packed for other readers (another
packing generation), its bytes are first moved to where ``v``'s packing holds them (``remap``):
a new reader layout, a repack, a late joiner or a rejoin costs no subscriber its base. The chunk
checksums of every staged slot are cut at its cells (``protocol.checksum.slot_sums``), so a reader
packed for verifies whole chunks only. Layout of one delta buffer (native byte order)::

    header   8 x uint64   magic, version v, base v - 1, state, epoch, packing gen of v, nchunks, nentries
    table    uint32[nchunks + 1] at byte 64: entries of chunk c are [table[c], table[c + 1])
    entries  uint32 at byte ``entries_at``: word index within its chunk (low 16 bits) | new word << 16

A chunk is ``CHUNK_WORDS`` 2-byte words of the slot, so a reader slices the entries by the chunks
its own reads cover and reads nothing of other readers' changes. The header says ``WRITING`` while
the buffer is rewritten and ``NONE`` where the version has no delta (no base, or more changes than
the buffer holds: readers then pull in full); readers read it before and after the entries (a
seqlock, like the slot stamps). Encoding is vectorised: one compare, ``nonzero``, ``bincount``,
``cumsum`` (numpy on the host, torch on a GPU).
"""

from __future__ import annotations

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
from ..protocol.delta import (
    CHUNK_WORDS,
    DELTA_MAGIC,
    DELTA_NONE,
    DELTA_STABLE,
    DELTA_WRITING,
    HEADER_BYTES,
    geometry,
    table_bytes,
)


@dataclass
class DeltaRing:
    """The ``k`` delta buffers of one registration, their served regions, and which version (and
    packing generation) each staging slot holds, so ``v``'s delta is encoded only from ``v - 1``."""

    buffers: list[Any]  # torch uint8 host buffers, one per ring position
    nchunks: int
    capacity: int
    regions: dict[str, list[Any]] = field(default_factory=dict)  # transport -> ring position -> region
    held: dict[int, tuple[int, int, Any]] = field(default_factory=dict)  # slot -> (version, packing gen, layout)
    scratch: Any = None  # the previous slot remapped to a new packing (``remap``)

    @property
    def entries_at(self) -> int:
        return table_bytes(self.nchunks)

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
    ) -> int:
        """Encodes ``v`` (in slot ``v % nslots``, laid out as ``layout``: packing generation
        ``gen``) against ``v - 1`` into ring buffer ``v % k``, in ``v``'s slot byte order; returns
        the number of changed words (-1: no delta for ``v``, readers pull in full). Where ``v - 1``
        was packed for other readers (another generation), its bytes are first moved to where
        ``v``'s packing holds them (``remap``), so a new reader layout costs no one their base."""
        slot = v % nslots
        base = self.held.get((v - 1) % nslots) if nslots >= 2 else None
        self.held[slot] = (v, gen, layout)
        i = v % len(self.buffers)
        head = self.header(i)
        head[:] = (DELTA_MAGIC, v, v - 1, DELTA_WRITING, epoch, gen, self.nchunks, 0)
        if base is None or base[0] != v - 1:
            head[3] = DELTA_NONE
            return -1
        prev, cur = slots[(v - 1) % nslots][0], slots[slot][0]
        if base[1] != gen:
            prev = self.remap(prev, cur, base[2], layout)
            if prev is None:
                head[3] = DELTA_NONE
                return -1
        even = int(cur.numel()) // 2 * 2
        if even != int(cur.numel()) and bool(prev[-1] != cur[-1]):  # the odd last byte: in no word
            head[3] = DELTA_NONE
            return -1
        prev, cur = prev[:even], cur[:even]
        if cur.device.type == "cpu":
            a, b = prev.numpy().view(np.uint16), cur.numpy().view(np.uint16)
            idx = np.flatnonzero(a != b)
            if len(idx) > self.capacity:
                head[3] = DELTA_NONE
                return -1
            counts = np.bincount(idx >> 12, minlength=self.nchunks)
            entries = (idx & (CHUNK_WORDS - 1)).astype(np.uint32) | (b[idx].astype(np.uint32) << 16)
        else:  # on the GPU: the same ops in torch, only the (small) result comes to the host
            import torch

            a, b = prev.view(torch.int16), cur.view(torch.int16)
            idx = torch.nonzero(a != b).squeeze(1)
            if int(idx.numel()) > self.capacity:
                head[3] = DELTA_NONE
                return -1
            counts = torch.bincount(idx >> 12, minlength=self.nchunks).cpu().numpy()
            words = (b[idx].to(torch.int32) & 0xFFFF) << 16
            entries = (words | (idx & (CHUNK_WORDS - 1)).to(torch.int32)).cpu().numpy().view(np.uint32)
        n = len(entries)
        buf = self.buffers[i].numpy()
        table = buf[HEADER_BYTES : HEADER_BYTES + 4 * (self.nchunks + 1)].view(np.uint32)
        table[0] = 0
        np.cumsum(counts, out=table[1:])
        at = self.entries_at
        buf[at : at + 4 * n].view(np.uint32)[:] = entries
        head[7] = n
        head[3] = DELTA_STABLE  # last: the header says "stable" only once every byte is in place
        return n


def build_ring(
    transports: Mapping[str, Any], slot_bytes: int, k: int, old: DeltaRing | None, staging_buffer: Any
) -> DeltaRing | None:
    """The delta ring of a registration whose slots are ``slot_bytes``, registered with every
    served transport (``old``'s buffers reused where they fit); None where no delta can exist."""
    geo = geometry(slot_bytes)
    if geo is None:
        return None
    nchunks, capacity = geo
    size = table_bytes(nchunks) + 4 * capacity
    if old is not None and len(old.buffers) == k and all(int(b.numel()) == size for b in old.buffers):
        buffers = old.buffers
    else:
        buffers = [staging_buffer(transports, size, "cpu") for _ in range(k)]
    ring = DeltaRing(buffers, nchunks, capacity)
    for i in range(k):
        ring.header(i)[:] = (DELTA_MAGIC, 0, 0, DELTA_NONE, 0, 0, nchunks, 0)
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


__all__ = ["DeltaRing", "build_ring", "release_ring"]
