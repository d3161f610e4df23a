"""Publisher side of the control plane: which subscribers are live, what they read and acked.

Store traffic is O(publishers + subscribers) per version, not their product. One publisher rank,
the aggregator (rank 0), reads every subscriber's lease and state in one batched request per poll
(``Store.get_many``); once a condition that every rank waits for holds, it writes that condition's
key (``Keys.acked(v)``: every live subscriber acked v or later; ``Keys.free(v)``: no live subscriber
reads the slot that v is about to overwrite). The other ranks block on the key appearing (a TCPStore
wait, an etcd watch). A rank that has waited ``FALLBACK_S`` without it scans by itself, at doubling
intervals, and writes the key too, unless the aggregator is at work on that same key: while a wait
of its lasts, the aggregator says so every ``BEAT_S`` (``Keys.aggregating``: the key and a count),
and a rank that finds the count moved since its last look waits on. So a slow round (subscribers
pulling for many seconds) costs the other ranks one small read per look, not a scan of every
subscriber, and a dead aggregator (or one waiting for something else) is scanned around.

Publishers pack their staging slots for the layouts their readers announced (``wbridge.publish.packing``); the
aggregator's scans keep the set of those layouts in one sealed key (``Keys.readers``), which the
other ranks read once per publish instead of scanning every subscriber themselves.

A scan also collects dead subscribers: once a lease lapsed, the subscriber's three keys are deleted,
and its relay record if it relayed (a subscriber that comes back registers under a new id).
``evict`` collects a subscriber reported dead at once, lease or not: with its record, lease and
state gone, every rank's next scan finds it dead (no rank waits out its lease), and should it be
alive after all its next pull finds its record gone and joins again under a new id (``wbridge.pull.membership``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._deadline import Deadline
from ..errors import StoreError, UsageError, WaitTimeout
from ..protocol import generation as _generation
from ..protocol.channel import ChannelStore
from ..protocol.keys import COUNTER_JUMP_MAX, COUNTER_WINDOW, Keys
from ..protocol.state import parse_state
from ..store import Store

log = logging.getLogger("wbridge")

FALLBACK_S = 2.0  # a non-aggregating rank scans by itself after waiting this long for a key, then
# after twice as long again each time (a long wait on slow subscribers costs O(log) scans per rank)
PENDING_GRACE_S = 10.0  # an id whose record never appears (collected, or its owner died) is dropped
BEAT_S = 0.5  # how often the aggregator, while it waits, says for which key (Keys.aggregating)
MAX_POLL_S = 0.02  # the aggregator's poll backoff cap; a tenth of the time waited so far if longer
# (up to FALLBACK_S)


@dataclass
class SubscriberView:
    """What a publisher knows of one subscriber, as of the last scan."""

    id: int
    ttl: float
    name: str = ""
    dead: bool = False
    acked: int = 0
    reading: int = 0
    layout: str = ""  # hash of its announced layout (``protocol.packing.announce``)
    relay: str = ""  # the store key of its relay record (``wbridge.pull.relay``), collected with it
    lease: str = ""  # its lease key (``Keys.lease``: its join's tag, from its record)


@dataclass
class SubscriberTracker:
    """Scans the subscribers of a channel and waits for conditions on them (publisher side).

    chan: the publisher's store connection, the channel's keys and token (``ChannelStore``)
    aggregator: whether this rank scans while it waits (True) or blocks on the keys another
        rank's scans write, scanning by itself only after ``FALLBACK_S``, then at doubling
        intervals (False)
    others: whether other publisher ranks wait on the keys this aggregator writes (only then does
        it beat for them while it waits)

    Thread-safe: a background publish and the caller's ``subscribers()``/``wait_acked()`` may scan
    at once, and a scan updates ``known`` and the store's lease clock, so one scan at a time."""

    chan: ChannelStore
    aggregator: bool = True
    others: bool = True
    known: dict[int, SubscriberView] = field(default_factory=dict)
    pending: dict[int, float] = field(default_factory=dict)  # id -> when first counted, no record yet
    counted: int = 0  # the subscriber counter as of the last scan
    layouts: tuple[str, ...] | None = None  # the reader layouts last written to Keys.readers
    odd: bytes | None = None  # the last odd value of the subscriber counter, logged once
    beats: int = 0  # how often this (aggregating) rank said it was at work on a wait
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def store(self) -> Store:
        return self.chan.store

    @property
    def keys(self) -> Keys:
        return self.chan.keys

    def live(self) -> list[SubscriberView]:
        with self.lock:
            return self._scan()

    def reader_layouts(self) -> tuple[str, ...]:
        """The distinct layout hashes that live subscribers announced, sorted. The aggregator
        scans (every scan of its writes them to ``Keys.readers`` when they changed, before it
        writes the key of a condition); another rank reads that key: one small read, not a scan of
        every subscriber, as of the aggregator's last scan (in sync and one-step-off modes the one
        that ended the wait before this snapshot; none until the aggregator has scanned)."""
        if self.aggregator:
            self.live()
            return self.layouts or ()
        hashes = self._read_sealed(self.keys.readers)
        return tuple(str(h) for h in hashes) if isinstance(hashes, list) else ()  # forged: packs nothing

    def _scan(self) -> list[SubscriberView]:
        views = list(self.known.values())
        pending = sorted(self.pending)
        keys = [self.keys.subs, *self._state_keys(views), *(self.keys.sub(i) for i in pending)]
        values = self.store.get_many(keys)
        now = time.monotonic()
        count = self._count(values[0])
        records = list(zip(pending, values[1 + 2 * len(views) :]))
        if self.counted <= count <= self.counted + COUNTER_JUMP_MAX:
            new = list(range(self.counted + 1, count + 1))
        else:  # forged, or repaired after: only the newest ids, those real joins got since
            window = range(max(1, count - COUNTER_WINDOW + 1), count + 1)
            new = [i for i in window if i not in self.known and i not in self.pending]
        for i in new:
            self.pending[i] = now
        self.counted = count
        if new:  # registered since the last scan: their records now, not a poll later
            records += zip(new, self.store.get_many([self.keys.sub(i) for i in new]))
        fresh = []
        for i, raw in records:
            if raw is None:
                if now - self.pending[i] > PENDING_GRACE_S:
                    del self.pending[i]
                continue
            del self.pending[i]
            try:
                d = self.chan.open(self.keys.sub(i), raw)
                tag = d["tag"]
                if not isinstance(tag, str) or not tag.isalnum():
                    continue  # (a record without its join's tag has no lease to judge)
                fresh.append(
                    SubscriberView(
                        i,
                        float(d["ttl"]),
                        str(d.get("name", "")),
                        layout=str(d.get("layout", "")),
                        relay=str(d.get("relay", "")),
                        lease=self.keys.lease(i, tag),
                    )
                )
            except Exception:  # noqa: BLE001 - an unsigned or forged subscriber is ignored
                pass
        out = self._judge(views, values[1 : 1 + 2 * len(views)])
        if fresh:  # their lease and state too
            out += self._judge(fresh, self.store.get_many(self._state_keys(fresh)))
        dead = [v for v in views + fresh if v.dead]
        for v in views + fresh:
            if v.dead:
                self.known.pop(v.id, None)
            else:
                self.known[v.id] = v
        if dead:
            self.store.delete_many(self._keys_of(dead))
        if self.aggregator:
            layouts = tuple(sorted({s.layout for s in out if s.layout}))
            if layouts != self.layouts:
                self.chan.write(self.keys.readers, list(layouts))
                self.layouts = layouts
        return out

    def _count(self, raw: bytes | None) -> int:
        """The subscriber counter's value, read defensively (any store client can write it): a
        malformed one adds nobody; a jump or one that went back (repaired after a forged write) is
        followed, and only its newest ids are looked for (``_scan``). Each odd value is logged once."""
        try:
            count = int(raw or 0)
        except ValueError:
            count = -1
        if count < 0 or count - self.counted > COUNTER_JUMP_MAX or count < self.counted:
            if raw != self.odd:
                self.odd = raw
                log.warning(
                    "channel %r: subscriber counter %s holds %r after %d: %s",
                    self.keys.channel,
                    self.keys.subs,
                    (raw or b"")[:40],
                    self.counted,
                    "ignored" if count < 0 else "followed (ids in a jump are not looked for)",
                )
        return self.counted if count < 0 else count

    def evict(self, who: int | str) -> list[int]:
        """Collects the live subscribers with id ``who`` (an int) or name ``who`` (a str) as if
        their leases had lapsed; returns their ids."""
        if isinstance(who, bool) or not isinstance(who, (int, str)) or not who:
            raise UsageError(f"evict() needs a subscriber name or id, got {who!r:.80}")
        with self.lock:
            hit = [v for v in self._scan() if (v.id if isinstance(who, int) else v.name) == who]
            for v in hit:
                self.known.pop(v.id, None)
            if hit:
                self.store.delete_many(self._keys_of(hit))
            return [v.id for v in hit]

    def _keys_of(self, views: list[SubscriberView]) -> list[str]:
        """Every key a subscriber leaves in the store: record, lease, state, relay record."""
        gone = [k for v in views for k in (self.keys.sub(v.id), *self._state_keys([v]))]
        return gone + [v.relay for v in views if v.relay.startswith(self.keys.p + "zone/")]

    def _state_keys(self, views: list[SubscriberView]) -> list[str]:
        return [k for v in views for k in (v.lease, self.keys.sub(v.id, "state"))]

    def _judge(self, views: list[SubscriberView], values: list[bytes | None]) -> list[SubscriberView]:
        out = []
        for view, live, state in zip(views, values[0::2], values[1::2]):
            if not self.store.judge_alive(view.lease, live, view.ttl):
                view.dead = True
                continue
            view.acked, view.reading = parse_state(state)
            out.append(view)
        return out

    def wait(
        self,
        key: str,
        pred: Callable[[SubscriberView], bool],
        deadline: Deadline,
        what: str,
        check_stop: Callable[[], None],
    ) -> None:
        """Returns once ``pred(view)`` held for every live subscriber in one scan (this rank's or
        another's: then ``key`` exists); ``check_stop`` may raise to give up. ``WaitTimeout`` at
        ``deadline``."""
        poll, started, fallback = 0.0005, time.monotonic(), FALLBACK_S
        next_scan = time.monotonic() + (0.0 if self.aggregator else FALLBACK_S)
        # the aggregator's next beat (the first soon: a wait that ends at once costs none); the
        # aggregator's beat last seen by another rank
        beat_at, seen = started + BEAT_S / 10, None
        behind: list[SubscriberView] = []  # those the last scan found short of ``pred``
        while True:
            check_stop()
            now = time.monotonic()
            if now >= next_scan:
                if self.aggregator and self.others and now >= beat_at:
                    self.beats += 1
                    at = self.keys.aggregating
                    self.chan.write(at, {"key": key, "n": self.beats})
                    beat_at = now + BEAT_S
                beat = None if self.aggregator else self._beat(key)
                if beat is not None and beat != seen:
                    seen = beat  # the aggregator is at work on this key since the last look: leave it
                else:
                    behind = [s for s in self.live() if not pred(s)]
                    if not behind:
                        self.store.set(key, b"1")
                        return
                if self.aggregator:
                    # a long wait (slow subscribers) costs O(log) scans, a short one stays prompt
                    grown = min(max(MAX_POLL_S, (now - started) / 10), FALLBACK_S)
                    next_scan, poll = now + poll, min(poll * 2, grown)
                else:
                    next_scan, fallback = now + fallback, fallback * 2
            now = time.monotonic()
            if now >= deadline.at:
                who = ", ".join(f"{s.name or s.id} (id {s.id}, acked {s.acked})" for s in behind[:4])
                raise WaitTimeout(f"timed out waiting for {what}" + (f"; behind: {who}" if who else ""))
            pause = max(0.0, min(next_scan, deadline.at) - now)
            if self.aggregator:
                time.sleep(pause)
                continue
            try:  # in slices of at most FALLBACK_S: close() stops a wait that soon
                self.store.wait(key, max(min(pause, FALLBACK_S), 0.001))
                return
            except (WaitTimeout, StoreError):
                pass  # a store down for the slice: the next scan retries it within its own timeout

    def _beat(self, key: str) -> int | None:
        """The aggregator's beat count if it last said it waits for ``key``, else None."""
        d = self._read_sealed(self.keys.aggregating)  # forged or malformed: as if none, so this rank scans
        n = d.get("n") if isinstance(d, dict) and d.get("key") == key else None
        return n if isinstance(n, int) else None

    def _read_sealed(self, key: str) -> Any:
        """The value sealed at ``key`` (written by the aggregator), or None where it is absent,
        forged or malformed."""
        raw = self.store.get(key)
        try:
            return self.chan.open(key, raw) if raw is not None else None
        except Exception:  # noqa: BLE001 - the store is not trusted
            return None


def evict(chan: ChannelStore, who: int | str) -> list[int]:
    """``SubscriberTracker.evict`` from a process that publishes nothing (a Ray driver); ``chan``'s
    keys are the channel's, without a generation (the store's current one is meant)."""
    gen = _generation.current(chan)
    if gen is None:
        return []
    return SubscriberTracker(chan.at(gen), aggregator=False).evict(who)


def now() -> float:
    return time.time()
