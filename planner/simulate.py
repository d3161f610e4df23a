"""A flow-level simulator for a set of plans: estimated makespan against the NIC lower bound.

Model
-----
Every source rank has an egress NIC and every destination rank an ingress NIC (trainers and
rollout workers are different machines), each with its own bandwidth. The reads of one
destination from one source form a *flow*; all flows start at time 0 and share bandwidth
max-min fairly (progressive filling), re-shared whenever a flow finishes. Each op has a
round-trip ``latency_s`` and a flow keeps ``queue_depth`` reads in flight, so by Little's law a
flow of ``n`` ops and ``B`` bytes runs at most at ``queue_depth * (B / n) / latency_s``: small
strided reads are slow, large ones are bandwidth-bound.

The *lower bound* ignores latency and sharing: the busiest NIC's bytes over its bandwidth, egress
or ingress. No schedule of these plans can beat it; ``ratio = makespan / lower_bound``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .plan import Plan


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
    latency_s: float = 5e-6,
    queue_depth: int = 64,
    max_events: int = 100_000,
) -> SimResult:
    """Simulates every plan at once (see the module docstring). Bandwidths in bytes per second."""
    plan_list = list(plans.values()) if isinstance(plans, Mapping) else list(plans)
    src_bw_spec = bandwidth if src_bandwidth is None else src_bandwidth
    dst_bw_spec = bandwidth if dst_bandwidth is None else dst_bandwidth
    fs, fd, fb, fn = [], [], [], []
    for p in plan_list:
        for s in p.sources:
            if len(s):
                fs.append(s.src_rank)
                fd.append(p.dst_rank)
                fb.append(s.total_bytes)
                fn.append(len(s))
    if not fb:
        return SimResult(0.0, 0.0, 1.0, 0, 0, 0, (-1, 0), (-1, 0))
    src_ranks = sorted(set(fs))
    dst_ranks = sorted(set(fd))
    s_idx = {r: i for i, r in enumerate(src_ranks)}
    d_idx = {r: i for i, r in enumerate(dst_ranks)}
    # NICs: sources first, then destinations.
    cap = np.array(
        [_bw(src_bw_spec, r, bandwidth) for r in src_ranks] + [_bw(dst_bw_spec, r, bandwidth) for r in dst_ranks],
        dtype=np.float64,
    )
    a = np.array([s_idx[r] for r in fs], dtype=np.int64)
    b = np.array([len(src_ranks) + d_idx[r] for r in fd], dtype=np.int64)
    nbytes = np.array(fb, dtype=np.float64)
    nops = np.array(fn, dtype=np.float64)
    nic_bytes = np.bincount(a, nbytes, len(cap)) + np.bincount(b, nbytes, len(cap))
    lb_per_nic = nic_bytes / cap
    lower = float(lb_per_nic.max())
    flow_cap = queue_depth * (nbytes / nops) / latency_s if latency_s > 0 else np.full(len(nbytes), np.inf)
    makespan = _fluid(a, b, nbytes, cap, flow_cap, max_events)
    es = int(np.argmax(nic_bytes[: len(src_ranks)]))
    ed = int(np.argmax(nic_bytes[len(src_ranks) :]))
    return SimResult(
        makespan,
        lower,
        makespan / lower if lower else 1.0,
        int(nbytes.sum()),
        int(nops.sum()),
        len(fb),
        (src_ranks[es], int(nic_bytes[es])),
        (dst_ranks[ed], int(nic_bytes[len(src_ranks) + ed])),
    )


def _rates(a: np.ndarray, b: np.ndarray, cap: np.ndarray, flow_cap: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows ``a[i] -> b[i]`` over NIC capacities and per-flow caps
    (progressive filling)."""
    n = len(a)
    rate = np.zeros(n)
    free = np.ones(n, dtype=bool)
    left = cap.copy()
    while free.any():
        cnt = np.bincount(a[free], minlength=len(cap)) + np.bincount(b[free], minlength=len(cap))
        busy = cnt > 0
        inc = min(float((left[busy] / cnt[busy]).min()), float((flow_cap[free] - rate[free]).min()))
        rate[free] += inc
        left -= inc * cnt
        full = busy & (left <= cap * 1e-12)
        free &= ~(full[a] | full[b]) & (rate < flow_cap * (1 - 1e-12))
    return rate


def _fluid(
    a: np.ndarray, b: np.ndarray, work: np.ndarray, cap: np.ndarray, flow_cap: np.ndarray, max_events: int
) -> float:
    t = 0.0
    left = work.copy()
    alive = left > 0
    for _ in range(max_events):
        if not alive.any():
            return t
        idx = np.flatnonzero(alive)
        r = _rates(a[idx], b[idx], cap, flow_cap[idx])
        dt_each = left[idx] / r
        dt = float(dt_each.min())
        # Finish every flow within a hair of the earliest together (symmetric plans end in bulk).
        done = dt_each <= dt * (1 + 1e-9)
        left[idx] -= r * dt
        left[idx[done]] = 0.0
        alive[idx[done]] = False
        t += dt
    # Too many distinct events: finish the rest at their current rates (a lower estimate).
    idx = np.flatnonzero(alive)
    r = _rates(a[idx], b[idx], cap, flow_cap[idx])
    return t + float((left[idx] / r).max())
