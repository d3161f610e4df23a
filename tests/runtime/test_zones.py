"""Zones and relays (``wbridge.pull.zone``): a version crosses to a zone about once, every replica of
the zone ends bit-exact, a dead relay costs its readers a re-read, and zones never mix."""

from __future__ import annotations

import os
import time

import pytest

import transports
from tests.etcd_fixture import etcd_server  # noqa: F401 - the fixture
from wbridge import Staging, Zone, open_store

from .actors import TOKEN, PubActor, SubActor
from .harness import Worker, call_all, free_port


@pytest.fixture
def store():
    s = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
    yield s
    s.close()


def _subs(url: str, n: int, **kwargs) -> list[Worker]:
    subs = [Worker(f"sub{i}", SubActor, url, 1, 0, fused=False, timeout=None, **kwargs) for i in range(n)]
    for s in subs:
        s.result(60)
    return subs


def _stop(*workers: Worker) -> None:
    for w in workers:
        w.stop()


def _one_version_from_publishers(rs: list[dict], v: int, slack: float = 1.15) -> None:
    """Every pull got ``v`` bit-exact, and the publishers served about one model's bytes in all."""
    assert all(r["v"] == v and r["bad"] == [] for r in rs), rs
    size = rs[0]["nbytes"]
    assert all(r["nbytes"] == size == r["from_publishers"] + r["from_peers"] for r in rs), rs
    from_pub = sum(r["from_publishers"] for r in rs)
    assert size <= from_pub <= slack * size, [(r["from_publishers"], r["from_peers"]) for r in rs]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["tcp", "local", "nixl", "mooncake"])
def test_relays_split_the_publisher_bytes(store, transport: str) -> None:
    """Relays read from publishers and from each other over ``transport``: for the RDMA engines
    (nixl, mooncake; over UCX shared memory and Mooncake's tcp protocol here) a relay serves its
    staging buffer through the same transport contract a publisher does."""
    if transport not in transports.available():
        pytest.skip(f"{transport} is not installed here")
    pub = Worker(
        "pub", PubActor, store.url, 0, 1, 1, zone="train", transport=[transport], staging=Staging(checksums=True)
    )
    subs = _subs(store.url, 4, zone=Zone("b", relay=True), transport=transport)
    try:
        for v in (1, 2):
            pub.call("publish", v)
            _one_version_from_publishers(call_all(subs, "pull", v, timeout=30.0), v)
    finally:
        _stop(*subs, pub)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_relays_with_etcd_and_checksums(etcd_server) -> None:
    """The etcd store, and verify=True: relay-served bytes are checked against publisher checksums."""
    url = etcd_server.url
    pub = Worker("pub", PubActor, url, 0, 1, 1, zone="train", staging=Staging(checksums=True))
    subs = _subs(url, 3, zone=Zone("b", relay=True), verify=True)
    try:
        pub.call("publish", 1)
        _one_version_from_publishers(call_all(subs, "pull", 1, timeout=30.0), 1)
    finally:
        _stop(*subs, pub)


@pytest.mark.timeout(120)
def test_zones_never_mix_and_late_readers_use_full_relays(store) -> None:
    """Zone b never reads zone a's relays; late subscribers of zone a, of its layout or another,
    read only from zone a's relays once they hold the version whole."""
    pub = Worker("pub", PubActor, store.url, 0, 1, 1, zone="train", staging=Staging(checksums=True))
    relays = _subs(store.url, 2, zone=Zone("a", relay=True))
    other = Worker("other", SubActor, store.url, 1, 0, fused=False, zone=Zone("b", relay=True))
    late = Worker("late", SubActor, store.url, 1, 0, fused=False, zone=Zone("a"), staged=True)
    fused = Worker("fused", SubActor, store.url, 1, 0, fused=True, zone=Zone("a"))  # another layout, not staged
    try:
        pub.call("publish", 1)
        _one_version_from_publishers(call_all(relays, "pull", 1, timeout=30.0), 1)
        # zone a's relays hold version 1 whole: a subscriber of zone b still reads the publishers
        r = other.call("pull", 1, timeout=30.0)
        assert r["v"] == 1 and r["bad"] == [] and r["from_peers"] == 0 and r["from_publishers"] == r["nbytes"], r
        # a late non-relay subscriber of zone a reads only from zone a's relays, split between them
        r = late.call("pull", 1, timeout=30.0)
        assert r["v"] == 1 and r["bad"] == [] and r["from_publishers"] == 0 and r["from_peers"] == r["nbytes"], r
        # so does one with another layout (fused, not staged): planned against the relays' layouts
        r = fused.call("pull", 1, timeout=30.0)
        assert r["v"] == 1 and r["bad"] == [] and r["from_publishers"] == 0 and r["from_peers"] == r["nbytes"], r
    finally:
        _stop(fused, late, other, *relays, pub)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_relay_killed_mid_version(store, tmp_path, transport: str) -> None:
    """A relay dies while it fetches its share of version 2: the others wait for it only briefly,
    read its share from the publishers, and end bit-exact at version 2 within their timeout."""
    signal, release = tmp_path / "paused", tmp_path / "release"
    release.touch()  # version 1: the victim's reads pass
    fault = ("pause", {"signal_path": str(signal), "release_path": str(release), "on_reads": range(1, 10_000)})
    pub = Worker("pub", PubActor, store.url, 0, 1, 1, staging=Staging(checksums=True))
    kw = {"zone": Zone("b", relay=True), "transport": transport, "lease_ttl": 2.0}
    victim = Worker("victim", SubActor, store.url, 1, 0, fused=False, fault=fault, **kw)
    others = _subs(store.url, 3, **kw)
    try:
        pub.call("publish", 1)
        _one_version_from_publishers(call_all([victim, *others], "pull", 1, timeout=30.0), 1)
        os.unlink(release)
        signal.write_text("")
        pub.call("publish", 2)
        for w in (victim, *others):
            w.send("pull", 2, timeout=30.0)
        deadline = time.monotonic() + 20
        while not signal.read_text() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert signal.read_text(), "the victim never paused mid-read"
        victim.kill()  # mid-version: it began version 2, holds part of its share, announced none
        t0 = time.monotonic()
        rs = [w.result(40) for w in others]
        assert all(r["v"] == 2 and r["bad"] == [] for r in rs), rs
        assert time.monotonic() - t0 < 30.0
        assert all(r["from_publishers"] > 0 for r in rs)  # the victim's share, re-read
        # and the next version without it (its lease lapses, its record is collected)
        pub.call("publish", 3)
        _one_version_from_publishers(call_all(others, "pull", 3, timeout=30.0), 3, slack=2.0)
        assert 1 not in _zone_records(store, "b")  # the dead relay's record was collected
    finally:
        _stop(*others, victim, pub)


def _zone_records(store, zone: str) -> dict[int, dict]:
    """The relay records of ``zone`` in the channel's current generation, by record number."""
    from wbridge.protocol import generation as _generation
    from wbridge.protocol.channel import ChannelStore
    from wbridge.protocol.keys import Keys
    from wbridge.protocol.records import open_sealed

    base = Keys("t")
    gen = _generation.current(ChannelStore(store, base, TOKEN.encode()))
    keys = base.at(gen)
    n = int(store.get(keys.zone_count(zone)) or 0)
    out = {}
    for k in range(1, n + 1):
        raw = store.get(keys.zone_relay(zone, k))
        if raw is not None:
            out[k] = open_sealed(TOKEN.encode(), keys.zone_relay(zone, k), raw)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_relay_killed_while_serving(store, transport: str) -> None:
    """The relay the others read from dies between their data reads and their check of its stamp
    (each of their reads is followed by a 1 s pause): they drop what they read from it and end
    bit-exact at that version, its share read again from the publishers, within their timeout."""
    pub = Worker("pub", PubActor, store.url, 0, 1, 1, staging=Staging(checksums=True))
    kw = {"zone": Zone("b", relay=True), "transport": transport, "lease_ttl": 2.0}
    victim = Worker("victim", SubActor, store.url, 1, 0, fused=False, **kw)  # relay record 1
    slow = ("slow", {"delay": 1.0, "on_reads": range(1, 10_000)})
    others = _subs(store.url, 3, fault=slow, **kw)
    try:
        pub.call("publish", 1)
        rs = call_all([victim, *others], "pull", 1, timeout=60.0)  # (the fast victim stops waiting)
        assert all(r["v"] == 1 and r["bad"] == [] for r in rs), rs
        pub.call("publish", 2)
        for w in (victim, *others):
            w.send("pull", 2, timeout=40.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            victim_rec = _zone_records(store, "b").get(1, {})
            if victim_rec.get("v") == 2 and victim_rec.get("held"):
                break  # the victim serves (a first chunk of) its share of version 2
            time.sleep(0.005)
        else:
            raise AssertionError("the victim never announced its share of version 2")
        time.sleep(0.3)  # the others read it (within a poll) and pause 1 s before its stamp
        victim.kill()
        rs = [w.result(60) for w in others]
        assert all(r["v"] == 2 and r["bad"] == [] for r in rs), rs
        size = rs[0]["nbytes"]
        # every reader read the victim's share again from the publishers (not torn, not from it)
        assert all(r["from_publishers"] > size // 3 for r in rs), [(r["from_publishers"], r["from_peers"]) for r in rs]
    finally:
        _stop(*others, victim, pub)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_corrupt_relay_is_read_around(store) -> None:
    """A relay that does not verify serves chunks corrupted in flight (a bit flipped in each of its
    reads): the relays that verify find it against the publisher's checksums,
    drop that relay for the pull and end bit-exact, its share read from the publishers."""
    pub = Worker("pub", PubActor, store.url, 0, 1, 1, staging=Staging(checksums=True))
    flip = ("flip-bit", {"on_reads": range(1, 1000), "min_bytes": 1024})  # every data read it makes
    bad = Worker("bad", SubActor, store.url, 1, 0, fused=False, zone=Zone("b", relay=True), fault=flip)
    good = _subs(store.url, 3, zone=Zone("b", relay=True), verify=True)
    try:
        pub.call("publish", 1)
        rs = call_all([bad, *good], "pull", 1, timeout=40.0)
        assert rs[0]["bad"], "the fault did not corrupt the unverified relay"
        assert all(r["v"] == 1 and r["bad"] == [] for r in rs[1:]), rs[1:]
    finally:
        _stop(*good, bad, pub)


def _until_begun(store, v: int, within: float = 30.0) -> None:
    """Returns once a relay of zone ``b`` says it writes version ``v``."""
    deadline = time.monotonic() + within
    while not any(r.get("v") == v for r in _zone_records(store, "b").values()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no relay of zone b began version {v}")
        time.sleep(0.005)


class _CountingSub(SubActor):
    """A ``SubActor`` whose subscriber's store calls (its zone reader's scans and waits among them)
    are counted, by ``benchmarks/control_plane.CountingStore``: its subscriber opens no store of
    its own but is given that one."""

    def __init__(self, url: str, *args, **kwargs) -> None:
        from benchmarks.control_plane import CountingStore

        self.counted = CountingStore(open_store(url))
        super().__init__(self.counted, *args, **kwargs)

    def requests(self) -> int:
        return self.counted.total()


@pytest.mark.timeout(240)
def test_relay_waits_for_a_slow_peer_on_the_store(store) -> None:
    """A relay whose peer is slow to announce its range (its first read takes 2.5 s more) blocks on
    the zone's next announcement key (a TCPStore wait) until it gives up on the peer after
    ``STALL_MIN_S``: a few store requests for that second, where polling the records every 10 ms
    made hundreds. Both end bit-exact. The slow relay begins first: its delayed read is its own
    range (the fault delays its first read; begun after the waiting relay announced, that was its
    read of the waiting relay's range). (The waiting relay must start its pull while the slow one
    still reads: where a loaded machine started it later, a new pair of relays tries again.)"""
    pub = Worker("pub", PubActor, store.url, 0, 1, 1, zone="train", staging=Staging(checksums=True))
    kw = {"fused": False, "zone": Zone("b", relay=True), "timeout": None}
    try:
        for v in (1, 2, 3):
            waiting = Worker(f"waiting{v}", _CountingSub, store.url, 1, 0, **kw)
            slow = Worker(f"slow{v}", SubActor, store.url, 1, 0, fault=("slow", {"delay": 2.5}), **kw)
            try:
                for w in (waiting, slow):
                    w.result(60)
                pub.call("publish", v)
                before = waiting.call("requests")
                slow.send("pull", v)
                _until_begun(store, v)
                time.sleep(0.2)  # its own read is in (and sleeps): the waiting relay's range comes second
                waiting.send("pull", v)
                rs = [waiting.result(30), slow.result(30)]
                used = waiting.call("requests") - before
            finally:
                _stop(waiting, slow)
            assert all(r["v"] == v and r["bad"] == [] for r in rs), rs
            if rs[0]["t_start"] < rs[1]["t_ack"] - 1.5:  # it started while the slow peer had > 1.5 s to go
                break
        else:
            pytest.fail(f"the waiting relay never started its pull before its slow peer was done: {rs}")
        assert rs[0]["t_ack"] - rs[0]["t_start"] > 1.0, rs[0]  # it did wait for the slow peer
        # its whole pull's store requests: a reader polling every 10 ms through the 1.5 s or more of
        # waiting would add 150; one clean-clone run beside the engines counted 52 without one
        assert used < 100, used
    finally:
        _stop(pub)
