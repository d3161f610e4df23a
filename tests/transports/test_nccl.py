"""nccl-transport tests beyond the conformance suite (which also runs on nccl, over gloo here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import transports
from transports import TransportError
from transports.base import ReadBatch

from .engine_checks import GARBAGE, TIMEOUT, TOKEN, listening_addresses
from .peer import ROOT, Peer, region_bytes

pytestmark = pytest.mark.timeout(180)

if "nccl" not in transports.available():
    pytest.skip("torch.distributed with gloo is not available here", allow_module_level=True)
Nccl = transports.get("nccl")

SIZE = 8 << 20
SERVE_TIMEOUT = 60.0  # serving process start-up and stop: under 4 xdist workers a stop once took over 20 s

# A reader in its own process that pulls in a loop until killed.
LOOP_READER = """
import sys, numpy as np, transports
from transports.base import ReadBatch
ep, desc, size = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3])
t = transports.get("nccl")(token=sys.argv[4].encode())
dst = np.zeros(size, np.uint8); local = t.register(dst.ctypes.data, size)
prep = t.prepare(t.connect(ep, timeout=20), [desc], [local], ReadBatch.of([(0, 0, 0, 0, size)]))
print("reading", flush=True)
while True:
    t.read(prep, timeout=20)
"""


@pytest.fixture(scope="module")
def server():
    """One serving process for the module: region 0 of SIZE bytes (seed 4), region 1 of 4096 (seed 2)."""
    regions = [{"size": SIZE, "seed": 4}, {"size": 4096, "seed": 2}]
    with Peer("nccl", regions, token=TOKEN, timeout=SERVE_TIMEOUT) as peer:
        yield peer
        assert peer.stop() == 0, "serving process did not exit cleanly"


def _reader(server, size=SIZE, region=0):
    t = Nccl(token=TOKEN.encode())
    dst = np.full(size, GARBAGE, dtype=np.uint8)
    local = t.register(dst.ctypes.data, size)
    peer = t.connect(server.endpoint, timeout=TIMEOUT)
    prep = t.prepare(peer, server.descriptors, [local], ReadBatch.of([(region, 0, 0, 0, size)]))
    return t, dst, prep


def test_a_reader_killed_mid_pull_does_not_wedge_the_server(server):
    want = region_bytes(SIZE, 4)
    env = dict(os.environ, PYTHONPATH=ROOT)
    victim = subprocess.Popen(
        [sys.executable, "-c", LOOP_READER, server.endpoint.hex(), server.descriptors[0].hex(), str(SIZE), TOKEN],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert victim.stdout.readline().strip() == "reading"
        os.kill(victim.pid, signal.SIGKILL)  # most likely in the middle of a pull epoch
        victim.wait(TIMEOUT)
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.stdout.close()
    t, dst, prep = _reader(server)
    with t:
        for _ in range(2):
            dst.fill(GARBAGE)
            t.read(prep, timeout=TIMEOUT)
            assert np.array_equal(dst, want)


def test_concurrent_readers_get_their_own_groups(server):
    want = region_bytes(SIZE, 4)
    readers = [_reader(server) for _ in range(3)]
    errors = []

    def pull(t, prep):
        try:
            for _ in range(3):
                t.read(prep, timeout=TIMEOUT)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=pull, args=(t, prep)) for t, _, prep in readers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT * 3)
    assert not errors and not any(th.is_alive() for th in threads)
    for t, dst, _ in readers:
        assert np.array_equal(dst, want)
        t.close()


def test_reconnects_after_a_failed_pull(server):
    """A failed pull closes the control connection; the next reads reconnect and re-prepare every batch."""
    t, dst, prep = _reader(server, 4096, region=1)
    with t:
        other = t.prepare(
            prep.peer, server.descriptors, [t._regions[min(t._regions)]], ReadBatch.of([(1, 96, 0, 0, 4000)])
        )
        t.read(prep, timeout=TIMEOUT)
        t._drop(prep.peer)  # what a failed pull does: the server forgets the batches with the connection
        for p, want in ((prep, region_bytes(4096, 2)), (other, region_bytes(4096, 2)[96:])):
            dst.fill(GARBAGE)
            t.read(p, timeout=TIMEOUT)
            assert np.array_equal(dst[: len(want)], want)


def test_one_group_per_peer_reused_across_pulls(server):
    """Pulls of several prepared batches from one peer share one process group (the serving side
    agrees to reuse it, or the reader would form a new one); a failed pull forms a new one."""
    t, dst, prep = _reader(server, 4096, region=1)
    want = region_bytes(4096, 2)
    with t:
        other = t.prepare(
            prep.peer, server.descriptors, [t._regions[min(t._regions)]], ReadBatch.of([(1, 96, 0, 0, 4000)])
        )
        groups = []
        for p, expect in ((prep, want), (other, want[96:]), (prep, want), (other, want[96:])):
            dst.fill(GARBAGE)
            t.read(p, timeout=TIMEOUT)
            assert np.array_equal(dst[: len(expect)], expect)
            groups.append(prep.peer.group)
        assert groups[0] is not None and all(gr is groups[0] for gr in groups)
        t._drop(prep.peer)  # what a failed pull does
        dst.fill(GARBAGE)
        t.read(prep, timeout=TIMEOUT)
        assert np.array_equal(dst, want)
        assert prep.peer.group is not None and prep.peer.group is not groups[0]


@pytest.mark.parametrize("offset, nbytes", [(2**63 - 8, 16), (16, 2**63 - 8), (2**63 - 1, 2**63 - 1), (-8, 16)])
def test_serving_side_refuses_wrapping_entries(server, offset, nbytes):
    """A reader holding the token that skips its own bounds check (its prepared entries rewritten to
    an offset and size whose int64 sum wraps negative) is refused by the serving process, which
    stays up and serves the honest batch afterwards, bit-exact."""
    from transports._nccl_proto import ENTRY

    t, dst, prep = _reader(server, 4096, region=1)
    with t:
        honest = prep.entries
        hostile = np.frombuffer(honest, dtype=ENTRY).copy()
        hostile["offset"], hostile["nbytes"] = offset, nbytes
        prep.entries, prep.generation = hostile.tobytes(), -1  # sent again with the next read
        with pytest.raises(TransportError, match="refused the batch"):
            t.read(prep, timeout=TIMEOUT)
        assert (dst == GARBAGE).all()
        prep.entries, prep.generation = honest, -1
        t.read(prep, timeout=TIMEOUT)
        assert np.array_equal(dst, region_bytes(4096, 2))
    assert server.proc.poll() is None, "the serving process died"


def test_control_listener_on_host_only_and_no_tcpstore(server):
    t, _, prep = _reader(server, 4096, region=1)
    with t:
        t.read(prep, timeout=TIMEOUT)
        addrs = listening_addresses(server.pid) + listening_addresses(os.getpid())
        assert addrs and all(a == "127.0.0.1" for a, _ in addrs), addrs
        assert json.loads(server.endpoint)["host"] == "127.0.0.1"


def test_refuses_mixed_or_unknown_devices():
    with Nccl() as t:
        with pytest.raises(TransportError, match="device"):
            t.register(1 << 20, 4096, device="tpu:0")
    from transports._nccl_group import backend_for

    assert backend_for(["cpu", "cpu"], "x") == "gloo" and backend_for(["cuda:0", "cuda:1"], "x") == "nccl"
    with pytest.raises(TransportError, match="mixes"):
        backend_for(["cpu", "cuda:0"], "the destination")
