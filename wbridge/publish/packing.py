"""Reader-ordered staging slots (``planner.packing``) in the runtime.

Subscribers announce their layout once per distinct layout: the layout is stored under a key named
by its hash (``Keys.reader_layout``) and the subscriber record carries only the hash. At each
snapshot a staged publisher rank packs its slot for the distinct layouts of the live subscribers
(``SlotPacker.choose``): a new set of layouts gets a new *packing generation*, whose slot layout is
stored under ``Keys.packed(epoch, rank, gen)``; generation 0 is the plain slot. Each rank records
the generation every version was copied with in its part of the version (``RankPart``) before it
counts its snapshot, and the rank that commits ``v`` copies them into the version record, so a subscriber
reading version ``v`` plans against exactly the layouts of ``v``'s slots, and re-plans only when a
generation changes. A subscriber that joins later is packed for
from the next snapshot on; until then it plans ordinary reads against the current slot layout,
which holds every mapped byte.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner.layout import RankLayout
from planner.packing import ALIGN, PackedStaging, check_boxes, pack_staging
from transports._copy import run_chunks, serial_chunks

from .._tensors import byte_view
from ..protocol.channel import ChannelStore
from ..protocol.packing import layout_hash


class SlotPacker:
    """Publisher side: the packed slot layout for each set of reader layouts, one generation each.

    ``chan``: the channel's store, keys (of the generation joined) and token.
    ``layout``: the publisher rank's plain (packed-in-order) staging layout.
    ``slot_bytes``: the size of each staging slot; a packing that does not fit is not used.
    """

    def __init__(self, chan: ChannelStore, layout: RankLayout, slot_bytes: int) -> None:
        self.chan, self.keys = chan, chan.keys
        self.layout = layout
        self.slot_bytes = slot_bytes
        self.gen = 0
        self._by_readers: dict[tuple[str, ...], tuple[int, PackedStaging | None]] = {(): (0, None)}
        self._readers: dict[str, RankLayout | None] = {}

    def _reader(self, h: str) -> RankLayout | None:
        if h not in self._readers:
            key = self.keys.reader_layout(h)
            raw = self.chan.store.get(key)
            try:
                lay = RankLayout.from_dict(self.chan.open(key, raw)) if raw is not None else None
            except Exception:  # noqa: BLE001 - a forged or malformed announcement packs nothing
                lay = None
            self._readers[h] = lay if lay is not None and layout_hash(lay) == h else None
        return self._readers[h]

    def choose(self, epoch: int, rank: int, hashes: list[str]) -> tuple[int, PackedStaging | None]:
        """The generation and packing for the reader layouts ``hashes`` (``(0, None)``: plain)."""
        key = tuple(sorted(set(hashes)))
        got = self._by_readers.get(key)
        if got is not None:
            return got
        readers = [r for r in (self._reader(h) for h in key) if r is not None]
        got = (0, None)
        if readers:
            for align in (ALIGN, 1):
                ps = pack_staging(self.layout, readers, align=align)
                if ps.identity:
                    break
                if (ps.layout.region_sizes[0] if ps.layout.region_sizes else 0) <= self.slot_bytes:
                    self.gen += 1
                    rec_key = self.keys.packed(epoch, rank, self.gen)
                    self.chan.write(rec_key, ps.layout.to_dict())
                    got = (self.gen, ps)
                    break
        self._by_readers[key] = got
        return got


class PackedCopy:
    """The snapshot copy of a packed slot, its views made once: a publisher keeps one per slot
    and runs it at every snapshot while the packing stays (``wbridge.publish.staging.snapshot``).

    ``ps``: the packing (its ``copies`` are the program). ``live``: the publisher's live tensors,
    in layout order. ``slot``: the slot's flat ``torch.uint8`` buffer.

    On CPU a cell that is one run on both sides (a tensor stored verbatim, a block of whole rows)
    is one ``memcpy`` (numpy), as the plain snapshot copies; a strided cell (a column strip) is
    torch's vectorised copy on this thread (``transports._copy.serial_chunks``: as fast as numpy's
    ``memmove`` per row for 1-3 KiB rows here, faster for shorter ones), its chunks ordered by
    source address so that the strips cut from the same source rows read them while cached.
    On a GPU: one torch view copy per cell, queued on the current stream (``copy_torch``).
    """

    def __init__(self, ps: PackedStaging, live: list[Any], slot: Any) -> None:
        self.ps = ps
        srcs = [byte_view(t) for t in live]
        self._gpu = (srcs, slot) if slot.device.type != "cpu" else None
        self._flat: list[tuple[np.ndarray, np.ndarray]] = []
        self._chunks: list[tuple[Any, Any]] = []
        if self._gpu is not None:
            return
        check_boxes(ps.copies, [int(t.numel()) for t in srcs], [int(slot.numel())])
        np_srcs, np_slot = [t.numpy() for t in srcs], slot.numpy()
        for sr, so, _, do, run, shape, ss, ds in ps.copies.rows():
            if all(n == 1 for n in shape):
                self._flat.append((np_slot[do : do + run], np_srcs[sr][so : so + run]))
            else:
                src = srcs[sr]
                self._chunks += serial_chunks(
                    slot.as_strided((*shape, run), (*ds, 1), slot.storage_offset() + do),
                    src.as_strided((*shape, run), (*ss, 1), src.storage_offset() + so),
                )
        self._chunks.sort(key=lambda c: c[1].data_ptr())

    def run(self) -> None:
        """Makes every copy of the program."""
        if self._gpu is not None:
            copy_torch(self.ps, *self._gpu)
            return
        for dst, src in self._flat:
            np.copyto(dst, src)
        run_chunks(self._chunks)


def copy_packed(ps: PackedStaging, live: list[Any], slot: Any) -> None:
    """The snapshot copy of a packed slot, once (``PackedCopy``, whose views a publisher keeps)."""
    PackedCopy(ps, live, slot).run()


def copy_torch(ps: PackedStaging, srcs: list[Any], slot: Any) -> None:
    """``copy_packed`` with torch strided views (any device): ``srcs`` are flat uint8 tensors."""
    for sr, so, _, do, run, shape, ss, ds in ps.copies.rows():
        src = srcs[sr]
        # as_strided offsets count from the storage's start, not the view's
        dst = slot.as_strided((*shape, run), (*ds, 1), slot.storage_offset() + do)
        dst.copy_(src.as_strided((*shape, run), (*ss, 1), src.storage_offset() + so), non_blocking=True)
