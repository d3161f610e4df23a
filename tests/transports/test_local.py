"""``local`` beyond the conformance suite: iovec batching, partial transfers, identity checks, kernel refusals."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transports import AuthError, TransportError
from transports._copy import IOV_MAX, CopyPlan, progressions, vm_read
from transports.base import ReadBatch
from transports.local import LocalTransport, _signed

from .peer import Peer, run_client

pytestmark = pytest.mark.timeout(60)
TOKEN = b"local-token"


def _iov(addrs, lens) -> np.ndarray:
    return np.ascontiguousarray(np.stack([np.asarray(addrs), np.asarray(lens)], axis=1).astype(np.uint64))


def test_vm_read_batches_past_iov_max():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    n = 3 * IOV_MAX + 17
    lens = rng.integers(1, 200, n)
    src_off = rng.integers(0, src.nbytes - 200, n)
    dst_off = np.concatenate([[0], np.cumsum(lens)[:-1]])
    dst = np.full(int(lens.sum()), 0xEE, dtype=np.uint8)
    vm_read(os.getpid(), _iov(dst.ctypes.data + dst_off, lens), _iov(src.ctypes.data + src_off, lens))
    want = np.concatenate([src[o : o + k] for o, k in zip(src_off, lens)])
    assert np.array_equal(dst, want)


def test_vm_read_partial_transfer_then_fault():
    """A read running into an unmapped page copies what it can, resumes, and then fails clearly."""
    page = mmap.PAGESIZE
    mm = mmap.mmap(-1, 2 * page)
    mm[:page] = bytes(range(256)) * (page // 256)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + page), page, 0) == 0  # second page: no access
    dst = np.full(page, 0xEE, dtype=np.uint8)
    with pytest.raises(TransportError, match="Bad address"):
        vm_read(os.getpid(), _iov([dst.ctypes.data], [page]), _iov([base + page // 2], [page]))
    assert np.array_equal(dst[: page // 2], np.frombuffer(mm, np.uint8, page // 2, page // 2))
    assert (dst[page // 2 :] == 0xEE).all()
    libc.mprotect(ctypes.c_void_p(base + page), page, 3)


@pytest.fixture
def pair():
    with LocalTransport(token=TOKEN) as server, LocalTransport(token=TOKEN) as client:
        yield server, client


def _endpoint_with(server: LocalTransport, **changes) -> bytes:
    import json

    d = json.loads(server.endpoint())
    d.pop("mac")
    d.pop("transport")
    d.update(changes)
    return _signed(TOKEN, **d)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"boot": "another-boot-id"}, "another host"),
        ({"pidns": 1}, "another pid namespace"),
        ({"start": 1}, "is gone"),
        ({"nonce": "00" * 16}, "nonce"),
    ],
)
def test_endpoint_identity_checked(pair, changes, match):
    server, client = pair
    ep = _endpoint_with(server, **changes)
    with pytest.raises(TransportError, match=match):
        client.connect(ep, timeout=5)
    assert LocalTransport.same_host(server.endpoint())
    assert LocalTransport.same_host(ep) == ("boot" not in changes and "pidns" not in changes)


def test_tampered_endpoint_or_descriptor_is_auth_error(pair):
    server, client = pair
    src = np.arange(4096, dtype=np.uint8)
    region = server.register(src.ctypes.data, src.nbytes)
    tampered = server.endpoint().replace(b'"pid":', b'"pid":1', 1)
    with pytest.raises(AuthError):
        client.connect(tampered, timeout=5)
    peer = client.connect(server.endpoint(), timeout=5)
    dst = np.zeros(16, np.uint8)
    local = client.register(dst.ctypes.data, 16)
    moved = region.descriptor.replace(b'"addr":', b'"addr":1', 1)  # point the read somewhere else
    with pytest.raises(AuthError):
        client.prepare(peer, [moved], [local], ReadBatch.of([(0, 0, 0, 0, 16)]))


def test_host_buffer_is_sealed_and_read_by_mapping(pair):
    server, client = pair
    buf = server.host_buffer(1 << 16)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = np.arange(1 << 16) % 251
    fd = server._buffers[0].fd
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 10)  # sealed: a reader's mapping can never lose its pages
    region = server.register(arr.ctypes.data + 100, 1000)
    assert b'"memfd":[' in region.descriptor
    dst = np.zeros(1000, np.uint8)
    peer = client.connect(server.endpoint(), timeout=5)
    prep = client.prepare(
        peer, [region.descriptor], [client.register(dst.ctypes.data, 1000)], ReadBatch.of([(0, 0, 0, 0, 1000)])
    )
    assert prep.copies.count == 1 and len(prep.local_iov) == 0  # by mapping, not process_vm_readv
    client.read(prep, timeout=5)
    assert np.array_equal(dst, arr[100:1100])
    del arr


def test_adjacent_reads_are_coalesced(pair):
    server, client = pair
    src = np.arange(1 << 16, dtype=np.uint8)
    region = server.register(src.ctypes.data, src.nbytes)
    dst = np.zeros(1 << 16, np.uint8)
    peer = client.connect(server.endpoint(), timeout=5)
    rows = [(0, i * 4096, 0, i * 4096, 4096) for i in range(16)] + [(0, 0, 0, 100, 10)]
    prep = client.prepare(peer, [region.descriptor], [client.register(dst.ctypes.data, dst.nbytes)], ReadBatch.of(rows))
    assert len(prep.local_iov) == 2
    client.read(prep, timeout=5)
    want = src.copy()
    want[100:110] = src[:10]
    assert np.array_equal(dst, want)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop CAP_SYS_PTRACE")
@pytest.mark.parametrize("method, match", [("vm", "EPERM"), ("auto", "ptrace access check failed")])
@pytest.mark.timeout(150)  # (two processes that import torch: 20-35 s each on a loaded 2-core host)
def test_kernel_refusal_is_a_clear_error(method, match):
    """A reader without ptrace rights over the publisher gets a TransportError that says to use tcp."""
    regions = [{"size": 4096, "seed": 1}]
    with Peer("local", regions, token="t", dumpable=False, timeout=60) as p:
        denied = run_client(
            "local",
            p.endpoint,
            p.descriptors,
            regions,
            token="t",
            options={"method": method},
            timeout=60,
            wrap=["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"],
        )
        if "setpriv" in denied.stderr and "TransportError" not in denied.stderr:
            pytest.skip(f"cannot drop capabilities here: {denied.stderr.strip()[-200:]}")
        assert denied.returncode != 0
        assert "TransportError" in denied.stderr and match in denied.stderr and "use the tcp transport" in denied.stderr
        assert p.stop() == 0


def test_usable():
    assert LocalTransport.usable()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_copy_plan_is_bit_exact_on_families_and_strays(seed, shuffle):
    """Families of evenly spaced equal copies (any strides, backwards too) mixed with stray copies, in
    batch order or shuffled: every copy lands in exactly one run and the bytes match a plain loop."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    rows, pos = [], 0
    while pos < 30_000:
        n = int(rng.integers(1, 64))
        if rng.random() < 0.5:  # a family
            count, step = int(rng.integers(1, 40)), int(rng.choice([-1, 1])) * (n + int(rng.integers(0, 30)))
            first = int(rng.integers(40 * 100, 60_000))
            rows += [(pos + i * n, first + i * step, n) for i in range(count)]
            pos += count * n
        else:
            n = int(rng.integers(1, 300))
            rows.append((pos, int(rng.integers(0, 60_000)), n))
            pos += n
    rows = np.array(rows, dtype=np.int64)
    if shuffle:
        rows = rows[rng.permutation(len(rows))]
    d, s, n = rows[:, 0] + dst.ctypes.data, rows[:, 1] + src.ctypes.data, rows[:, 2]
    first, count = progressions(d, s, n)
    hits = np.zeros(len(n) + 1, dtype=np.int64)
    np.add.at(hits, first, 1)
    np.add.at(hits, first + count, -1)
    assert (np.cumsum(hits)[:-1] == 1).all()  # a partition of the batch
    CopyPlan.of(d, s, n).run()
    want = np.zeros_like(dst)
    for a, b, k in rows.tolist():
        want[a : a + k] = src[b : b + k]
    assert np.array_equal(dst, want)
