"""One conformance suite for every transport that imports here (``transports.available()``).

Each case runs a reading transport in this process against a serving transport in another OS
process (``peer.Peer``). A transport joins automatically once its module imports and its
``usable()`` (if any) says yes. Hooks a transport class may define:

- ``conformance_skips``: ``{case: reason}``, to opt out of a case that does not apply to it (the
  case is skipped with that reason). Cases: ``roundtrip``, ``mixed``, ``many``, ``edges``, ``bounds``,
  ``forged``, ``deregister``, ``auth``, ``killed``, ``stopped``, ``close``, ``leaks``, ``process``.
- ``conformance_variants``: ``{label: constructor keywords}``, to run the suite once per variant
  (``local`` runs its ``memfd`` and ``vm`` paths).
- ``two_sided = True``: the serving process's transport takes part in each read; the suite then asks
  it to call ``serve(timeout=...)`` once before every read it posts.
- ``num_regions`` (property), where present, must drop back to 0 once everything is deregistered.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transports
from transports import AuthError, TransportError
from transports.base import ReadBatch

from .engine_checks import fd_targets
from .peer import Peer, region_bytes, run_client

pytestmark = pytest.mark.timeout(120)

TOKEN = "conformance-token"
#: Served regions: odd sizes so no read lines up with a page by accident.
REGIONS = [{"size": (4 << 20) + 123, "seed": 11}, {"size": (1 << 20) - 7, "seed": 12}]
TIMEOUT = 20.0
STARTUP = 90.0  # a loaded CI machine may take long to import torch and engines in a fresh process
GARBAGE = 0xC3


def _variants() -> list:
    out = []
    for name in transports.available():
        cls = transports.get(name)
        for label, opts in dict(getattr(cls, "conformance_variants", {"": {}})).items():
            out.append(pytest.param((name, dict(opts)), id=f"{name}-{label}" if label else name))
    return out


@pytest.fixture(scope="module", params=_variants())
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def server(variant):
    name, opts = variant
    with Peer(name, REGIONS, token=TOKEN, options=opts, timeout=STARTUP) as peer:
        yield peer
        assert peer.stop() == 0, "serving process did not exit cleanly"


@pytest.fixture(scope="module")
def expected():
    return [region_bytes(r["size"], r["seed"]) for r in REGIONS]


def applies(variant, case: str) -> None:
    name, _ = variant
    reason = dict(getattr(transports.get(name), "conformance_skips", {})).get(case)
    if reason:
        pytest.skip(f"{name} opts out of {case!r}: {reason}")


class Reader:
    """The reading side of one case: a transport, a garbage-filled destination, an open peer."""

    def __init__(self, variant, server: Peer, dst_size: int, token: str | None = TOKEN) -> None:
        name, opts = variant
        self.cls = transports.get(name)
        self.server = server
        self.t = self.cls(token=token.encode() if token else None, **opts)
        self.dst = np.empty(dst_size, dtype=np.uint8)
        self.dst.fill(GARBAGE)
        self.local = self.t.register(self.dst.ctypes.data, dst_size)
        self.peer = None

    def connect(self) -> Reader:
        self.peer = self.t.connect(self.server.endpoint, timeout=TIMEOUT)
        return self

    def prepare(self, batch: ReadBatch, descriptors=None):
        return self.t.prepare(self.peer, descriptors or self.server.descriptors, [self.local], batch)

    def read(self, prep, timeout: float = TIMEOUT) -> None:
        if getattr(self.cls, "two_sided", False):
            self.server.post(op="call", method="serve", kwargs={"timeout": timeout})
        self.t.read(prep, timeout=timeout)

    def close(self) -> None:
        self.t.close()


@pytest.fixture
def reader_factory(variant, server):
    made = []

    def make(dst_size: int, token: str | None = TOKEN) -> Reader:
        r = Reader(variant, server, dst_size, token)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def apply_reference(dst: np.ndarray, batch: ReadBatch, expected) -> np.ndarray:
    """What ``dst`` must hold after ``batch``: the same reads done by numpy."""
    want = dst.copy()
    for s, so, _, do, n in zip(
        *(c.tolist() for c in (batch.src_region, batch.src_offset, batch.dst_region, batch.dst_offset, batch.nbytes))
    ):
        want[do : do + n] = expected[s][so : so + n]
    return want


# -- cases ------------------------------------------------------------------------------------
def test_descriptor_roundtrip(variant, server, reader_factory, expected):
    """Endpoints and descriptors are plain bytes that survive any byte transport (the store)."""
    applies(variant, "roundtrip")
    for blob in [server.endpoint, *server.descriptors]:
        assert isinstance(blob, bytes) and blob
    again = [bytes.fromhex(d.hex()) for d in server.descriptors]
    r = reader_factory(64)
    r.peer = r.t.connect(bytes(bytearray(server.endpoint)), timeout=TIMEOUT)
    prep = r.prepare(ReadBatch.of([(1, 5, 0, 0, 64)]), again)
    r.read(prep)
    assert np.array_equal(r.dst, expected[1][5:69])
    with pytest.raises(TransportError):
        r.t.connect(b"\x00not an endpoint\xff", timeout=TIMEOUT)
    with pytest.raises(TransportError):
        r.prepare(ReadBatch.of([(0, 0, 0, 0, 8)]), [b"{not a descriptor"])


def test_mixed_batch_bit_exact(variant, server, reader_factory, expected):
    """Thousands of small reads and a few large ones in one batch; bytes between reads stay as they were."""
    applies(variant, "mixed")
    rng = np.random.default_rng(7)
    small = rng.integers(1, 600, 3000)
    large = np.array([(1 << 20) + 3, 700_001, 2 << 20])
    sizes = np.concatenate([small, large])
    order = rng.permutation(len(sizes))
    sizes = sizes[order]
    gaps = rng.integers(0, 40, len(sizes))  # untouched bytes between destinations
    dst_off = np.cumsum(gaps) + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    src_region = rng.integers(0, 2, len(sizes))
    src_region[sizes > (1 << 20) - 7] = 0  # the largest read only fits region 0
    limit = np.array([REGIONS[0]["size"], REGIONS[1]["size"]])[src_region] - sizes
    src_off = (rng.random(len(sizes)) * (limit + 1)).astype(np.int64)
    batch = ReadBatch(src_region, src_off, np.zeros(len(sizes)), dst_off, sizes)
    r = reader_factory(int(dst_off[-1] + sizes[-1] + 100)).connect()
    want = apply_reference(r.dst, batch, expected)
    prep = r.prepare(batch)
    for _ in range(2):  # prepare once, read many; garbage again in between
        r.dst.fill(GARBAGE)
        r.read(prep)
        bad = np.flatnonzero(r.dst != want)
        assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:5]}"


def test_many_small_reads_bit_exact(variant, server, reader_factory, expected):
    """A batch the planner makes for column slices, large: 24,000 reads in evenly spaced families
    (the rows of a slice, one running backwards), one family's destinations back to back, plus
    irregular reads between them; bit-exact, twice from one prepare."""
    applies(variant, "many")
    rng = np.random.default_rng(9)
    rows = []
    # rows of a [8192, 256]-byte slice out of 512-byte rows of region 0, landing back to back
    k = np.arange(8192)
    rows.append(np.stack([0 * k, k * 512 + 64, 0 * k, k * 256, 0 * k + 256], 1))
    # a second family from region 1, backwards, into spaced destinations
    k = np.arange(12000)
    rows.append(np.stack([0 * k + 1, 1_000_000 - 80 * k, 0 * k, (1 << 21) + k * 100, 0 * k + 72], 1))
    # irregular short reads
    n = rng.integers(1, 300, 3808)
    rows.append(
        np.stack([0 * n, rng.integers(0, (4 << 20) - 300, len(n)), 0 * n, (4 << 21) + np.arange(len(n)) * 300, n], 1)
    )
    batch = ReadBatch.of(np.concatenate(rows))
    assert len(batch) == 24000
    r = reader_factory((4 << 21) + 3808 * 300).connect()
    want = apply_reference(r.dst, batch, expected)
    prep = r.prepare(batch)
    for _ in range(2):
        r.dst.fill(GARBAGE)
        r.read(prep)
        bad = np.flatnonzero(r.dst != want)
        assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:5]}"


def test_region_edges(variant, server, reader_factory, expected):
    applies(variant, "edges")
    s0, s1 = REGIONS[0]["size"], REGIONS[1]["size"]
    rows = [
        (0, 0, 0, 0, 1),
        (0, s0 - 1, 0, 1, 1),
        (1, s1 - 1, 0, 2, 1),
        (1, 0, 0, 3, s1),
        (0, s0 - 4097, 0, 3 + s1, 4097),
        (0, 0, 0, 3 + s1 + 4097, s0),
    ]
    batch = ReadBatch.of(rows)
    r = reader_factory(3 + s1 + 4097 + s0).connect()  # the last read ends on the destination's last byte
    want = apply_reference(r.dst, batch, expected)
    r.read(r.prepare(batch))
    assert np.array_equal(r.dst, want)


@pytest.mark.parametrize(
    "row",
    [
        (0, REGIONS[0]["size"] - 10, 0, 0, 11),  # one byte past the end of a remote region
        (1, -1, 0, 0, 4),  # negative offset
        (2, 0, 0, 0, 4),  # no such remote region
        (0, 0, 0, 1000, 100),  # past the end of the destination
        (0, 0, 1, 0, 4),  # no such destination region
        (0, 0, 0, 0, 0),  # empty read
    ],
)
def test_prepare_refuses_out_of_bounds(variant, server, reader_factory, row):
    applies(variant, "bounds")
    r = reader_factory(1024).connect()
    with pytest.raises(TransportError):
        r.prepare(ReadBatch.of([(0, 0, 0, 0, 8), row]))
    assert (r.dst == GARBAGE).all()


def _near(x: int) -> st.SearchStrategy[int]:
    return st.integers(x - 40, x + 40)


#: What a hostile plan puts in a batch: values near 2**63 and 2**64 (where int64 arithmetic wraps),
#: their negatives, near 2**31, 2**32 and the regions' ends, any 70-bit integer, and honest values.
HOSTILE = st.one_of(
    *(_near(x) for x in (2**63, 2**64, -(2**63), -(2**64), 2**31, 2**32, REGIONS[1]["size"], 4096)),
    st.integers(-(2**70), 2**70),
    st.integers(0, 4096),
)


def _inside(row: tuple, remote_sizes: list[int], local_size: int) -> bool:
    """Whether a read lies inside its regions, in Python's unbounded integers."""
    src, src_off, dst, dst_off, n = row
    return (
        0 <= src < len(remote_sizes)
        and dst == 0
        and n > 0
        and 0 <= src_off <= remote_sizes[src] - n
        and 0 <= dst_off <= local_size - n
    )


def test_hostile_offsets_refused_or_exact(variant, server, expected):
    """Property: any batch row, however far out (offsets and sizes near 2**63 and 2**64, negative,
    wider than 64 bits), is refused with ``TransportError`` before a byte moves, or lies inside its
    regions and reads bit-exact. The reader and the serving process live on."""
    applies(variant, "bounds")
    sizes = [r["size"] for r in REGIONS]
    r = Reader(variant, server, 4096).connect()

    @settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        src=st.sampled_from([0, 1]) | HOSTILE,
        src_off=HOSTILE,
        dst=st.just(0) | HOSTILE,
        dst_off=HOSTILE,
        n=HOSTILE,
    )
    def check(src: int, src_off: int, dst: int, dst_off: int, n: int) -> None:
        row = (src, src_off, dst, dst_off, n)
        r.dst.fill(GARBAGE)
        try:
            prep = r.prepare(ReadBatch.of([row]))
        except TransportError:
            assert (r.dst == GARBAGE).all(), f"{row}: bytes moved before the refusal"
            return
        assert _inside(row, sizes, 4096), f"{row}: outside its regions, yet prepared"
        r.read(prep)
        r.t.release(prep)
        want = np.full(4096, GARBAGE, dtype=np.uint8)
        want[dst_off : dst_off + n] = expected[src][src_off : src_off + n]
        assert np.array_equal(r.dst, want), f"{row}: not bit-exact"

    try:
        check()
        r.dst.fill(GARBAGE)  # still an honest reader
        r.read(r.prepare(ReadBatch.of([(1, 7, 0, 0, 4096)])))
        assert np.array_equal(r.dst, expected[1][7:4103])
    finally:
        r.close()
    assert server.proc.poll() is None, "the serving process died"


#: Rows whose int64 arithmetic wraps, or that no int64 holds (round 4's red team: SIGSEGV in local).
HOSTILE_ROWS = [
    (0, 2**63 - 8, 0, 0, 16),  # src_offset + nbytes wraps negative
    (0, 0, 0, 2**63 - 8, 16),  # dst_offset + nbytes wraps negative
    (0, 16, 0, 0, 2**63 - 8),  # nbytes + src_offset wraps
    (0, 2**63 - 1, 0, 2**63 - 1, 2**63 - 1),
    (0, 2**64 - 8, 0, 0, 16),  # as uint64 it is -8; no int64 holds it
    (0, 0, 0, 2**64 - 8, 16),
    (0, 0, 0, 0, 2**64 - 1),
    (0, -(2**63), 0, 0, 16),
    (1, 8, 0, -8, 16),
    (2**63 - 1, 0, 0, 0, 16),
    (0, 0, 2**63 - 1, 0, 16),
]


def test_hostile_batch_in_a_reader_process(variant, server):
    """A reading process posts each hostile row as its own batch: each is a ``TransportError`` (not a
    SIGSEGV), then it reads every region bit-exact and exits 0; the serving process lives on."""
    applies(variant, "bounds")
    name, opts = variant
    done = run_client(
        name,
        server.endpoint,
        server.descriptors,
        REGIONS,
        token=TOKEN,
        options=opts,
        timeout=TIMEOUT,
        refuse=HOSTILE_ROWS,
    )
    died = f" (killed by {signal.Signals(-done.returncode).name})" if done.returncode < 0 else ""
    assert done.returncode == 0, f"reader exited {done.returncode}{died}: {done.stderr[-2000:]}"
    assert done.stderr.count("hostile row refused") == len(HOSTILE_ROWS), done.stderr[-2000:]
    assert server.proc.poll() is None, "the serving process died"


def test_constructor_checks_its_options_and_host(variant):
    """Every transport checks its options against its own constructor's signature (the schema
    wbridge checks ``transport_options`` with) and refuses a wildcard host, before it starts."""
    name, opts = variant
    cls = transports.get(name)
    assert cls.check_options(opts) == opts
    for bad in ({"bogus_option": 1}, {"token": "t"}, {"host": "127.0.0.1"}, 5):
        with pytest.raises(TransportError):
            cls.check_options(bad)
    with pytest.raises(TransportError, match="bogus_option"):
        cls(token=TOKEN.encode(), bogus_option=1, **opts)
    for host in ("", "0.0.0.0", "::", 5):
        with pytest.raises(TransportError, match="host"):
            cls(token=TOKEN.encode(), host=host, **opts)


def _forge(descriptor: bytes, nbytes: int) -> bytes:
    try:
        d = json.loads(descriptor)
    except ValueError:
        pytest.skip("descriptor is not JSON with an 'nbytes' field; define conformance_skips['forged']")
    if "nbytes" not in d:
        pytest.skip("descriptor has no 'nbytes' field; define conformance_skips['forged']")
    d["nbytes"] = nbytes
    return json.dumps(d).encode()


def test_forged_descriptor_refused(variant, server, reader_factory, expected):
    """A client that bypasses the bounds check (a descriptor claiming more bytes) gets nothing outside."""
    applies(variant, "forged")
    size = REGIONS[1]["size"]
    forged = [server.descriptors[0], _forge(server.descriptors[1], size + (1 << 20))]
    r = reader_factory(size + 4096).connect()
    with pytest.raises(TransportError):
        r.read(r.prepare(ReadBatch.of([(1, size - 100, 0, 0, 4196)]), forged))
    assert (r.dst[100:] == GARBAGE).all(), "bytes from beyond the region arrived"
    r.dst.fill(GARBAGE)  # the same reader still works for honest reads (the connection survived or reopened)
    r.read(r.prepare(ReadBatch.of([(1, size - 100, 0, 0, 100)])))
    assert np.array_equal(r.dst[:100], expected[1][-100:]) and (r.dst[100:] == GARBAGE).all()


def test_deregistered_region_refused(variant, server, reader_factory):
    applies(variant, "deregister")
    desc = bytes.fromhex(server.command(op="register", size=8192, seed=99)["descriptor"])
    index = len(server.descriptors)
    r = reader_factory(8192).connect()
    prep = r.prepare(ReadBatch.of([(0, 0, 0, 0, 8192)]), [desc])
    r.read(prep)
    assert np.array_equal(r.dst, region_bytes(8192, 99))
    server.command(op="deregister", index=index)
    r.dst.fill(GARBAGE)
    with pytest.raises(TransportError):
        r.read(prep)
    assert (r.dst == GARBAGE).all()


def test_wrong_token(variant, server, reader_factory, expected):
    applies(variant, "auth")
    r = reader_factory(64, token="not-the-token")
    with pytest.raises(AuthError):
        r.connect()
        r.read(r.prepare(ReadBatch.of([(0, 0, 0, 0, 64)])))
    assert (r.dst == GARBAGE).all()
    good = reader_factory(64).connect()  # the server shrugged it off
    good.read(good.prepare(ReadBatch.of([(0, 0, 0, 0, 64)])))
    assert np.array_equal(good.dst, expected[0][:64])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_dead_peer_raises_within_timeout(variant, reader_factory, how):
    """SIGKILL (or SIGSTOP: a hung peer) the serving process while reads are running."""
    applies(variant, how)
    name, opts = variant
    size = 64 << 20
    with Peer(name, [{"size": size, "seed": 3}], token=TOKEN, options=opts, fill="pattern", timeout=STARTUP) as peer:
        r = Reader(variant, peer, size)
        try:
            r.connect()
            prep = r.prepare(
                ReadBatch(
                    np.zeros(16),
                    np.arange(16) * (4 << 20),
                    np.zeros(16),
                    np.arange(16) * (4 << 20),
                    np.full(16, 4 << 20),
                )
            )
            first, result = threading.Event(), {}
            timeout = 5.0
            worker = threading.Thread(target=lambda: _reads_until_error(r, prep, first, result, timeout), daemon=True)
            worker.start()
            assert first.wait(TIMEOUT), "no read completed"
            os.kill(peer.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            t0 = time.monotonic()
            worker.join(timeout + 10)
            assert not worker.is_alive(), "read hung past its timeout"
            assert isinstance(result.get("error"), TransportError), result
            assert result["at"] - t0 < timeout + 5
        finally:
            if how == "stopped":
                os.kill(peer.pid, signal.SIGKILL)
            r.close()
            peer.kill()


def _reads_until_error(r: Reader, prep, first: threading.Event, result: dict, timeout: float) -> None:
    try:
        while True:
            r.read(prep, timeout=timeout)
            first.set()
    except BaseException as e:  # noqa: BLE001 - inspected by the test
        result["error"], result["at"] = e, time.monotonic()
        first.set()


def test_close_idempotent(variant, server, reader_factory):
    applies(variant, "close")
    r = reader_factory(64).connect()
    prep = r.prepare(ReadBatch.of([(0, 0, 0, 0, 64)]))
    r.read(prep)
    r.t.release(prep)
    r.t.disconnect(r.peer)
    r.t.disconnect(r.peer)
    r.t.deregister(r.local)
    r.t.deregister(r.local)
    r.t.close()
    r.t.close()
    assert r.t.closed
    with pytest.raises(TransportError):
        r.t.connect(server.endpoint, timeout=TIMEOUT)
    with r.cls(token=TOKEN.encode(), **variant[1]) as t:  # context manager closes too
        assert not t.closed
    assert t.closed
    assert "closed=True" in repr(t)


def _threads() -> set:
    return {t.ident for t in threading.enumerate()}


@pytest.mark.slow
def test_no_leaks_over_100_cycles(variant, server, expected):
    """open, connect, prepare, read, release, disconnect, close: 100 times, nothing left behind."""
    applies(variant, "leaks")
    name, opts = variant
    cls = transports.get(name)
    dst = np.empty(4096, dtype=np.uint8)

    def cycle() -> None:
        with cls(token=TOKEN.encode(), **opts) as t:
            local = t.register(dst.ctypes.data, dst.nbytes)
            peer = t.connect(server.endpoint, timeout=TIMEOUT)
            prep = t.prepare(peer, server.descriptors, [local], ReadBatch.of([(0, 10, 0, 0, 4096)]))
            dst.fill(GARBAGE)
            if getattr(cls, "two_sided", False):
                server.post(op="call", method="serve", kwargs={"timeout": TIMEOUT})
            t.read(prep, timeout=TIMEOUT)
            assert np.array_equal(dst, expected[0][10:4106])
            t.release(prep)
            t.disconnect(peer)
            t.deregister(local)
            if hasattr(t, "num_regions"):
                assert t.num_regions == 0

    cycle()  # warm-up: lazily created pools, imports
    base = _settled(server)
    gc.collect()
    fds, threads = fd_targets(), _threads()
    for _ in range(100):
        cycle()
    gc.collect()
    new_fds = fd_targets() - fds
    assert not new_fds, f"{sum(new_fds.values())} client file descriptors left open: {list(new_fds)[:5]}"
    new_threads = [t for t in threading.enumerate() if t.ident not in threads]
    assert not new_threads, f"client threads left running: {new_threads}"
    assert _settled(server) == base


def _settled(server: Peer) -> dict:
    """The serving process's resource counts once it has noticed every closed connection (bounded wait)."""
    deadline = time.monotonic() + TIMEOUT
    last = None
    while True:
        now = {k: v for k, v in server.command(op="stats").items() if k != "ok"}
        if (now == last and now["connections"] in (0, None)) or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.05)


@pytest.mark.slow
def test_client_process_exits_zero(variant, server):
    """A reading process and the serving process are separate OS processes; both exit with status 0."""
    applies(variant, "process")
    name, opts = variant
    done = run_client(name, server.endpoint, server.descriptors, REGIONS, token=TOKEN, options=opts, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
