"""Two joins under one subscriber id never keep each other alive. After a store loss whose old
generation record was put back (a same-epoch trainer restart, ``benchmarks/soak.py``), the new
history counts subscriber ids from 1 again while subscribers of the lost history still hold those
ids. Before each join drew a tag, a lost-history subscriber's lease thread bumped the very key
the new holder of its id was judged by: the soak saw a publisher wait 30 s for a subscriber
killed long before (``behind: vm:17728 (id 13, acked 0)``, its lease key bumped 151 times). Here
the counter is set back by hand, a second join takes id 1 in another process and is killed: a
publisher's scan counts it dead within its lease, although the first join still refreshes its own
lease; the first join, at its next check, finds another join's record at its id and joins again
under a new id."""

from __future__ import annotations

import time

import pytest

from tests.runtime.actors import TOKEN
from tests.runtime.harness import Worker, free_port
from wbridge import open_store
from wbridge.protocol.channel import ChannelStore
from wbridge.protocol.keys import Keys
from wbridge.publish.tracker import SubscriberTracker
from wbridge.pull.membership import REJOINED, Membership

pytestmark = pytest.mark.timeout(120)

TTL = 1.0


def _channel(url: str) -> ChannelStore:
    return ChannelStore(open_store(url, connect_timeout=10.0), Keys("t"), TOKEN.encode())


class Joiner:
    """A subscriber's membership alone, in a process of its own (the test kills it)."""

    def __init__(self, url: str) -> None:
        self.m = Membership(_channel(url), "second", TTL)
        self.m.join()

    def joined(self) -> tuple[int, str, str]:
        return self.m.id, self.m.tag, self.m.gen


def test_a_join_under_a_reused_id_is_judged_by_its_own_lease() -> None:
    host = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
    first = Membership(ChannelStore(host, Keys("t"), TOKEN.encode()), "first", TTL)
    second = None
    try:
        first.join()
        assert first.id == 1
        host.set(first.keys.subs, b"0")  # a new history counts ids from 1 again
        second = Worker("second", Joiner, host.url)
        sid, stag, sgen = second.call("joined")
        assert (sid, sgen) == (1, first.gen) and stag != first.tag
        tracker = SubscriberTracker(first.chan, aggregator=False)  # a publisher's scan
        assert [(s.id, s.name) for s in tracker.live()] == [(1, "second")]
        second.kill()  # SIGKILL: its lease is never refreshed again
        before = host.get(first.lease.key)
        deadline = time.monotonic() + 10 * TTL
        while tracker.live() and time.monotonic() < deadline:
            time.sleep(TTL / 10)
        assert tracker.live() == [], "a dead join is kept alive by another join's lease under its id"
        assert host.get(first.lease.key) != before, "the first join's lease is refreshed meanwhile"
        # the first join notices at its next check: another join's record at its id
        found, _ = first.check()
        assert found == REJOINED and first.id == 2
        assert [(s.id, s.name) for s in tracker.live()] == [(2, "first")]
    finally:
        if second is not None:
            second.kill()
        first.leave()
        host.close()


def test_a_join_whose_id_holds_another_joins_record_joins_again() -> None:
    """While the other join's record is still there (not collected yet): the first join sees
    another tag at its id, joins again under a new id, and deletes only its own lease key, not the
    state key it shares by id with the other join."""
    host = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
    chan = ChannelStore(host, Keys("t"), TOKEN.encode())
    first, second = Membership(chan, "first", TTL), Membership(chan, "second", TTL)
    try:
        first.join()
        old_lease = first.lease.key
        host.set(first.keys.subs, b"0")  # a new history counts ids from 1 again
        second.join()
        assert second.id == first.id == 1 and second.tag != first.tag
        found, _ = first.check()
        assert found == REJOINED and first.id == 2
        assert host.get(old_lease) is None, "its old lease key is deleted"
        assert host.get(second.lease.key) is not None and host.get(second.keys.sub(1, "state")) is not None
    finally:
        first.leave()
        second.leave()
        host.close()
