"""Delta updates (``Publisher(delta=True)``): subscribers one or a few versions behind read only
what changed, verified against the chunk checksums, and end bit-exact in every case: skipping
versions, falling further behind than the ring, joining late, a lease lapsed while frozen, tensors
overwritten between pulls, and a subscriber killed in the middle of a delta pull."""

from __future__ import annotations

import os
import time

import pytest

from wbridge import Async, Delta, Staging, ZeroCopy
from wbridge.errors import UsageError
from wbridge.pull.delta_cost import PROBES

from .delta_actors import DeltaPub, DeltaSub
from .harness import Worker, free_port

FRAC = 0.02  # elements changed per step: RL fine-tuning at lr 1e-6 changes 1-3% of bf16 elements


def start_paused_delta_pull(pub: Worker, sub: Worker, signal: str) -> None:
    """Publishes version 2 and starts ``sub``'s pull of it, which its pause fault stops half-way
    through the delta's read; returns once it is stopped there (``signal`` written)."""
    pub.call("step", 2, FRAC)
    sub.send("pull", min_version=2)
    deadline = time.monotonic() + 30
    while not os.path.exists(signal):
        assert time.monotonic() < deadline, "the delta pull never reached its delta read"
        time.sleep(0.02)


def test_delta_needs_a_staging_copy() -> None:
    # refused where the options are built: ZeroCopy has no delta at all, one slot has no previous one
    with pytest.raises(TypeError):
        ZeroCopy(delta=Delta())
    with pytest.raises(UsageError, match=r"write Staging\(slots=2, delta=\.\.\.\)"):
        Staging(slots=1, delta=Delta())
    with pytest.raises(UsageError, match=r"Delta\(history\)"):
        Delta(history=0)
    with pytest.raises(UsageError, match=r"Staging\(delta\)"):
        Staging(delta=True)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("transport", "staged", "odd"),
    [("tcp", False, False), ("local", True, False), ("tcp", True, False), ("tcp", False, True)],
)
def test_delta_pulls_are_bit_exact_and_read_little(transport: str, staged: bool, odd: bool) -> None:
    # odd: a 1001-byte tensor last makes the slot end on an odd byte (a short last pair)
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", DeltaPub, url, staging=Staging(delta=Delta()), transport=transport, odd=odd)
    sub = Worker("sub", DeltaSub, url, transport=transport, staged=staged, odd=odd)
    try:
        steps: list = []
        pub.call("publish")
        first = sub.call("pull", min_version=1)
        assert first["v"] == 1 and not first["delta"] and sub.call("bad", steps) == []
        for v in range(2, 5):
            steps.append((v, FRAC))
            assert pub.call("step", v, FRAC) == v
            got = sub.call("pull", min_version=v)
            assert got["v"] == v and got["delta"] and got["repaired"] == 0, got
            assert sub.call("bad", steps) == []
            # ~2 bytes per changed word for ~2% of the words (random new values), plus tables and headers
            assert got["nbytes"] < 0.06 * first["nbytes"], (got, first)
    finally:
        sub.stop()
        pub.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_skipping_falling_behind_and_joining_late() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker(
        "pub", DeltaPub, url, staging=Staging(delta=Delta(history=3)), transport="tcp", mode=Async(max_staleness=20)
    )
    sub = Worker("sub", DeltaSub, url, transport="tcp")
    late = None
    try:
        steps: list = []
        pub.call("publish")
        assert not sub.call("pull", min_version=1)["delta"]
        for v in (2, 3, 4):  # three versions at once: the union of three deltas
            steps.append((v, FRAC))
            pub.call("step", v, FRAC)
        got = sub.call("pull", min_version=4)
        assert got["v"] == 4 and got["delta"] and got["repaired"] == 0, got
        assert sub.call("bad", steps) == []
        for v in range(5, 9):  # four versions: more than the ring of three holds -> full pull
            steps.append((v, FRAC))
            pub.call("step", v, FRAC)
        got = sub.call("pull", min_version=8)
        assert got["v"] == 8 and not got["delta"] and got["why"] == "too-far-behind", got
        assert sub.call("bad", steps) == []
        late = Worker("late", DeltaSub, url, transport="tcp")  # joins at version 8: full pull first
        got = late.call("pull", min_version=8)
        assert got["v"] == 8 and not got["delta"] and late.call("bad", steps) == []
        steps.append((9, FRAC))
        pub.call("step", 9, FRAC)
        for w in (sub, late):
            got = w.call("pull", min_version=9)
            assert got["v"] == 9 and got["delta"] and got["repaired"] == 0, got
            assert w.call("bad", steps) == []
    finally:
        for w in (late, sub, pub):
            if w is not None:
                w.stop()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("staged", [False, True])
def test_tensors_overwritten_between_pulls_are_repaired(staged: bool) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", DeltaPub, url, staging=Staging(delta=Delta()), transport="tcp")
    # a TP=2 reader: its reads cover the checksum chunks only in part (row-split and column-split)
    sub = Worker("sub", DeltaSub, url, 2, 1, transport="tcp", staged=staged)
    try:
        steps = [(2, FRAC)]
        pub.call("publish")
        sub.call("pull", min_version=1)
        pub.call("step", 2, FRAC)
        sub.call("scribble", "model.layers.1.mlp.up_proj.weight")
        got = sub.call("pull", min_version=2)
        assert got["v"] == 2 and got["delta"], got
        if staged:  # the private buffer was not touched; the commit rewrites the live tensors
            assert got["repaired"] == 0, got
        else:
            assert got["repaired"] >= 1, got
        assert sub.call("bad", steps) == []
    finally:
        sub.stop()
        pub.stop()


@pytest.mark.timeout(180)
def test_subscriber_killed_mid_delta_pull_restarts_bit_exact(tmp_path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    signal = str(tmp_path / "paused")
    pub = Worker("pub", DeltaPub, url, staging=Staging(delta=Delta()), transport="tcp")
    # counted reads: 1 the first (full) pull, 2 the delta (header, tables, streams): pause there
    fault = ("pause", {"signal_path": signal, "on_reads": (2,), "min_bytes": 1024, "hold": 60.0})
    sub = Worker("sub", DeltaSub, url, transport="tcp", lease_ttl=2.0, fault=fault)
    again = None
    try:
        steps = [(2, FRAC)]
        pub.call("publish")
        assert not sub.call("pull", min_version=1)["delta"]
        start_paused_delta_pull(pub, sub, signal)
        sub.kill()
        again = Worker("again", DeltaSub, url, transport="tcp")
        got = again.call("pull", min_version=2)
        assert got["v"] == 2 and not got["delta"] and again.call("bad", steps) == []
        steps.append((3, FRAC))
        pub.call("step", 3, FRAC)  # one_step_off: waits out the dead subscriber's lease
        got = again.call("pull", min_version=3)
        assert got["v"] == 3 and got["delta"] and got["repaired"] == 0, got
        assert again.call("bad", steps) == []
    finally:
        for w in (again, sub, pub):
            if w is not None:
                w.stop()


def paused_in_delta_pull(tmp_path, staging: Staging) -> tuple[Worker, Worker, str]:
    """A publisher with ``staging`` and a subscriber that pulled version 1 and whose pull of version
    2 is stopped half-way through the delta (``start_paused_delta_pull``); and the path that releases it."""
    url = f"tcp://127.0.0.1:{free_port()}"
    signal, release = str(tmp_path / "paused"), str(tmp_path / "release")
    pub = Worker("pub", DeltaPub, url, transport="tcp", staging=staging, mode=Async(max_staleness=20))
    # counted reads: 1 the first (full) pull, 2 the delta (header, tables, streams): pause there
    fault = ("pause", {"signal_path": signal, "release_path": release, "on_reads": (2,), "hold": 60.0})
    sub = Worker("sub", DeltaSub, url, transport="tcp", fault=fault)
    try:
        pub.call("publish")
        sub.call("pull", min_version=1)
        start_paused_delta_pull(pub, sub, signal)
    except BaseException:
        sub.stop()
        pub.stop()
        raise
    return pub, sub, release


@pytest.mark.timeout(150)
def test_delta_rewritten_under_the_reader_is_not_used(tmp_path) -> None:
    pub, sub, release = paused_in_delta_pull(tmp_path, Staging(slots=4, delta=Delta(history=2)))
    try:
        for v in (3, 4):  # v4 rewrites delta buffer 4 % 2 (v2's); v2's slot (2 of 4) stays
            pub.call("step", v, FRAC)
        open(release, "w").close()
        got = sub.result(60.0)
        # the headers read again no longer say v2: none of the torn entries is applied and v2 is
        # read in full (without that check they would be, and the checksums would repair them)
        assert got["v"] == 2 and not got["delta"] and got["repaired"] == 0, got
        assert got["why"] == "header-changed", got
        assert sub.call("bad", [(2, FRAC)]) == []
        steps = [(v, FRAC) for v in (2, 3, 4)]
        steps.append((5, FRAC))
        pub.call("step", 5, FRAC)
        got = sub.call("pull", min_version=5)  # the union of the deltas of 3, 4 and 5 onto 2: too many
        assert got["v"] == 5 and not got["delta"] and got["why"] == "too-far-behind", got
        steps.append((6, FRAC))
        pub.call("step", 6, FRAC)
        got = sub.call("pull", min_version=6)
        assert got["v"] == 6 and got["delta"] and got["repaired"] == 0, got
        assert sub.call("bad", steps) == []
    finally:
        sub.stop()
        pub.stop()


@pytest.mark.timeout(150)
def test_slot_reused_under_a_delta_pull_retries(tmp_path) -> None:
    """A reader of whole slots reads the slot stamps in its one read of the deltas whole (their
    digests stand for the headers read again; no stamp read of its own after it): a slot reused
    under the pull still makes it retry with a newer version (``StaleVersionError`` inside
    ``pull``), though its deltas were intact."""
    pub, sub, release = paused_in_delta_pull(tmp_path, Staging(slots=2, delta=Delta(history=4)))
    try:
        for v in (3, 4):  # v4 reuses v2's slot (one of 2); v2's delta stays (a ring of 4)
            pub.call("step", v, FRAC)
        open(release, "w").close()
        got = sub.result(60.0)
        assert got["v"] == 4 and got["retries"] >= 1, got
        steps = [(v, FRAC) for v in (2, 3, 4, 5)]
        pub.call("step", 5, FRAC)
        got = sub.call("pull", min_version=5)
        # the delta whole (header, tables, streams) and the stamp: one read, no second
        assert got["v"] == 5 and got["delta"] and got["retries"] == 0 and got["link_reads"] == 1, got
        assert sub.call("bad", steps) == []
    finally:
        sub.stop()
        pub.stop()


@pytest.mark.timeout(150)
def test_lease_lapsed_while_stalled_rejoins_and_reads_deltas() -> None:
    """A one-step-off publisher waits for its subscribers' acks, so a subscriber frozen past its
    lease is counted dead and versions go on without it. Once resumed it joins again (a new id),
    and its tensors still hold the version it pulled: it reads the deltas since, bit-exact."""
    import signal

    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", DeltaPub, url, staging=Staging(delta=Delta()), transport="tcp", mode="one_step_off")
    sub = Worker("sub", DeltaSub, url, transport="tcp", lease_ttl=2.0)
    try:
        steps: list = []
        pub.call("publish")
        first = sub.call("pull", min_version=1)
        assert not first["delta"], first
        old_id = sub.call("sub_id")
        os.kill(sub.proc.pid, signal.SIGSTOP)  # frozen past its lease: versions 2 and 3 go on without it
        try:
            for v in (2, 3):
                steps.append((v, FRAC))
                pub.call("step", v, FRAC)
        finally:
            os.kill(sub.proc.pid, signal.SIGCONT)
        got = sub.call("pull", min_version=3)
        assert got["v"] == 3 and got["delta"], got
        assert got["nbytes"] < first["nbytes"] / 5, (got, first)
        assert sub.call("sub_id") != old_id, "the lapsed subscriber did not join again"
        assert sub.call("bad", steps) == []
    finally:
        sub.stop()
        pub.stop()


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("link_gbps", "latency", "tp"), [(0.1, 0.0, 1), (0.5, 0.3, 2)])
def test_the_subscriber_chooses_delta_or_full_by_what_each_costs(link_gbps: float, latency: float, tp: int) -> None:
    """Each pull says why it was a delta or full, and every pull is bit-exact. Over a 0.1 Gbit/s
    link the deltas of 2 % win by far and every pull takes them (a reader of whole slots: one read
    each). Over a link where every read waits 0.3 s (a round trip), a reader of TP rank 0 of 2 (a
    slice of each tensor: it reads its chunks' deltas in three reads, the headers and tables, their
    streams, the headers again) finds a delta pull about 2.5x slower than a full pull's one data
    read (its stamp read is not counted in it): after ``PROBES`` probes each pull is full by
    ``cost``, declined on the guess alone (no delta read)."""
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", DeltaPub, url, staging=Staging(delta=Delta()), transport="local")
    sub = Worker("sub", DeltaSub, url, transport="local", link_gbps=link_gbps, latency=latency, tp=tp)
    try:
        steps: list = []
        pub.call("publish")
        first = sub.call("pull", min_version=1)
        assert not first["delta"] and first["why"] == "no-base", first
        got = []
        for v in range(2, 9):
            steps.append((v, FRAC))
            pub.call("step", v, FRAC)
            got.append(sub.call("pull", min_version=v))
            assert got[-1]["v"] == v and got[-1]["delta"] == (got[-1]["why"] == "delta"), got[-1]
        assert sub.call("bad", steps) == []
        whys = [g["why"] for g in got]
        print(f"link {link_gbps} Gbit/s, {latency} s per read: {[(g['why'], g['link_reads']) for g in got]}")
        if not latency:
            assert whys == ["delta"] * len(got), whys
            assert [g["link_reads"] for g in got] == [1] * len(got), got  # the deltas and stamps: one read
            return
        assert whys == ["delta"] * PROBES + ["cost"] * (len(got) - PROBES), whys
        assert all(g["link_reads"] == first["link_reads"] for g in got[PROBES:]), got  # no delta read
    finally:
        sub.stop()
        pub.stop()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("slow_read", [3, 7])
def test_one_slow_delta_pull_does_not_turn_the_choice(slow_read: int) -> None:
    """Over a 0.1 Gbit/s link, where deltas of 2% win by far, one delta pull's reads are held up by
    2 s, 4x a full pull (a process descheduled on a busy host, or the first delta pull's one-time
    costs): the first delta pull (read 3) or a later one (read 7). Every pull after the first is
    a delta still: the running costs are the least of the latest measurements and two probes come
    before any decline. (With a running mean, one slow probe made the next 32 pulls full.)"""
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", DeltaPub, url, staging=Staging(delta=Delta()), transport="local")
    fault = ("slow", {"delay": 2.0, "on_reads": [slow_read]})
    sub = Worker("sub", DeltaSub, url, transport="local", link_gbps=0.1, fault=fault)
    try:
        steps: list = []
        pub.call("publish")
        first = sub.call("pull", min_version=1)
        assert first["why"] == "no-base", first
        whys = []
        for v in range(2, 9):
            steps.append((v, FRAC))
            pub.call("step", v, FRAC)
            t0 = time.monotonic()
            got = sub.call("pull", min_version=v)
            whys.append((got["why"], round(time.monotonic() - t0, 2)))
        print(whys)
        assert [w for w, _ in whys] == ["delta"] * len(whys), whys
        assert max(s for _, s in whys) >= 2.0, whys  # the slow read was one of them
        assert sub.call("bad", steps) == []
    finally:
        sub.stop()
        pub.stop()
