"""Relays are peers, not authorities (issue 27, defects 4 and 6).

A relay frozen (SIGSTOP) while it holds a whole version: before, a subscriber of another layout in
its zone gave that relay's read the pull's whole timeout and failed every pull (``WaitTimeout``)
although the publishers and two healthy relays were up. Now reads from relays get a bounded share
of the deadline, a relay that fails is dropped (for ``DISTRUST_S``) and its bytes read elsewhere.

A relay serving corrupted bytes: before, subscribers with ``verify=False`` (and readers of another
layout, whatever ``verify``) took its bytes as they were (torn weights reported as success); now
every byte read from a relay is checked against the publishers' checksums and a relay that fails
them is read around, on every reader path. ``verify=True`` with publishers that keep no checksums
is refused with what to turn on (before, it checked nothing, silently)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.runtime.actors import PubActor, SubActor
from tests.runtime.harness import Worker, WorkerError, call_all
from wbridge import Staging, Zone

from .actors import FaultSub

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 12.0


def readers(url: str, zone: str, **kwargs) -> list[Worker]:
    """A zone subscriber of the relays' layout (staged, relays nothing) and one of another layout
    (fused tensors, not staged: it plans over the relays that hold a version whole)."""
    return [
        Worker("same-layout", SubActor, url, 1, 0, fused=False, staged=True, zone=Zone(zone), **kwargs),
        Worker("other-layout", SubActor, url, 1, 0, fused=True, zone=Zone(zone), **kwargs),
    ]


@pytest.mark.slow
def test_frozen_relay_does_not_stall_the_zone(standalone_store: str) -> None:
    url = standalone_store
    pub = Worker("pub", PubActor, url, 0, 1, 1, staging=Staging(checksums=True))
    # tcp: a frozen process serves nothing (the local transport reads its memory all the same)
    relay = dict(fused=False, zone=Zone("a", relay=True), lease_ttl=60.0, transport="tcp")  # frozen, still "alive"
    relays = [Worker(f"relay{i}", SubActor, url, 1, 0, **relay) for i in range(3)]
    subs = readers(url, "a", transport="tcp")
    frozen = None
    try:
        pub.call("publish", 1)
        assert all(r["bad"] == [] for r in call_all(relays, "pull", 1, timeout=30.0))
        frozen = relays[0].proc.pid
        os.kill(frozen, signal.SIGSTOP)
        took = {}
        for s in subs:
            t0 = time.monotonic()
            got = s.call("pull", 1, timeout=TIMEOUT)
            took[s.name] = round(time.monotonic() - t0, 1)
            print(s.name, {k: got[k] for k in ("v", "from_publishers", "from_peers")})
            assert got["v"] == 1 and got["bad"] == [], (s.name, got)
        print(f"pull(timeout={TIMEOUT}) with a frozen relay: {took} s")
        assert max(took.values()) < TIMEOUT, took
        pub.call("publish", 2)  # the next pull reads around it at once (it is distrusted)
        for s in subs:
            t0 = time.monotonic()
            got = s.call("pull", 2, timeout=TIMEOUT)
            assert got["v"] == 2 and got["bad"] == [], (s.name, got)
            took[f"{s.name} v2"] = round(time.monotonic() - t0, 1)
        print(f"and the next pull: {took} s")
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        for w in [*subs, *relays, pub]:
            w.stop()


@pytest.mark.slow
def test_corrupting_relay_is_read_around_without_verify(standalone_store: str) -> None:
    url = standalone_store
    pub = Worker("pub", PubActor, url, 0, 1, 1, staging=Staging(checksums=True))
    flip = ("flip-bit", {"on_reads": range(1, 1000), "min_bytes": 1024})  # every data read it makes
    bad = Worker("bad", SubActor, url, 1, 0, fused=False, zone=Zone("b", relay=True), fault=flip)
    subs = readers(url, "b")  # verify=False: relays' bytes are checked all the same
    try:
        for v in (1, 2):
            pub.call("publish", v)
            assert bad.call("pull", v)["bad"], "the fault did not corrupt the relay's bytes"
            for s in subs:
                got = s.call("pull", v, timeout=TIMEOUT)
                print(s.name, {k: got[k] for k in ("v", "from_publishers", "from_peers")}, "bad:", len(got["bad"]))
                assert got["v"] == v and got["bad"] == [], f"{s.name} took a corrupting relay's bytes: {got}"
    finally:
        for w in [*subs, bad, pub]:
            w.stop()


@pytest.mark.slow
@pytest.mark.parametrize("asks", ["verify", "zone"])
def test_what_needs_checksums_is_refused_and_leaves_the_channel(standalone_store: str, asks: str) -> None:
    """``verify=True`` and a zone both check bytes against the publishers' checksums: against
    publishers that opted out (``Staging(checksums=False)``) the first pull raises ``UsageError``
    saying what to write, and the subscriber leaves the channel: a ``sync`` publisher does not wait
    on it (before, it stayed a live member and the publisher waited until its own timeout)."""
    url = standalone_store
    pub = Worker("pub", PubActor, url, 0, 1, 1, mode="sync", staging=Staging(checksums=False), transport="tcp")
    opts = {"verify": True} if asks == "verify" else {"zone": Zone("a", relay=True)}
    sub = Worker("sub", FaultSub, url, 1, 0, fused=False, model_kind="small", transport="tcp", **opts)
    try:
        assert pub.call("live_subscribers") == 1
        pub.send("publish", 1, timeout=30.0)
        with pytest.raises(WorkerError) as err:
            sub.call("pull", 1, timeout=TIMEOUT)
        assert err.value.exc_type == "UsageError" and "checksums=False" in str(err.value), err.value
        t0 = time.monotonic()
        assert pub.result(30)["v"] == 1  # the sync publish stopped waiting on the refused subscriber
        assert pub.call("publish", 2, timeout=5.0)["v"] == 2 and time.monotonic() - t0 < 25
        assert pub.call("live_subscribers") == 0
    finally:
        for w in [sub, pub]:
            w.stop()


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_zone_readers_fail_over_when_a_publisher_replica_dies(standalone_store: str, victim: int) -> None:
    """Readers that read a version from the relays alone still check the publishers' slot stamps.
    Before, with a publisher replica dead, that check raised ``TransportError`` on every pull until
    the rank came back (the soak's zone reader failed thousands of pulls in a row); now the replicas
    stand in and the pull ends bit-exact."""
    url = standalone_store
    pubs = [Worker(f"pub{r}", PubActor, url, r, 2, 1, staging=Staging(checksums=True), transport="tcp") for r in (0, 1)]
    relays = [
        Worker(f"relay{i}", SubActor, url, 1, 0, fused=False, zone=Zone("a", relay=True), transport="tcp")
        for i in range(2)
    ]
    subs = readers(url, "a", transport="tcp")
    try:
        for v in (1, 2):
            call_all(pubs, "publish", v)
            assert all(r["v"] == v and r["bad"] == [] for r in call_all(relays, "pull", v, timeout=30.0))
            if v == 1:
                assert all(r["bad"] == [] for r in call_all(subs, "pull", 1, timeout=30.0))
        pubs[victim].kill()
        for s in subs:
            got = s.call("pull", 2, timeout=TIMEOUT)
            print(s.name, {k: got[k] for k in ("v", "from_publishers", "from_peers")})
            assert got["v"] == 2 and got["bad"] == [], (s.name, got)
    finally:
        for w in [*subs, *relays, *pubs]:
            w.stop()
