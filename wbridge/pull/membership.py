"""A subscriber's place in a channel: the store generation it joined, its id there, its lease.

Three things end a membership without the subscriber leaving. The store is lost and comes back
empty, in a new generation (see ``wbridge.protocol.generation``): the subscriber joins that one, as the
publishers do, whichever it is (an old generation record put back is followed too: what a
subscriber plans and verifies from is sealed to each version's publishers, ``wbridge.protocol.version``,
so nothing of a lost history can pass for a version of the current one). Its lease lapsed
(the process was frozen, say, longer than ``lease_ttl``): publishers then counted it dead for good
and stopped waiting for it, so it joins again under a new id and they wait for it again. Or its
record is gone: a publisher evicted it (``Publisher.evict``: someone reported it dead, wrongly
here) or collected it as dead; it joins again under a new id just the same. All three are noticed
at the subscriber's next pull (``check()``, one batched read of the generation and the record,
with the version record and fences the pull reads next). A record there of another join (its
``tag`` not this join's: a lost history's generation record was put back, and the new history gave
this id to someone else) counts as gone too. Each join draws a ``tag``: its lease key
(``Keys.lease``) and record carry it, so two joins under one id never keep each other alive.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from .._lifecycle import quietly
from ..protocol import generation as _generation
from ..protocol.channel import ChannelStore
from ..protocol.keys import Keys
from ..protocol.packing import announce
from ..protocol.state import state_bytes
from ..store import Lease

log = logging.getLogger("wbridge")

STILL, REJOINED, NEW_GENERATION = 0, 1, 2  # what check() found


class Membership:
    """``base`` (the channel's store, keys without a generation, token), ``name`` (recorded for
    publishers to show), ``ttl`` (the lease's). ``chan`` is the channel in the generation joined."""

    def __init__(self, base: ChannelStore, name: str, ttl: float) -> None:
        self.base, self.chan, self.store, self.name, self.ttl = base, base, base.store, name, ttl
        self.gen: str | None = None
        self.acked = 0  # the version the subscriber holds, for its state key when it joins again
        self.layout: Any = None  # the RankLayout it reads, announced with its record
        self.relay = ""  # the store key of its relay record (``pull.relay``): collected with it
        self.id: int | None = None
        self.tag = ""  # this join's (``Keys.lease``)
        self.lease: Lease | None = None

    def join(self, gen: str | None = None, acked: int = 0, record: bool = True) -> None:
        """Joins generation ``gen`` (default: the store's, created if it has none) under a new id,
        its state saying it holds version ``acked`` (0: none). ``record=False`` leaves the record
        (what publishers look for) to ``announce``: a first join does not know its layout yet."""
        if gen is None:
            gen = _generation.join(self.base)
        chan = self.base.at(gen)
        keys = chan.keys
        sub_id = self.store.add(keys.subs, 1)
        tag = os.urandom(8).hex()
        # the lease and state first: publishers only look at subscribers whose record exists, and
        # a record without a live lease would read as a dead subscriber
        lease = self.store.lease(keys.lease(sub_id, tag), self.ttl)
        try:
            self.store.set(keys.sub(sub_id, "state"), state_bytes(acked, 0))
            if record:
                self._write_record(chan, sub_id, tag)
        except BaseException:
            quietly(lease.revoke)
            raise
        old, self.lease = self.lease, lease
        if old is not None:
            quietly(old.revoke)
        self.gen, self.chan, self.id, self.tag = gen, chan, sub_id, tag

    @property
    def keys(self) -> Keys:
        """The channel's keys in the generation joined."""
        return self.chan.keys

    def _write_record(self, chan: ChannelStore, sub_id: int, tag: str) -> None:
        record = {"name": self.name, "ttl": self.ttl, "tag": tag, "host": socket.gethostname(), "pid": os.getpid()}
        if self.layout is not None:  # publishers pack their staging slots for it (``protocol.packing``)
            record["layout"] = announce(chan, self.layout)
        if self.relay.startswith(chan.keys.p):
            record["relay"] = self.relay
        chan.write(chan.keys.sub(sub_id), record)

    def announce(self, layout: Any, relay: str = "") -> None:
        """Tells publishers which layout this subscriber reads (kept across re-joins) and the key
        of its relay record, if it relays (collected with the subscriber's keys)."""
        self.layout, self.relay = layout, relay
        self._write_record(self.chan, self.id, self.tag)

    def check(self, also: list[str] | None = None) -> tuple[int, list]:
        """``NEW_GENERATION`` (joined the store's new one: what was known of the old is void),
        ``REJOINED`` (the lease had lapsed: joined again under a new id) or ``STILL``; and the
        values of the keys ``also``, read in the same batch (of the generation joined before)."""
        also = also or []
        mine = [self.keys.sub(self.id)] if self.id is not None else []
        raw, *values = self.store.get_many([self.base.keys.generation, *mine, *also])
        record, values = values[: len(mine)], values[len(mine) :]
        gen = _generation.parse(self.base, raw)
        if gen != self.gen:
            log.warning("subscriber %s: the channel's store was lost; joining its new generation", self.name)
            self.acked = 0  # nothing of the new generation is held
            self.join(gen)
            return NEW_GENERATION, values
        if self.lease is None:
            return STILL, values
        if record == [None] or self._tag_of(record[0]) != self.tag:
            old = [self.keys.lease(self.id, self.tag)]  # what it wrote after that: nobody collects it
            if record == [None]:  # nobody counts this id any more: a publisher evicted or collected it
                log.warning("subscriber %s: publishers no longer count it (evicted?); joining again", self.name)
                old.append(self.keys.sub(self.id, "state"))
            else:  # the id is another join's now (the state key too)
                log.warning("subscriber %s: its id holds another subscriber's record (a lost history put back?); "
                            "joining again", self.name)  # fmt: skip
            self.join(self.gen, self.acked)
            quietly(self.store.delete_many, old)
            return REJOINED, values
        if self.lease.lapsed:
            log.warning("subscriber %s: its lease lapsed (frozen > %.1fs?); joining again", self.name, self.ttl)
            self.join(self.gen, self.acked)
            return REJOINED, values
        return STILL, values

    def _tag_of(self, raw: bytes | None) -> str | None:
        """The ``tag`` of the record ``raw`` at this subscriber's id (None: not a record of this
        channel's, or none)."""
        try:
            tag = self.chan.open(self.keys.sub(self.id), raw).get("tag")
        except Exception:  # noqa: BLE001 - unsigned or malformed: not this join's
            return None
        return tag if isinstance(tag, str) else None

    def leave(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.revoke()


__all__ = ["Membership", "NEW_GENERATION", "REJOINED", "STILL"]
