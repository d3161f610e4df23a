"""The serving side of a relay: a zone subscriber's staging buffer, its stamp and its record.

A subscriber with ``zone=Zone(Z, relay=True)`` serves the version it is assembling or holds to the
subscribers of zone Z (``wbridge.pull.zone`` reads it): the buffer and a stamp (``protocol.stamps``)
registered with the subscriber's own transports, and a sealed record under ``Keys.zone_relay(Z, k)``
with the byte ranges of the buffer that hold version ``v`` and were checked.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .._lifecycle import quietly
from .._selection import publisher_capabilities
from .._tensors import address, alloc_bytes
from ..protocol.channel import ChannelStore
from ..protocol.records import b64
from ..protocol.stamps import STAMP_BYTES, STAMP_MAGIC, STAMP_STABLE, STAMP_WRITING
from .ranges import Ranges, union

ANN_KEEP = 64  # a relay deletes announcement keys older than this many announcements, this many at a time


class RelayServer:
    """The serving side of a relay: its buffer, stamp and record.

    - ``chan``: the channel's store, keys (of the generation joined) and token.
    - ``zone``: the zone it serves.
    - ``transports``: the subscriber's transports to serve on, by name (its buffer already registered).
    - ``regions``: each transport's registration of the buffer.
    - ``size``: the buffer's size in bytes.
    - ``layout``: the hash of the subscriber's layout (readers with another layout do not use it).
    - ``sub_id``, ``ttl``, ``name``: the subscriber's id (its lease key), lease ttl and name.
    """

    def __init__(
        self,
        chan: ChannelStore,
        zone: str,
        transports: dict[str, Any],
        regions: dict[str, Any],
        size: int,
        layout: str,
        sub_id: int,
        ttl: float,
        name: str,
    ) -> None:
        self.chan, self.store, self.keys, self.zone = chan, chan.store, chan.keys, zone
        store, keys = chan.store, chan.keys
        self.transports, self.size, self.sub_id = transports, size, sub_id
        self.stamp = alloc_bytes(STAMP_BYTES, "cpu")
        self.stamp.numpy().view(np.uint64)[:] = (STAMP_MAGIC, 0, STAMP_WRITING, 0)
        self.stamp_regions: dict[str, Any] = {}
        served = {}
        for n, t in transports.items():
            self.stamp_regions[n] = r = t.register(address(self.stamp), STAMP_BYTES, device="cpu")
            served[n] = {"endpoint": b64(t.endpoint()), "regions": [[b64(regions[n].descriptor), b64(r.descriptor)]]}
        self.base = {
            "id": sub_id,
            "lease": keys.sub(sub_id, "live"),
            "ttl": ttl,
            "name": name,
            "layout": layout,
            "size": size,
            "caps": publisher_capabilities(list(transports)),
            "transports": served,
        }
        self.v = self.epoch = 0
        self.nonce = ""  # the version's nonce (``VersionRecord.identity``)
        self.held: Ranges = []
        self.lock = threading.Lock()
        self.key = keys.zone_relay(zone, store.add(keys.zone_count(zone), 1))
        self._write()

    def _write(self) -> None:
        rec = {**self.base, "v": self.v, "epoch": self.epoch, "nonce": self.nonce, "held": [list(r) for r in self.held]}
        self.chan.write(self.key, rec)

    def begin(self, identity: tuple[int, int, str]) -> None:
        """About to write the version of ``identity`` (``VersionRecord.identity``) into the buffer:
        withdraw what it held, then the stamp."""
        if identity == (self.v, self.epoch, self.nonce):
            return
        v, epoch, nonce = identity
        self.v, self.epoch, self.nonce, self.held = v, epoch, nonce, []
        self._write()
        self.stamp.numpy().view(np.uint64)[:] = (STAMP_MAGIC, v, STAMP_STABLE, epoch)

    def hold(self, ranges: Ranges, version: tuple[int, int, str] | None = None, wake: bool = True) -> None:
        """Announces that ``ranges`` of the buffer now hold the version begun (verified), unless
        another ``version`` (its identity) was begun since; called from the thread fetching its own
        range and the one reading peers. ``wake``: bytes new to the zone (from publishers) wake the
        zone's waiting readers; bytes read from peers do not (their owner's announcement did)."""
        with self.lock:
            if version is not None and version != (self.v, self.epoch, self.nonce):
                return
            self.held = union(self.held + list(ranges))
            self._write()
            if wake:
                self.announce()

    def announce(self) -> None:
        """Wakes the zone's readers blocked in ``ZoneReader.wait`` (once the record is written): the
        zone's next announcement key appears; each ``ANN_KEEP``-th deletes ``ANN_KEEP`` old ones."""
        keys, zone = self.keys, self.zone
        n = self.store.add(keys.zone_announced(zone), 1)
        self.store.set(keys.zone_announcement(zone, n), b"1")
        if n % ANN_KEEP == 0 and n >= 2 * ANN_KEEP:
            old = [keys.zone_announcement(zone, k) for k in range(n - 2 * ANN_KEEP + 1, n - ANN_KEEP + 1)]
            quietly(self.store.delete_many, old)

    def close(self) -> None:
        quietly(self.store.delete, self.key)
        self.stamp.numpy().view(np.uint64)[2] = STAMP_WRITING
        for n, r in self.stamp_regions.items():
            quietly(self.transports[n].deregister, r)
        self.stamp_regions = {}


__all__ = ["ANN_KEEP", "RelayServer"]
