"""Packing keys: how reader layouts and packed slot layouts are named and stored.

A subscriber announces its layout under a key named by the layout's hash (``Keys.reader_layout``);
a publisher rank stores each packing generation's slot layout under ``Keys.packed(epoch, rank, gen)``
and the generation each version was copied with under ``Keys.packing(v, rank)``, which the
committing rank copies into the version record (``wbridge.publish.packing`` packs; ``wbridge.pull``
plans against them)."""

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


def packing_gens(chan: ChannelStore, v: int, world_size: int) -> tuple[int, ...]:
    """The packing generation of every publisher rank's slot for version ``v`` (0 where a rank
    recorded none), read by the rank that commits ``v`` into its version record."""
    names = [chan.keys.packing(v, r) for r in range(world_size)]
    gens = []
    for key, raw in zip(names, chan.store.get_many(names)):
        gens.append(int(chan.open(key, raw)["gen"]) if raw is not None else 0)
    return tuple(gens)


def packed_layout(chan: ChannelStore, epoch: int, rank: int, gen: int) -> RankLayout:
    """The slot layout of packing generation ``gen`` of publisher rank ``rank``."""
    d = chan.read(chan.keys.packed(epoch, rank, gen))
    if d is None:
        raise StoreError(f"publisher rank {rank}: packed slot layout {gen} of epoch {epoch} is missing")
    return RankLayout.from_dict(d)


__all__ = ["announce", "layout_hash", "packed_layout", "packing_gens"]
