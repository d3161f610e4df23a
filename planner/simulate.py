"""A flow-level simulator for a set of plans: estimated makespan against the NIC lower bound.

Model
-----
Every source rank has an egress NIC and every destination rank an ingress NIC and a CPU that
posts its reads (trainers and rollout workers are different machines). The reads of one
destination from one source form a *flow*; all flows start at time 0 and share the resources
max-min fairly (progressive filling), re-shared whenever a flow finishes. A flow of ``n`` reads
and ``B`` bytes (mean read ``m = B / n``), moving at rate ``r`` bytes/s, occupies:

* both NICs for ``r / bandwidth + r / m * nic_per_read_s`` seconds per second: every read is a
  work request each NIC processes at a fixed cost on top of its bytes;
* the destination's CPU: posting costs ``cpu_per_read_s`` per read plus ``cpu_per_post_s`` per
  post (a call handing the transport up to ``queue_depth`` reads of one flow, so a flow of ``n``
  reads needs at least ``ceil(n / queue_depth)`` posts), spread over the flow's bytes; one rank
  posts all its flows' reads;
* at most ``queue_depth`` reads in flight, each for ``latency_s + nic_per_read_s + m / bandwidth``
  seconds (round trip, work request, bytes at the slower NIC's full speed), so by Little's law
  ``r <= queue_depth * m / (latency_s + nic_per_read_s + m / bandwidth)``.

A flow starts once its connection is set up: a destination sets up one connection per source
(transport connect, descriptor exchange, queue pair), ``connect_s`` each, one after another in
source-rank order, so its ``k``-th source's flow starts at ``k * connect_s``.

So more, smaller reads of the same bytes take longer, a flow with one read in flight never
reaches the NIC's bandwidth, a shallow queue costs the reader a post per read, and every extra
source a destination reads from delays its flows by one more set-up. The default
costs are figures measured on this project's own transports (``benchmarks/read_cost.py``;
docs/planner.md, "Simulator costs").

The *lower bound* ignores every per-read and per-connection cost and sharing: the busiest NIC's
bytes over its bandwidth, egress or ingress (every rank has a NIC of its own, so with equal
bandwidths a busier source shows only where sources, not readers, carry the most bytes: 128
rollout ranks each receiving a model's 1/16 outweigh 256 trainer ranks each sending a 1/32 share
of 8 copies, whatever the balance among them). No schedule of any plan moving these bytes can
beat it; ``ratio = makespan / lower_bound``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .plan import Plan

#: Reader CPU per read: the ``tcp`` reader's measured per-read CPU (benchmarks/read_cost.py).
DEFAULT_CPU_PER_READ_S = 0.25e-6
#: Reader CPU per post (per read call): the ``local`` reader's measured CPU for a one-read call.
DEFAULT_CPU_PER_POST_S = 25e-6
#: Fixed NIC cost per read: the ``tcp`` server's measured per-read CPU, the part a NIC plays.
DEFAULT_NIC_PER_READ_S = 0.8e-6
DEFAULT_LATENCY_S = 5e-6
#: Set-up of one (destination, source) connection: an estimate for an RDMA queue pair and the
#: descriptor exchange through the store, not a measurement of this project's transports.
DEFAULT_CONNECT_S = 1e-3
DEFAULT_QUEUE_DEPTH = 16


@dataclass(frozen=True)
class SimResult:
    makespan_s: float
    lower_bound_s: float
    ratio: float
    total_bytes: int
    ops: int
    flows: int
    max_egress: tuple[int, int]  # (source rank, bytes)
    max_ingress: tuple[int, int]  # (destination rank, bytes)

    def line(self) -> str:
        return (
            f"makespan_s={self.makespan_s:.4f} lower_bound_s={self.lower_bound_s:.4f} "
            f"ratio={self.ratio:.4f} bytes={self.total_bytes} ops={self.ops} flows={self.flows}"
        )


def _bw(spec: float | Mapping[int, float], rank: int, default: float) -> float:
    if isinstance(spec, Mapping):
        return float(spec.get(rank, default))
    return float(spec)


def simulate(
    plans: Mapping[int, Plan] | Iterable[Plan],
    *,
    bandwidth: float = 50e9,
    src_bandwidth: float | Mapping[int, float] | None = None,
    dst_bandwidth: float | Mapping[int, float] | None = None,
    latency_s: float = DEFAULT_LATENCY_S,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
    cpu_per_read_s: float = DEFAULT_CPU_PER_READ_S,
    cpu_per_post_s: float = DEFAULT_CPU_PER_POST_S,
    nic_per_read_s: float = DEFAULT_NIC_PER_READ_S,
    connect_s: float = DEFAULT_CONNECT_S,
    max_events: int = 100_000,
) -> SimResult:
    """Simulates every plan at once (see the module docstring). Bandwidths in bytes per second."""
    plan_list = list(plans.values()) if isinstance(plans, Mapping) else list(plans)
    src_bw_spec = bandwidth if src_bandwidth is None else src_bandwidth
    dst_bw_spec = bandwidth if dst_bandwidth is None else dst_bandwidth
    fs, fd, fb, fn, fr = [], [], [], [], []
    for p in plan_list:
        k = 0
        for s in sorted(p.sources, key=lambda s: s.src_rank):
            if len(s):
                k += 1
                fs.append(s.src_rank)
                fd.append(p.dst_rank)
                fb.append(s.total_bytes)
                fn.append(len(s))
                fr.append(k * connect_s)
    if not fb:
        return SimResult(0.0, 0.0, 1.0, 0, 0, 0, (-1, 0), (-1, 0))
    src_ranks = sorted(set(fs))
    dst_ranks = sorted(set(fd))
    s_idx = {r: i for i, r in enumerate(src_ranks)}
    d_idx = {r: i for i, r in enumerate(dst_ranks)}
    ns, nd = len(src_ranks), len(dst_ranks)
    # Resources: source NICs, destination NICs, destination CPUs; capacities in seconds per second.
    bw = np.array(
        [_bw(src_bw_spec, r, bandwidth) for r in src_ranks] + [_bw(dst_bw_spec, r, bandwidth) for r in dst_ranks],
        dtype=np.float64,
    )
    a = np.array([s_idx[r] for r in fs], dtype=np.int64)
    b = np.array([ns + d_idx[r] for r in fd], dtype=np.int64)
    c = b + nd
    nbytes = np.array(fb, dtype=np.float64)
    nops = np.array(fn, dtype=np.float64)
    nic_bytes = np.bincount(a, nbytes, ns + nd) + np.bincount(b, nbytes, ns + nd)
    lower = float((nic_bytes / bw).max())
    reads_per_byte = nops / nbytes
    ca = 1.0 / bw[a] + reads_per_byte * nic_per_read_s
    cb = 1.0 / bw[b] + reads_per_byte * nic_per_read_s
    cc = (nops * cpu_per_read_s + np.ceil(nops / queue_depth) * cpu_per_post_s) / nbytes
    mean = nbytes / nops
    in_flight = latency_s + nic_per_read_s + mean / np.minimum(bw[a], bw[b])
    flow_cap = queue_depth * mean / in_flight
    release = np.array(fr, dtype=np.float64)
    makespan = _fluid(np.stack([a, b, c]), np.stack([ca, cb, cc]), nbytes, ns + 2 * nd, flow_cap, release, max_events)
    es = int(np.argmax(nic_bytes[:ns]))
    ed = int(np.argmax(nic_bytes[ns:]))
    return SimResult(
        makespan,
        lower,
        makespan / lower if lower else 1.0,
        int(nbytes.sum()),
        int(nops.sum()),
        len(fb),
        (src_ranks[es], int(nic_bytes[es])),
        (dst_ranks[ed], int(nic_bytes[ns + ed])),
    )


def _rates(res: np.ndarray, coef: np.ndarray, nres: int, flow_cap: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows using resources ``res[k, i]`` at ``coef[k, i]`` seconds per
    byte (every capacity is one second per second) under per-flow caps: progressive filling."""
    n = res.shape[1]
    rate = np.zeros(n)
    free = np.ones(n, dtype=bool)
    left = np.ones(nres)
    while free.any():
        load = sum(np.bincount(res[k, free], coef[k, free], nres) for k in range(len(res)))
        busy = load > 0
        inc = min(float((left[busy] / load[busy]).min()), float((flow_cap[free] - rate[free]).min()))
        rate[free] += inc
        left -= inc * load
        full = busy & (left <= 1e-12)
        blocked = np.zeros(n, dtype=bool)
        for k in range(len(res)):
            blocked |= full[res[k]] & (coef[k] > 0)
        free &= ~blocked & (rate < flow_cap * (1 - 1e-12))
    return rate


def _fluid(
    res: np.ndarray,
    coef: np.ndarray,
    work: np.ndarray,
    nres: int,
    flow_cap: np.ndarray,
    release: np.ndarray,
    max_events: int,
) -> float:
    """Time until every flow has moved its ``work`` bytes, flow ``i`` starting at ``release[i]``;
    rates are re-shared at every start and finish."""
    t = 0.0
    left = work.copy()
    pending = left > 0  # not finished
    for _ in range(max_events):
        if not pending.any():
            return t
        started = pending & (release <= t * (1 + 1e-12))
        waiting = release[pending & ~started]
        next_start = float(waiting.min()) if len(waiting) else float("inf")
        if not started.any():
            t = next_start
            continue
        idx = np.flatnonzero(started)
        r = _rates(res[:, idx], coef[:, idx], nres, flow_cap[idx])
        dt_each = left[idx] / r
        dt = float(dt_each.min())
        if t + dt > next_start:  # a flow starts first: re-share then
            left[idx] -= r * (next_start - t)
            t = next_start
            continue
        # Finish every flow within a hair of the earliest together (symmetric plans end in bulk).
        done = dt_each <= dt * (1 + 1e-9)
        left[idx] -= r * dt
        left[idx[done]] = 0.0
        pending[idx[done]] = False
        t += dt
    # Too many distinct events: start the rest now and finish at their current rates (a lower estimate).
    idx = np.flatnonzero(pending)
    r = _rates(res[:, idx], coef[:, idx], nres, flow_cap[idx])
    return max(t, float(release[idx].max())) + float((left[idx] / r).max())
