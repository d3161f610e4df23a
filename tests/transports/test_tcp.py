"""``tcp`` beyond the conformance suite: stream balancing, scatter I/O, hung peers, reconnection."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transports import AuthError, TransportError, _iov
from transports._regions import RegionTable
from transports._util import split_and_balance
from transports.base import ReadBatch
from transports.tcp import ServerConfig, TcpTransport, _server_handshake

pytestmark = pytest.mark.timeout(60)
TOKEN = b"tcp-token"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50_000), min_size=1, max_size=100), st.integers(1, 8), st.integers(256, 20_000))
def test_split_and_balance_covers_every_byte_once(sizes, streams, split):
    nbytes = np.asarray(sizes, dtype=np.int64)
    op, start, stream = split_and_balance(nbytes, streams, split)
    size = np.minimum(nbytes[op] - start, split)
    assert (size > 0).all() and (size <= split).all()
    want = [(i, s) for i, n in enumerate(sizes) for s in range(0, n, split)]  # pieces tile each read exactly
    assert list(zip(op.tolist(), start.tolist())) == want
    assert (np.diff(stream) >= 0).all()  # consecutive runs per stream
    loads = np.bincount(stream, weights=size, minlength=streams)
    assert loads.max() - loads.min() <= 2 * split


def test_gather_send_and_scatter_receive_past_iov_max():
    """Pieces cut differently on each side, over a tiny send buffer and a socket with a timeout (so
    every partial and would-block path of writev/readv runs), land bit-exact."""
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 200_000, dtype=np.uint8)
    dst = np.zeros_like(src)

    def iov(arr: np.ndarray, pieces: int) -> np.ndarray:
        cuts = np.sort(rng.choice(np.arange(1, arr.nbytes), pieces, replace=False))
        bounds = np.concatenate([[0], cuts, [arr.nbytes]])
        return _iov.iovecs(arr.ctypes.data + bounds[:-1], np.diff(bounds))

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # force partial sends
    a.settimeout(10), b.settimeout(10)
    sender = threading.Thread(target=_iov.send_iov, args=(a, iov(src, 2500), lambda: 10.0))
    sender.start()
    _iov.recv_iov(b, iov(dst, 3100), lambda: 10.0)
    sender.join(10)
    a.close(), b.close()
    assert np.array_equal(src, dst)


def test_scatter_receive_names_a_peer_that_closes_midway():
    a, b = socket.socketpair()
    a.sendall(b"x" * 100)
    a.close()
    dst = np.zeros(1000, np.uint8)
    with pytest.raises(ConnectionError, match="100 of 1000"):
        _iov.recv_iov(b, _iov.iovecs(np.array([dst.ctypes.data]), np.array([1000])), lambda: 5.0)
    b.close()


@pytest.fixture
def served():
    src = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    with TcpTransport(token=TOKEN) as server:
        region = server.register(src.ctypes.data, src.nbytes)
        yield server, region, src


def test_streams_share_the_bytes(served):
    server, region, src = served
    with TcpTransport(token=TOKEN, streams=4, split_bytes=64 << 10) as client:
        dst = np.zeros_like(src)
        peer = client.connect(server.endpoint(), timeout=5)
        prep = client.prepare(
            peer,
            [region.descriptor],
            [client.register(dst.ctypes.data, dst.nbytes)],
            ReadBatch.of([(0, 0, 0, 0, src.nbytes)]),
        )
        per_stream = [sum(f.nbytes for f in frames) for frames in prep.frames]
        assert per_stream == [src.nbytes // 4] * 4
        assert server.num_connections == 4
        client.read(prep, timeout=5)
        assert np.array_equal(dst, src)


def test_hung_peer_times_out_naming_it():
    """A server that authenticates, then never answers: the read fails within its timeout and says where."""
    table = RegionTable("tcp")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    instance = b"\7" * 16
    held = []

    def hang() -> None:
        conn, _ = listener.accept()
        _server_handshake(conn, ServerConfig(TOKEN, instance, table))
        held.append(conn)  # reads nothing, answers nothing

    th = threading.Thread(target=hang, daemon=True)
    th.start()
    ep = json.dumps({"transport": "tcp", "host": "127.0.0.1", "port": port, "instance": instance.hex()}).encode()
    desc = json.dumps({"transport": "tcp", "instance": instance.hex(), "region": 1, "nbytes": 100}).encode()
    with TcpTransport(token=TOKEN, streams=1) as client:
        dst = np.zeros(100, np.uint8)
        peer = client.connect(ep, timeout=5)
        prep = client.prepare(peer, [desc], [client.register(dst.ctypes.data, 100)], ReadBatch.of([(0, 0, 0, 0, 100)]))
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=f"127.0.0.1:{port}.*timed out|timed out.*127.0.0.1:{port}"):
            client.read(prep, timeout=0.5)
        assert time.monotonic() - t0 < 0.5 + 5.0  # bounded: its timeout plus room for a loaded machine
    th.join(5)
    for s in held:
        s.close()
    listener.close()


def test_refused_read_then_reconnects(served):
    server, region, src = served
    with TcpTransport(token=TOKEN, streams=2) as client:
        dst = np.zeros(64, np.uint8)
        local = client.register(dst.ctypes.data, 64)
        peer = client.connect(server.endpoint(), timeout=5)
        good = client.prepare(peer, [region.descriptor], [local], ReadBatch.of([(0, 10, 0, 0, 64)]))
        gone = server.register(src.ctypes.data, 64)
        stale = client.prepare(peer, [gone.descriptor], [local], ReadBatch.of([(0, 0, 0, 0, 64)]))
        server.deregister(gone)
        with pytest.raises(TransportError, match="region .* is not registered"):
            client.read(stale, timeout=5)
        client.read(good, timeout=5)
        assert np.array_equal(dst, src[10:74])


def test_server_restart_at_same_address_is_detected(served):
    """An endpoint names one server instance; another server (same token) at its address is not it."""
    server, region, src = served
    ep = json.loads(server.endpoint())
    with TcpTransport(token=TOKEN) as other:
        ep2 = json.loads(other.endpoint())
        ep2["instance"] = ep["instance"]
        with TcpTransport(token=TOKEN) as client, pytest.raises(AuthError, match="another server instance"):
            client.connect(json.dumps(ep2).encode(), timeout=5)


def test_bad_arguments_are_errors():
    with pytest.raises(TransportError):
        TcpTransport(token=TOKEN, streams=0)
    with TcpTransport(token=TOKEN) as t:
        with pytest.raises(TransportError, match="host memory"):
            t.register(4096, 10, device="cuda:0")
        with pytest.raises(TransportError):
            t.register(0, 10)
        with pytest.raises(TransportError, match="port"):
            t.connect(
                json.dumps({"transport": "tcp", "host": "127.0.0.1", "port": 0, "instance": "00" * 16}).encode(),
                timeout=1,
            )
        with pytest.raises(TransportError, match="descriptor is for transport"):
            t.connect(b'{"transport": "local"}', timeout=1)


def test_listener_survives_running_out_of_descriptors(served):
    """accept() failing with EMFILE must not stop the listener for good."""
    import os
    import resource

    server, region, src = served
    ep = json.loads(server.endpoint())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 6, hard))
    try:
        for _ in range(20):  # our sockets and the server's accepted ones exhaust the limit together
            try:
                held.append(socket.create_connection((ep["host"], ep["port"]), timeout=2))
            except OSError:
                break
        time.sleep(0.3)  # let the accept loop run into EMFILE (what is checked is the recovery below)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for s in held:
            s.close()
    with TcpTransport(token=TOKEN, streams=2) as client:
        dst = np.zeros(64, np.uint8)
        peer = client.connect(server.endpoint(), timeout=5)
        client.read(
            client.prepare(
                peer, [region.descriptor], [client.register(dst.ctypes.data, 64)], ReadBatch.of([(0, 0, 0, 0, 64)])
            ),
            timeout=5,
        )
        assert np.array_equal(dst, src[:64])


def test_a_small_batch_takes_one_stream(served):
    # handing a stream its frames costs a thread hop: a few KiB go on one stream (STREAM_MIN_BYTES)
    server, region, src = served
    with TcpTransport(token=TOKEN, streams=4, split_bytes=1 << 10) as client:
        dst = np.zeros_like(src)
        peer = client.connect(server.endpoint(), timeout=5)
        local = [client.register(dst.ctypes.data, dst.nbytes)]
        rows = [(0, a, 0, a, 1000) for a in range(0, 8000, 2000)]  # 4 reads, 4000 bytes
        prep = client.prepare(peer, [region.descriptor], local, ReadBatch.of(rows))
        assert [len(frames) > 0 for frames in prep.frames] == [True, False, False, False]
        client.read(prep, timeout=5)
        assert all(np.array_equal(dst[a : a + 1000], src[a : a + 1000]) for a in range(0, 8000, 2000))
        big = client.prepare(peer, [region.descriptor], local, ReadBatch.of([(0, 0, 0, 0, src.nbytes)]))
        assert all(len(frames) > 0 for frames in big.frames)


def test_a_batch_of_a_few_reads_is_one_frame_and_an_empty_one_none(served):
    # a few reads that need no split go as one READ frame packed directly (``FEW_ENTRIES``), served
    # entry by entry; an empty batch reads nothing (a READ of no entry is a protocol error)
    server, region, src = served
    with TcpTransport(token=TOKEN, streams=2) as client:
        dst = np.zeros_like(src)
        peer = client.connect(server.endpoint(), timeout=5)
        local = [client.register(dst.ctypes.data, dst.nbytes)]
        rows = [(0, 7, 0, 2001, 3), (0, 5000, 0, 20, 999), (0, 9, 0, 0, 20)]  # odd offsets, any order
        prep = client.prepare(peer, [region.descriptor], local, ReadBatch.of(rows))
        assert [len(frames) for frames in prep.frames] == [1, 0]
        client.read(prep, timeout=5)
        assert all(np.array_equal(dst[d : d + n], src[s : s + n]) for _, s, _, d, n in rows)
        empty = client.prepare(peer, [region.descriptor], local, ReadBatch.of([]))
        assert all(len(frames) == 0 for frames in empty.frames)
        client.read(empty, timeout=5)
        client.read(prep, timeout=5)  # (the connection still serves)
