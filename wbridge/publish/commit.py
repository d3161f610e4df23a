"""Committing one version: what ``Publisher.publish()`` runs once its waits are over, in order.

1. ``snapshot``: bumps the slot's fence (readers of its old content fail their fence check), marks
   the slot's stamp ``WRITING``, copies the live tensors in (``staging.snapshot``: the trainer's
   stall), marks it ``STABLE``. Outside the stall: the delta against the version before
   (``delta``) and the slot's chunk checksums (``protocol.checksum.slot_sums``), bound to the
   version, the rank's incarnation and the slot layout (``protocol.checksum.bind``).
2. ``commit``: writes the rank's part of the version (``protocol.version.RankPart``) and its
   checksum record, then counts its snapshot; the rank that brings the count to ``world_size``
   reads every rank's part (a missing one is a ``StoreError``: nothing is committed from a guess),
   writes the version record and its ``ready`` key, and collects the keys of an old version.
3. ``fence_off`` (zero copy): once ``publish()`` returns, the trainer mutates the live tensors, so
   the version served from them is fenced off.

The stages get a ``Committer`` (the channel's store and what the rank's options fix), never the
publisher.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._lifecycle import quietly
from ..protocol import checksum as _checksum
from ..protocol.channel import ChannelStore
from ..protocol.packing import layout_hash
from ..protocol.stamps import STAMP_STABLE, STAMP_WRITING
from ..protocol.version import RankPart, VersionRecord
from .staging import Registration
from .staging import snapshot as copy_slot
from .tracker import now


@dataclass(frozen=True)
class Committer:
    """What the commit stages of one publisher rank need.

    - ``chan``: the channel's store, keys (of the generation registered in) and token.
    - ``rank``, ``world_size``: this rank among the channel's publisher ranks.
    - ``nslots``: staging slots versions rotate through.
    - ``checksums``: publish chunk checksums of each version.
    - ``zero_copy``: the slots are the live tensors (``ZeroCopy``).
    - ``mode``: the sync mode's name, recorded in the version record.
    """

    chan: ChannelStore
    rank: int
    world_size: int
    nslots: int
    checksums: bool
    zero_copy: bool
    mode: str


@dataclass(frozen=True)
class Snapshot:
    """What ``snapshot`` made of version ``v``: its slot, the rank's part of it, its checksum
    record (None: none kept), and the seconds of the copy (the stall) and of the work after it
    (delta and checksums), and the CPU seconds of the delta's encoding alone."""

    v: int
    slot: int
    part: RankPart
    sums: dict | None
    copy_s: float
    seal_s: float
    encode_s: float = 0.0


def snapshot(
    c: Committer,
    reg: Registration,
    v: int,
    ready: Any,
    packing: tuple[int, Any],
    lock: threading.Lock,
    check_stopped: Callable[[int], None],
) -> Snapshot:
    """Copies version ``v`` into its slot with ``packing`` (``(generation, PackedStaging or
    None)``) under ``lock`` (held while slots are written; ``check_stopped(v)`` raises if the
    publisher closed), then encodes its delta and checksums outside the stall."""
    slot = v % c.nslots
    gen, packed = packing
    t0 = time.perf_counter()
    c.chan.store.add(c.chan.keys.fence(slot), 1)  # readers of the old content of `slot` fail their fence check
    stamp = reg.stamps[slot].numpy().view(np.uint64)
    slot_layout = packed.layout if packed is not None else reg.layout
    with lock:  # close() releases the slots only between snapshots
        check_stopped(v)
        stamp[1:] = (v, STAMP_WRITING, reg.epoch)  # before the first byte of the slot changes
        copy_slot(reg, slot, ready, packed)
        stamp[1:] = (v, STAMP_STABLE, reg.epoch)
        t1 = time.perf_counter()
        # both read the staging slot only: after the trainer's stall
        encode_s = 0.0
        if reg.delta is not None:
            encode_s = reg.delta.encode(reg.slots, v, c.nslots, reg.epoch, gen, slot_layout).seconds
        buffers = reg.slots[0] if reg.zero_copy else reg.slots[slot]
        sums = _checksum.slot_sums(buffers, slot_layout) if c.checksums else None
    if gen not in reg.layout_hashes:
        reg.layout_hashes[gen] = layout_hash(slot_layout)
    extents = tuple(reg.delta.extents) if reg.delta is not None else ()
    part = RankPart(v, reg.epoch, reg.inc, gen, reg.layout_hashes[gen], extents)
    if sums is not None:
        sums = _checksum.bind(sums, v, reg.inc, part.layout)
    return Snapshot(v, slot, part, sums, t1 - t0, time.perf_counter() - t1, encode_s)


def commit(c: Committer, snap: Snapshot) -> bool:
    """Writes the rank's part of ``snap.v`` and its checksums, and counts its snapshot; the last rank
    to count commits the version (True: committed here)."""
    chan, keys, v, epoch = c.chan, c.chan.keys, snap.v, snap.part.epoch
    if snap.sums is not None:
        chan.write(keys.sums(v, c.rank), snap.sums)
    snap.part.write(chan, c.rank)  # before the count: the committer reads every rank's
    if chan.store.add(keys.snap(v, epoch), 1) != c.world_size:
        return False
    parts = RankPart.read_all(chan, v, epoch, c.world_size)
    VersionRecord(
        v=v,
        epoch=epoch,
        slot=snap.slot,
        fence=chan.store.get_int(keys.fence(snap.slot)),
        world_size=c.world_size,
        zero_copy=c.zero_copy,
        checksums=c.checksums,
        committed_at=now(),
        mode=c.mode,
        packing=tuple(p.gen for p in parts),
        nonce=os.urandom(16).hex(),
        incs=tuple(p.inc for p in parts),
        layouts=tuple(p.layout for p in parts),
        deltas=tuple(p.deltas for p in parts) if any(p.deltas for p in parts) else (),
    ).write(chan)  # and its ready key: subscribers wake
    collect(c, v, epoch)  # (and this version's snapshot counter: every rank added)
    return True


def collect(c: Committer, v: int, epoch: int) -> None:
    """Deletes the snapshot counter of ``v`` (committed: every rank added to it) and the keys of
    the version ``nslots + 2`` before ``v``: every rank is past its waits for it, and its slot was
    overwritten since (a reader still verifying it fails stale, as it would on the overwritten
    slot). Best effort: the next commit tries the next one."""
    keys = c.chan.keys
    old = v - (c.nslots + 2)
    names = [keys.snap(v, epoch)]
    if old >= 1:
        names += keys.version_keys(old, epoch, c.world_size, c.checksums)
    quietly(c.chan.store.delete_many, names)


def fence_off(c: Committer, reg: Registration, slot: int) -> None:
    """Zero copy: the trainer mutates the live tensors as soon as ``publish()`` returns, so the
    version they hold is fenced off (its stamp and the slot's fence)."""
    reg.stamps[slot].numpy().view(np.uint64)[2] = STAMP_WRITING
    c.chan.store.add(c.chan.keys.fence(slot), 1)


__all__ = ["Committer", "Snapshot", "collect", "commit", "fence_off", "snapshot"]
