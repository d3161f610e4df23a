"""NIXL-specific tests beyond the conformance suite (which also runs on nixl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

try:
    import nixl_cu12  # noqa: F401
except ImportError:
    pytest.skip("nixl-cu12 is not installed (pip install 'wbridge[nixl]')", allow_module_level=True)

import transports  # noqa: E402
from transports import TransportError  # noqa: E402
from transports.base import ReadBatch  # noqa: E402

from .engine_checks import GARBAGE, TIMEOUT, TOKEN, listening_addresses, open_read_close_cycles  # noqa: E402
from .peer import ROOT, Peer, region_bytes  # noqa: E402

pytestmark = pytest.mark.timeout(180)
Nixl = transports.get("nixl")


def test_region_registered_after_the_endpoint_is_readable():
    """Region descriptors carry their own partial metadata: the endpoint need not be re-published."""
    with (
        Peer("nixl", [{"size": 4096, "seed": 1}], token=TOKEN, timeout=TIMEOUT) as server,
        Nixl(token=TOKEN.encode()) as t,
    ):
        peer = t.connect(server.endpoint, timeout=TIMEOUT)
        late = bytes.fromhex(server.command(op="register", size=300_001, seed=42)["descriptor"])
        dst = np.full(300_001 + 64, GARBAGE, dtype=np.uint8)
        local = t.register(dst.ctypes.data, dst.nbytes)
        prep = t.prepare(
            peer,
            [server.descriptors[0], late],
            [local],
            ReadBatch.of([(1, 0, 0, 0, 300_001), (0, 100, 0, 300_001, 64)]),
        )
        for _ in range(3):  # one prepared request, posted again and again
            dst.fill(GARBAGE)
            t.read(prep, timeout=TIMEOUT)
            assert np.array_equal(dst[:300_001], region_bytes(300_001, 42))
            assert np.array_equal(dst[300_001:], region_bytes(4096, 1)[100:164])
        assert repr(prep) == f"NixlPrepared({peer.name}, reads=2, bytes=300065, released=False)"
        t.release(prep)
        t.release(prep)
        assert repr(prep) == f"NixlPrepared({peer.name}, reads=2, bytes=300065, released=True)"
        t.disconnect(peer)
        assert server.stop() == 0


def test_ucx_listens_on_loopback_only():
    with (
        Peer("nixl", [{"size": 4096, "seed": 1}], token=TOKEN, timeout=TIMEOUT) as server,
        Nixl(token=TOKEN.encode()) as t,
    ):
        dst = np.zeros(4096, np.uint8)
        local = t.register(dst.ctypes.data, 4096)
        t.read(
            t.prepare(
                t.connect(server.endpoint, timeout=TIMEOUT),
                server.descriptors,
                [local],
                ReadBatch.of([(0, 0, 0, 0, 4096)]),
            ),
            timeout=TIMEOUT,
        )
        addrs = listening_addresses(server.pid) + listening_addresses(os.getpid())
        assert all(a in ("127.0.0.1", "::1") for a, _ in addrs), addrs
        assert "net_devices=lo" in repr(t)
        assert server.stop() == 0


def test_refuses_reads_outside_the_peers_registrations():
    """NIXL itself checks the remote list against the peer's registrations, not only our bounds check."""
    with (
        Peer("nixl", [{"size": 4096, "seed": 1}], token=TOKEN, timeout=TIMEOUT) as server,
        Nixl(token=TOKEN.encode()) as t,
    ):
        d = json.loads(server.descriptors[0])
        d["addr"] += 8192  # a forged address: in no registration of the peer
        dst = np.zeros(64, np.uint8)
        local = t.register(dst.ctypes.data, 64)
        peer = t.connect(server.endpoint, timeout=TIMEOUT)
        with pytest.raises(TransportError, match="refused"):
            t.prepare(peer, [json.dumps(d).encode()], [local], ReadBatch.of([(0, 0, 0, 0, 64)]))
        with pytest.raises(TransportError, match="belongs to agent"):
            t.prepare(
                peer, [json.dumps({**d, "agent": "someone-else"}).encode()], [local], ReadBatch.of([(0, 0, 0, 0, 64)])
            )
        with pytest.raises(TransportError, match="device"):
            t.register(dst.ctypes.data, 64, device="tpu:0")
        assert server.stop() == 0


def test_process_exits_zero_after_use():
    """Regression: with the system libefa present, UCX's efa module used to crash every process at exit."""
    code = (
        "import numpy as np, transports\n"
        "t = transports.get('nixl')()\n"
        "b = np.zeros(4096, np.uint8); r = t.register(b.ctypes.data, 4096)\n"
        "t.close()\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("UCX_MODULES", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_no_leaks_over_10_cycles():
    open_read_close_cycles("nixl", 10)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (every thread), from ``/proc``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_agents_sleep():
    """Between reads neither side's NIXL agent spins a core: nixl's Python wrapper starts the UCX
    progress thread with no delay, a busy loop (a whole core each, 5 CPU-s in 5 idle seconds);
    ``transports.nixl`` gives it one. The bound leaves room for a loaded machine, where a spinning
    thread still gets far more than 0.3 s of 3."""
    with (
        Peer("nixl", [{"size": 4096, "seed": 1}], token=TOKEN, timeout=TIMEOUT) as server,
        Nixl(token=TOKEN.encode()) as t,
    ):
        peer = t.connect(server.endpoint, timeout=TIMEOUT)
        dst = np.empty(4096, dtype=np.uint8)
        prep = t.prepare(
            peer, server.descriptors, [t.register(dst.ctypes.data, dst.nbytes)], ReadBatch.of([(0, 0, 0, 0, 4096)])
        )
        t.read(prep, timeout=TIMEOUT)
        assert np.array_equal(dst, region_bytes(4096, 1))
        used = {"reader": -_cpu_seconds(os.getpid()), "server": -_cpu_seconds(server.proc.pid)}
        time.sleep(3.0)
        used = {
            "reader": used["reader"] + _cpu_seconds(os.getpid()),
            "server": used["server"] + _cpu_seconds(server.proc.pid),
        }
        assert max(used.values()) < 0.3, f"CPU seconds in 3 idle seconds: {used}"
        t.read(prep, timeout=TIMEOUT)  # and the agents still serve after their sleep
        assert np.array_equal(dst, region_bytes(4096, 1))
        assert server.stop() == 0
