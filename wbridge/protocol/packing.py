"""Packing keys: how reader layouts and packed slot layouts are named and stored.

A subscriber announces its layout under a key named by the layout's hash (``Keys.reader_layout``);
a publisher rank stores each packing generation's slot layout under ``Keys.packed(epoch, rank, gen)``
and the generation each version was copied with in its part of the version (``version.RankPart``),
which the committing rank copies into the version record with the slot layout's hash
(``wbridge.publish.packing`` packs; ``wbridge.pull`` plans against them and checks the hashes)."""

from __future__ import annotations

import hashlib
import json

from planner.layout import RankLayout

from ..errors import StoreError
from .channel import ChannelStore


def layout_hash(layout: RankLayout) -> str:
    """A content hash of a layout, its rank aside: identical layouts hash alike."""
    d = layout.to_dict()
    d["rank"] = 0
    return hashlib.sha256(json.dumps(d, separators=(",", ":")).encode()).hexdigest()[:32]


def announce(chan: ChannelStore, layout: RankLayout) -> str:
    """Stores ``layout`` under its hash unless already there; returns the hash."""
    h = layout_hash(layout)
    key = chan.keys.reader_layout(h)
    if chan.store.get(key) is None:
        chan.write(key, layout.to_dict())
    return h


def packed_layout(chan: ChannelStore, epoch: int, rank: int, gen: int) -> RankLayout:
    """The slot layout of packing generation ``gen`` of publisher rank ``rank``."""
    d = chan.read(chan.keys.packed(epoch, rank, gen))
    if d is None:
        raise StoreError(f"publisher rank {rank}: packed slot layout {gen} of epoch {epoch} is missing")
    return RankLayout.from_dict(d)


__all__ = ["announce", "layout_hash", "packed_layout"]
