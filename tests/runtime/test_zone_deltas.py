"""Deltas across zones (``wbridge.pull.zone``): relays read the deltas of their byte ranges from the
publishers, apply them to the version their buffer holds, check and serve them to the zone; the
bytes read from publishers (what would cross the link between clusters) are a few percent of the
model per version, every replica bit-exact. A new relay, or one whose deltas cannot be used, reads
its range in full; a relay killed mid-version is read around."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

from wbridge import Async, Delta, Shard, Staging, Zone, open_store

from .actors import TOKEN
from .harness import Worker, call_all, free_port

ROWS, COLS, TENSORS = 512, 1024, 8  # 8 bf16 tensors of 1 MiB
MODEL = ROWS * COLS * 2 * TENSORS
CHANGED = 0.015  # of the elements per version: what an AdamW step at lr 1e-6 changes in bf16


def _tensors() -> dict:
    import torch

    return {f"w{i}": torch.zeros((ROWS, COLS), dtype=torch.bfloat16) for i in range(TENSORS)}


def _words(t) -> np.ndarray:
    """A bf16 tensor's elements as int16 (numpy, the same memory)."""
    import torch

    return t.view(-1).view(torch.int16).numpy()


def _digest(tensors: dict) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class DeltaPub:
    """A publisher with deltas whose versions each change ``CHANGED`` of the bf16 words (seeded).

    - ``url``: the store's URL.
    """

    def __init__(self, url: str) -> None:
        from wbridge import Publisher

        self.t = _tensors()
        rng = np.random.default_rng(0)
        for t in self.t.values():
            _words(t)[:] = rng.integers(-(2**14), 2**14, ROWS * COLS)
        self.pub = Publisher("zd", url, token=TOKEN, staging=Staging(delta=Delta()), mode=Async(max_staleness=8))
        self.pub.register({n: (t, Shard(n, (ROWS, COLS))) for n, t in self.t.items()})

    def publish(self, v: int) -> str:
        rng = np.random.default_rng(v)
        for t in self.t.values():
            words = _words(t)
            idx = rng.choice(len(words), int(CHANGED * len(words)), replace=False)
            words[idx] += 1
        got = self.pub.publish(timeout=30.0)
        assert got == v, (got, v)
        return _digest(self.t)

    def close(self) -> None:
        self.pub.close()


class ZoneSub:
    """A staged subscriber of zone ``far``.

    - ``url``: the store's URL.
    - ``relay``: it relays (else it reads from the zone's relays).
    - ``fault``: ``(wrapper name, keywords)`` of ``wbridge.testing.faults`` for its transports, or None.
    - ``kwargs``: more ``Subscriber`` keywords.
    """

    def __init__(self, url: str, relay: bool, fault: tuple | None = None, **kwargs) -> None:
        from wbridge import Subscriber

        self.t = _tensors()
        self.sub = Subscriber("zd", url, token=TOKEN, staged=True, zone=Zone("far", relay=relay), **kwargs)
        if fault is not None:
            from wbridge.testing.faults import inject, wrapper

            inject(self.sub, wrapper(fault[0], **fault[1]))
        self.sub.register({n: (t, Shard(n, (ROWS, COLS))) for n, t in self.t.items()})

    def pull(self, v: int, timeout: float = 30.0) -> dict:
        got = self.sub.pull(min_version=v, timeout=timeout)
        s = self.sub.stats.last
        return {
            "v": got,
            "digest": _digest(self.t),
            "delta": s.delta,
            "why": s.delta_reason,
            "from_publishers": s.nbytes_from_publishers,
            "from_peers": s.nbytes_from_peers,
        }

    def close(self) -> None:
        self.sub.close()


@pytest.fixture
def url():
    s = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
    yield s.url
    s.close()


def _exact(rs: list[dict], v: int, want: str) -> None:
    assert all(r["v"] == v and r["digest"] == want for r in rs), [(r["v"], r["digest"] == want) for r in rs]


def _link(rs: list[dict]) -> float:
    """Bytes the zone read from publishers (the link between clusters), over the model's."""
    return sum(r["from_publishers"] for r in rs) / MODEL


@pytest.mark.timeout(240)
def test_relays_pull_deltas_across_the_link(url: str) -> None:
    """3 relays and a reader of the zone, 5 versions: after their first pull the relays apply the
    deltas of their ranges (the zone reads 3-4% of the model from publishers per version, where
    whole versions read at least 1x), the reader reads only from relays, every pull bit-exact. A
    relay joining at version 4 reads its range in full, and applies deltas from version 5 on; a
    relay further behind than the publishers' ring of deltas reads its range in full."""
    pub = Worker("pub", DeltaPub, url)
    relays = [Worker(f"relay{i}", ZoneSub, url, True, timeout=None) for i in range(3)]
    reader = Worker("reader", ZoneSub, url, False, timeout=None)
    fresh = None
    try:
        for w in (*relays, reader):
            w.result(60)
        want = pub.call("publish", 1)
        rs = call_all([*relays, reader], "pull", 1)
        _exact(rs, 1, want)
        assert not any(r["delta"] for r in rs) and _link(rs) >= 1.0, rs  # nothing held: whole ranges
        for v in (2, 3):
            want = pub.call("publish", v)
            rs = call_all([*relays, reader], "pull", v)
            _exact(rs, v, want)
            assert all(r["delta"] for r in rs[:3]), [r["delta"] for r in rs]
            assert rs[3]["from_publishers"] == 0 and rs[3]["from_peers"] == MODEL, rs[3]
            assert rs[3]["why"] == "zone" and {r["why"] for r in rs[:3]} == {"delta"}, rs
            assert 0 < _link(rs) <= 0.05, _link(rs)
        fresh = Worker("fresh", ZoneSub, url, True)
        want = pub.call("publish", 4)
        rs = call_all([*relays, fresh], "pull", 4)
        _exact(rs, 4, want)
        assert all(r["delta"] for r in rs[:3]) and not rs[3]["delta"], [r["delta"] for r in rs]
        # the fresh relay read its quarter of the buffer in full; the others deltas of theirs
        assert MODEL // 5 < rs[3]["from_publishers"] < MODEL // 3, rs[3]
        assert all(r["from_publishers"] < 0.02 * MODEL for r in rs[:3]), rs
        want = pub.call("publish", 5)
        rs = call_all([*relays, fresh, reader], "pull", 5)
        _exact(rs, 5, want)
        assert all(r["delta"] for r in rs[:4]), [r["delta"] for r in rs]
        assert 0 < _link(rs) <= 0.05, _link(rs)
        # relay 0 sits out versions 6 to 9: at 10 it is further behind than the ring (Delta(history=4))
        # and reads its range in full; the others keep to deltas (its range, while it sat out, too)
        for v in range(6, 11):
            want = pub.call("publish", v)
            rs = call_all([*relays[1:], fresh] if v < 10 else [*relays, fresh], "pull", v)
            _exact(rs, v, want)
            assert all(r["delta"] for r in rs[-3:]), (v, [r["delta"] for r in rs])
        assert not rs[0]["delta"] and MODEL // 5 < rs[0]["from_publishers"] < MODEL // 3, rs[0]
    finally:
        for w in (reader, *relays, *([fresh] if fresh else []), pub):
            w.stop()


@pytest.mark.timeout(180)
def test_relay_killed_mid_delta_pull(url: str, tmp_path) -> None:
    """A relay dies in the middle of reading its range's deltas of version 3 (it withdrew its
    ranges, announced none): the others read the deltas of its range from the publishers, end
    bit-exact, and pull version 4 as deltas again without it."""
    signal, release = tmp_path / "paused", tmp_path / "release"
    release.touch()  # versions 1 and 2: the victim's reads pass
    fault = ("pause", {"signal_path": str(signal), "release_path": str(release), "on_reads": range(1, 10_000)})
    pub = Worker("pub", DeltaPub, url)
    victim = Worker("victim", ZoneSub, url, True, fault=fault, lease_ttl=2.0, timeout=None)
    others = [Worker(f"relay{i}", ZoneSub, url, True, lease_ttl=2.0, timeout=None) for i in range(3)]
    try:
        for w in (victim, *others):
            w.result(60)
        for v in (1, 2):
            want = pub.call("publish", v)
            _exact(call_all([victim, *others], "pull", v), v, want)
        os.unlink(release)
        signal.write_text("")
        want = pub.call("publish", 3)
        for w in (victim, *others):
            w.send("pull", 3, timeout=30.0)
        deadline = time.monotonic() + 20
        while not signal.read_text() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert signal.read_text(), "the victim never paused mid-read"
        victim.kill()
        rs = [w.result(40) for w in others]
        _exact(rs, 3, want)
        # their own ranges came as deltas, and so did the victim's once they gave up waiting for it
        # (their buffers held version 2 there): no range crossed the link in full
        assert all(r["delta"] for r in rs) and _link(rs) <= 0.1, (rs, _link(rs))
        want = pub.call("publish", 4)
        rs = call_all(others, "pull", 4, timeout=30.0)
        _exact(rs, 4, want)
        assert all(r["delta"] for r in rs) and _link(rs) <= 0.05, (rs, _link(rs))
    finally:
        for w in (*others, victim, pub):
            w.stop()


@pytest.mark.timeout(120)
def test_zone_reader_without_relays_takes_deltas(url: str) -> None:
    """A subscriber of a zone with no relay to read from reads the publishers: as deltas once it
    holds a version, as a subscriber without a zone does (before, whole versions, every time)."""
    pub = Worker("pub", DeltaPub, url)
    reader = Worker("reader", ZoneSub, url, False)
    try:
        for v in (1, 2, 3):
            want = pub.call("publish", v)
            r = reader.call("pull", v)
            _exact([r], v, want)
            assert r["delta"] == (v > 1) and r["from_peers"] == 0, r
            assert (r["from_publishers"] <= 0.05 * MODEL) == (v > 1), r
    finally:
        reader.stop()
        pub.stop()
