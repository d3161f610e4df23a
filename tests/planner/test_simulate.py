"""The flow simulator against hand-computed makespans and lower bounds."""

from __future__ import annotations

import numpy as np
import pytest

from planner import Plan, SourceOps, build_plans, simulate
from planner.simulate import DEFAULT_NIC_PER_READ_S as NIC

from .cases import sharded

pytestmark = pytest.mark.timeout(60)
FREE = {
    "latency_s": 0,
    "cpu_per_read_s": 0,
    "cpu_per_post_s": 0,
    "nic_per_read_s": 0,
    "connect_s": 0,
}  # bytes only: hand-computable


def _plan(dst: int, reads: dict[int, list[int]]) -> Plan:
    """A synthetic plan: for each source rank, ops of the given sizes (addresses irrelevant here)."""
    srcs = []
    for r, sizes in sorted(reads.items()):
        n = len(sizes)
        off = np.cumsum([0] + sizes[:-1])
        srcs.append(SourceOps(r, np.zeros(n), off, np.zeros(n), off, np.asarray(sizes)))
    return Plan(dst, tuple(srcs), sum(sum(v) for v in reads.values()))


def test_single_flow_is_bandwidth_bound():
    res = simulate([_plan(10, {0: [10**9]})], bandwidth=1e9, **FREE)
    assert res.makespan_s == pytest.approx(1.0) and res.lower_bound_s == pytest.approx(1.0)
    assert res.ratio == pytest.approx(1.0)


def test_shared_source_is_the_bottleneck():
    # Two destinations read 1 GB each from source 0: its egress carries 2 GB.
    res = simulate([_plan(10, {0: [10**9]}), _plan(11, {0: [10**9]})], bandwidth=1e9, **FREE)
    assert res.lower_bound_s == pytest.approx(2.0) and res.makespan_s == pytest.approx(2.0)
    assert res.max_egress == (0, 2 * 10**9)


def test_ingress_bound_and_uneven_bandwidths():
    plans = [_plan(10, {0: [10**9], 1: [10**9]})]
    res = simulate(plans, bandwidth=1e9, **FREE)
    assert res.lower_bound_s == pytest.approx(2.0) and res.makespan_s == pytest.approx(2.0)
    # A slow source NIC: 1 GB at 0.25 GB/s takes 4 s whatever the rest does.
    res = simulate(plans, bandwidth=1e9, src_bandwidth={0: 0.25e9, 1: 1e9}, **FREE)
    assert res.lower_bound_s == pytest.approx(4.0) and res.makespan_s == pytest.approx(4.0)


def test_max_min_sharing_then_reshare():
    # dst 10 reads 1 GB from 0 and 3 GB from 1; dst 11 reads 1 GB from 1. All NICs 1 GB/s.
    # Max-min: all three flows run at 0.5 GB/s (src 1 and dst 10 are both full) until the two
    # 1 GB flows end at t=2; then the 3 GB flow runs alone at 1 GB/s for its last 2 GB: t=4.
    plans = [_plan(10, {0: [10**9], 1: [3 * 10**9]}), _plan(11, {1: [10**9]})]
    res = simulate(plans, bandwidth=1e9, **FREE)
    # Lower bound: src 1 egress 4 GB, dst 10 ingress 4 GB -> 4 s.
    assert res.lower_bound_s == pytest.approx(4.0)
    assert res.makespan_s == pytest.approx(4.0)


def test_small_ops_are_latency_bound():
    # 1000 ops of 1 KB, 1 in flight, 10 us each (+1 ns of bytes): ~100 MB/s -> ~10 ms, not 1 us.
    res = simulate(
        [_plan(10, {0: [1000] * 1000})],
        bandwidth=1e12,
        latency_s=10e-6,
        queue_depth=1,
        cpu_per_read_s=0,
        cpu_per_post_s=0,
        nic_per_read_s=0,
        connect_s=0,
    )
    assert res.makespan_s == pytest.approx(1000 * (10e-6 + 1e-9), rel=1e-6)
    assert res.ratio > 1000


def test_more_smaller_reads_of_the_same_bytes_take_longer():
    # The same 1 GB from one source, as 1, 1k, 100k and 1M reads, default per-read costs.
    spans = [simulate([_plan(10, {0: [10**9 // n] * n})], bandwidth=50e9).makespan_s for n in (1, 1000, 10**5, 10**6)]
    assert spans == sorted(spans) and len(set(spans)) == 4
    assert spans[-1] > 1.5 * spans[0]  # 1M reads at ~1 us each cost more than the 20 ms of bytes


def test_per_read_costs_are_charged_where_they_belong():
    one = _plan(10, {0: [1000] * 10**5})  # 100 MB as 100k reads; the NIC is nearly free (1 TB/s)
    kw = {"bandwidth": 1e12, "latency_s": 0, "queue_depth": 10**9, "cpu_per_post_s": 0, "connect_s": 0}
    # Reader CPU: one rank posts all its reads, whatever the number of flows.
    cpu = simulate([one], cpu_per_read_s=1e-6, nic_per_read_s=0, **kw)
    assert cpu.makespan_s == pytest.approx(0.1, rel=1e-6)  # posting overlaps the bytes
    split = _plan(10, {0: [1000] * (5 * 10**4), 1: [1000] * (5 * 10**4)})
    assert simulate([split], cpu_per_read_s=1e-6, nic_per_read_s=0, **kw).makespan_s == pytest.approx(
        cpu.makespan_s, rel=1e-3
    )
    # NIC: a source serving two destinations processes both their reads.
    two = [one, _plan(11, {0: [1000] * 10**5})]
    nic = simulate(two, cpu_per_read_s=0, nic_per_read_s=1e-6, **kw)
    assert nic.makespan_s == pytest.approx(0.2 + 2e-4, rel=1e-3)
    assert nic.lower_bound_s == pytest.approx(2e-4)  # the bound counts bytes only


def test_queue_depth_bounds_a_flow():
    big = [_plan(10, {0: [10**6] * 1000})]  # 1 GB in 1 MB reads at 50 GB/s: 20 ms of bytes
    deep = simulate(big, bandwidth=50e9, latency_s=5e-6, queue_depth=16, connect_s=0)
    shallow = simulate(big, bandwidth=50e9, latency_s=5e-6, queue_depth=1, connect_s=0)
    # One read in flight: each read takes 5 us + the NIC's fixed cost + 20 us of bytes.
    assert shallow.makespan_s == pytest.approx(1000 * (5e-6 + NIC + 20e-6), rel=1e-3)
    assert deep.makespan_s < 1.05 * deep.lower_bound_s < shallow.makespan_s


def test_simulate_real_plans_balanced():
    tensors = {"w": ((256, 64), 0), "b": ((64,), None)}
    src = sharded(tensors, tp=2, dp=2)
    dst = [d for k in range(4) for d in sharded(tensors, tp=2, rank0=100 + 2 * k)]
    res = simulate(build_plans(src, dst, min_split_bytes=256), bandwidth=1e9, **FREE)
    assert 1.0 - 1e-9 <= res.ratio < 1.05
    assert res.total_bytes == 4 * (256 * 64 + 2 * 64) * 4  # b is replicated on both TP ranks


def test_shallow_queue_costs_a_post_per_read():
    # 64 flows of 20k small reads into one reader: the NICs keep up at any depth (64 flows in
    # parallel), but with one read in flight per pair every read is a post of its own.
    many = [_plan(10, {s: [2048] * 20_000 for s in range(64)})]
    deep = simulate(many, queue_depth=16, latency_s=5e-6)
    shallow = simulate(many, queue_depth=1, latency_s=5e-6)
    assert shallow.makespan_s > 2 * deep.makespan_s
    assert shallow.ratio != deep.ratio
    # Few large reads: depth barely matters.
    few = [_plan(10, {s: [2048 * 20_000] for s in range(64)})]
    a, b = simulate(few, queue_depth=16), simulate(few, queue_depth=1)
    assert b.makespan_s == pytest.approx(a.makespan_s, rel=0.01)


def test_each_source_costs_a_connection_set_up():
    # One reader, 1 GB at 1 GB/s: from one source it starts after one set-up; spread over 4
    # sources the flows start one set-up after another, the last at 4 ms.
    free = {k: v for k, v in FREE.items() if k != "connect_s"}
    one = simulate([_plan(10, {0: [10**9]})], bandwidth=1e9, connect_s=1e-3, **free)
    assert one.makespan_s == pytest.approx(1.0 + 1e-3)
    four = simulate([_plan(10, {s: [10**9 // 4] for s in range(4)})], bandwidth=1e9, connect_s=1e-3, **free)
    # Bytes flow from 1 ms on (the reader's NIC is the bottleneck); the 3 ms of later set-ups overlap them.
    assert four.makespan_s == pytest.approx(1.0 + 1e-3, rel=1e-6)
    many = simulate([_plan(10, {s: [10**9 // 2000] for s in range(2000)})], bandwidth=1e9, connect_s=1e-3, **free)
    # 2000 set-ups take 2 s, more than the bytes: the last 0.5 MB flow starts at 2 s.
    assert many.makespan_s == pytest.approx(2.0 + 0.5e-3, rel=1e-3)
    assert many.lower_bound_s == pytest.approx(one.lower_bound_s)
