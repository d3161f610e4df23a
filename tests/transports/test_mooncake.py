"""Mooncake-specific tests beyond the conformance suite (which also runs on mooncake)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip(
    "mooncake.engine", reason="mooncake-transfer-engine is not installed (pip install 'wbridge[mooncake]')"
)

import transports  # noqa: E402
from transports import TransportError  # noqa: E402
from transports.base import ReadBatch  # noqa: E402

from .engine_checks import GARBAGE, TIMEOUT, TOKEN, listening_addresses, open_read_close_cycles  # noqa: E402
from .peer import Peer, region_bytes  # noqa: E402

pytestmark = pytest.mark.timeout(180)
Mooncake = transports.get("mooncake")


def test_endpoint_is_the_engine_session():
    with Mooncake(host="127.0.0.1") as t:
        d = json.loads(t.endpoint())
        assert d["transport"] == "mooncake" and d["protocol"] == "tcp"  # no RDMA devices on this machine
        host, port = d["session"].rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert "authenticated=False" in repr(t)


@pytest.mark.slow
def test_many_ops_span_engine_calls():
    """More reads than one engine call takes (the tcp lanes' queue): chunked, every byte right."""
    size = 1 << 20
    with (
        Peer("mooncake", [{"size": size, "seed": 8}], token=TOKEN, timeout=TIMEOUT) as server,
        Mooncake(token=TOKEN.encode(), max_batch=300) as t,
    ):
        dst = np.full(size, GARBAGE, dtype=np.uint8)
        local = t.register(dst.ctypes.data, size)
        peer = t.connect(server.endpoint, timeout=TIMEOUT)
        rng = np.random.default_rng(1)
        n = 2000  # 7 engine calls; reads land reversed so an ordering slip shows
        starts = np.sort(rng.choice(size // 8, n, replace=False)) * 8
        lens = np.minimum(np.diff(np.append(starts, size)), 8)
        batch = ReadBatch(np.zeros(n), starts, np.zeros(n), size - starts - lens, lens)
        prep = t.prepare(peer, server.descriptors, [local], batch)
        assert len(prep.chunks) == 7
        assert repr(prep) == f"MooncakePrepared({peer.session}, reads=2000, bytes={int(lens.sum())}, released=False)"
        t.read(prep, timeout=TIMEOUT)
        src = region_bytes(size, 8)
        for s, ln in zip(starts.tolist(), lens.tolist()):
            assert np.array_equal(dst[size - s - ln : size - s], src[s : s + ln])
        assert server.stop() == 0


def test_refuses_what_it_cannot_serve():
    with Mooncake() as t:
        with pytest.raises(TransportError, match="host memory"):
            t.register(1 << 20, 4096, device="cuda:0")
        with pytest.raises(TransportError, match="protocol"):
            Mooncake(protocol="carrier-pigeon")
        other = json.dumps({"transport": "mooncake", "session": "127.0.0.1:1", "protocol": "rdma"}).encode()
        with pytest.raises(TransportError, match="speaks"):
            t.connect(other, timeout=1.0)
        dead = json.dumps({"transport": "mooncake", "session": "127.0.0.1:1", "protocol": "tcp"}).encode()
        with pytest.raises(TransportError, match="cannot reach"):
            t.connect(dead, timeout=1.0)


def test_listeners_are_the_engines_known_limitation():
    """Documents (and watches) the engine's listeners: they bind all interfaces, whatever ``host`` says."""
    with Peer("mooncake", [{"size": 4096, "seed": 1}], token=TOKEN, timeout=TIMEOUT) as server:
        addrs = listening_addresses(server.pid)
        assert addrs, "the engine should listen (handshake and tcp data port)"
        wildcard = [a for a in addrs if a[0] in ("0.0.0.0", "::")]
        assert wildcard, f"mooncake now binds {addrs}: update the module docstring and this test"
        assert server.stop() == 0


@pytest.mark.slow
def test_no_leaks_over_10_cycles():
    open_read_close_cycles("mooncake", 10)
