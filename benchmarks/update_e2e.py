"""End-to-end weight update: wbridge against the gather-and-broadcast paths RL frameworks use.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/update_e2e.py`` (or ``wbridge bench update``).

A synthetic Qwen-like transformer (``--model 1g``: 1.0 GiB in bf16) lives in 4 trainer processes
(TP=2 x DP=2, Megatron-like: separate q/k/v and gate/up) and is updated into 2 rollout processes
(TP=2, vLLM-like: fused ``qkv_proj`` and ``gate_up_proj``). Every version is a new set of values
(``wbridge.testing.synthetic``). Methods, each timed over ``--versions`` versions after ``--warmup``:

* ``wbridge-<transport>``: ``Publisher(mode="sync", staging=ZeroCopy())`` serving every transport;
  ``Subscriber(transport=...)`` pulls exactly the bytes each rollout rank needs, from both DP
  replicas. Zero copy: rollouts read the trainers' live tensors, publish() returns once all acked.
* ``wbridge-<transport>-staged``: the default publisher (2 staging slots): publish() first copies
  the shards into a staging slot (the trainer's only stall in the asynchronous modes).
* ``gather-bcast`` (baseline A) and ``per-tensor-bcast`` (baseline B): see ``benchmarks/_common.py``.

Update time of a version: from the first trainer entering the update call (publish, or the
baseline's gather) to the last rollout rank holding the new weights in its own layout; median over
versions. After every update (outside the timed region) each rollout checks every byte of its
tensors against the expected values (``synthetic.mismatches``) and the run aborts on a mismatch;
before every wbridge pull the destinations are overwritten with garbage.

Efficiency (wbridge, zero copy): (bytes all rollouts needed / the transport's own throughput) over
the measured pull window (first read to last byte). The throughput is measured in the same run,
with nothing else running, by bare bulk reads with the pulls' traffic pattern
(``_common.BulkReader``: the transport API and serving processes, as ``transports.bench.run_bench``
does, 4 MiB ops): as many readers at once as there are rollouts, each reading as many bytes as one
rollout needs, half from each of two serving processes (the DP replicas), in parallel. 1.0 means
the update moved its bytes as fast as the bare transport does; the headline is the lowest over
the transports.

Peak RSS (``ru_maxrss``) of trainer rank 0 and rollout rank 0 comes from separate process sets for
wbridge and for the baselines, read after the zero-copy runs, after the staged runs and after
baseline A (before B).

Last line: ``update_e2e: local_vs_gather_bcast=<r> tcp_vs_gather_bcast=<r> efficiency=<r> rss_ratio=<r>``
(ratios: baseline A time over wbridge time; rss_ratio: wbridge (zero copy) trainer-0 peak over
baseline A trainer-0 peak).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from _common import (
    BUCKET_BYTES,
    MODEL_SIZES,
    bucket_plan,
    call_all,
    concurrent_bulk_gbps,
    fill_garbage,
    fmt_ratio,
    free_port,
    gather,
    machine,
    median,
    model_config,
    ratio,
    stop_all,
    write_json,
)
from _ranks import DP, ROLLOUTS, TP, RolloutRank, TrainerRank, start_ranks


class Trainer(TrainerRank):
    """One trainer rank: live shards, a wbridge publisher or a place in the baseline's groups."""

    def set_version(self, content: int) -> None:
        from wbridge.testing.synthetic import set_version

        set_version(self.tensors, content)

    def wb_open(self, channel: str, zero_copy: bool, transport: str) -> None:
        from wbridge import Staging, ZeroCopy

        self.open_publisher(channel, transport, mode="sync", staging=ZeroCopy() if zero_copy else Staging())

    def wb_publish(self, timeout: float) -> dict:
        t0 = time.perf_counter()
        v = self.pub.publish(timeout=timeout)
        t1 = time.perf_counter()
        s = self.pub.stats.last
        return {"v": v, "t0": t0, "t1": t1, "stall_s": s.stall_s, "wait_s": s.wait_s}

    def baseline(self, bucket_bytes: int) -> dict:
        from _common import baseline_trainer_update

        buckets = bucket_plan(self.cfg.specs(), bucket_bytes)
        t0 = time.perf_counter()
        baseline_trainer_update(self.groups, self.rank, self.cfg, self.tensors, self.boxes, buckets)
        return {"t0": t0, "t1": time.perf_counter()}


class Rollout(RolloutRank):
    """One rollout rank: fused TP layout, a wbridge subscriber or a place in the baseline's groups."""

    def wb_open(self, channel: str, transport: str) -> None:
        self.open_subscriber(channel, transport)

    def garbage(self) -> None:
        fill_garbage(self.tensors)

    def wb_pull(self, version: int, timeout: float) -> dict:
        v = self.sub.pull(min_version=version, timeout=timeout)
        t1 = time.perf_counter()
        st = self.sub.stats.last
        return {
            "v": v,
            "t1": t1,
            "seconds": st.seconds,
            "nbytes": st.nbytes,
            "ops": st.ops,
            "transports": sorted({n for n, _ in self.sub.stats.transports.values()}),
        }

    def check(self, content: int) -> list[str]:
        from wbridge.testing.synthetic import mismatches

        return mismatches(self.tensors, content)

    def baseline(self, bucket_bytes: int) -> dict:
        from _common import baseline_rollout_update

        buckets = bucket_plan(self.cfg.specs(), bucket_bytes)
        t0 = time.perf_counter()
        baseline_rollout_update(self.groups, self.cfg, self.targets, buckets)
        return {"t0": t0, "t1": time.perf_counter()}


# ----------------------------------------------------------------------------------------------


class Run:
    """The driver's state: content versions, per-version records, progress output."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.content = 0
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            print(f"[{time.perf_counter() - self.t0:5.0f}s] {msg}", file=sys.stderr, flush=True)

    def versions(self, method: str, trainers, rollouts, writers, update) -> None:
        """Runs warmup + timed versions of ``update(v)`` -> row; ``writers`` are the trainers whose
        values a reader can see. Each rollout's check of version c overlaps the trainers' step to c+1."""
        a = self.args
        n = a.warmup + a.versions
        self.content += 1
        for t in writers:
            t.send("set_version", self.content)
        for r in rollouts:
            r.send("garbage")
        gather(writers + rollouts, a.timeout)
        for i in range(n):
            row = {"method": method, "version": i + 1, "warmup": i < a.warmup, **update(i + 1)}
            for r in rollouts:
                r.send("check", self.content)
            if i + 1 < n:
                for t in writers:
                    t.send("set_version", self.content + 1)
            for k, names in enumerate(gather(rollouts, a.timeout)):
                if names:
                    raise RuntimeError(
                        f"{method}: rollout {k} is NOT bit-exact at content version "
                        f"{self.content} in {len(names)} tensors, e.g. {names[:3]}"
                    )
            row["exact"] = True
            self.rows.append(row)
            self.log(
                f"  {method:>22} v{i + 1}{' (warmup)' if row['warmup'] else ''}: update "
                f"{row['update_s']:.3f}s"
                + (
                    f", pull window {row['pull_window_s']:.3f}s, {row['bytes'] / 2**20:.0f} MiB"
                    if "bytes" in row
                    else ""
                )
                + ", bit-exact"
            )
            if i + 1 < n:
                self.content += 1
                for r in rollouts:
                    r.send("garbage")
                gather(writers + rollouts, a.timeout)

    def wbridge(self, trainers, rollouts, transport: str, zero_copy: bool) -> None:
        a = self.args
        method = f"wbridge-{transport}" + ("" if zero_copy else "-staged")
        channel = f"e2e-{method}"
        call_all(trainers, "wb_open", channel, zero_copy, transport, call_timeout=a.timeout)
        call_all(rollouts, "wb_open", channel, transport, call_timeout=a.timeout)

        def update(v: int) -> dict:
            for r in rollouts:
                r.send("wb_pull", v, a.timeout)
            pubs = call_all(trainers, "wb_publish", a.timeout, call_timeout=a.timeout)
            pulls = gather(rollouts, a.timeout)
            if any(p["v"] != v for p in pubs + pulls):
                raise RuntimeError(f"{method}: version mismatch {[p['v'] for p in pubs + pulls]} != {v}")
            if any(p["transports"] != [transport] for p in pulls):
                raise RuntimeError(f"{method}: rollouts used {[p['transports'] for p in pulls]}")
            end = max(p["t1"] for p in pulls)
            return {
                "transport": transport,
                "zero_copy": zero_copy,
                "update_s": end - min(p["t0"] for p in pubs),
                "pull_window_s": end - min(p["t1"] - p["seconds"] for p in pulls),
                "pull_s": [p["seconds"] for p in pulls],
                "bytes": sum(p["nbytes"] for p in pulls),
                "ops": [p["ops"] for p in pulls],
                "snapshot_s": max(p["stall_s"] for p in pubs),
            }

        try:
            self.versions(method, trainers, rollouts, trainers, update)
        finally:
            call_all(rollouts, "close_channel", call_timeout=a.timeout)
            call_all(trainers, "close_channel", call_timeout=a.timeout)

    def baseline(self, trainers, rollouts, method: str, bucket_bytes: int) -> None:
        a = self.args

        def update(v: int) -> dict:
            res = call_all(trainers + rollouts, "baseline", bucket_bytes, call_timeout=a.timeout)
            end = max(r["t1"] for r in res[len(trainers) :])
            return {"update_s": end - min(r["t0"] for r in res[: len(trainers)]), "bucket_bytes": bucket_bytes}

        # only the first DP replica's values reach the rollouts, so only it takes the training steps
        self.versions(method, trainers, rollouts, trainers[:TP], update)

    def median_of(self, method: str, key: str = "update_s") -> float:
        return median([r[key] for r in self.rows if r["method"] == method and not r["warmup"]])


def transport_yardstick(transport: str, size: int, repeat: int, timeout: float, staged: bool = False) -> dict:
    """What the bare transport moves with the pulls' traffic pattern: as many readers at once as
    there are rollouts, each reading its bytes half from each of DP serving processes. Zero copy
    reads live memory, which the local transport reaches with process_vm_readv, and is measured
    so; staged slots are the transport's host buffers (memfd mappings for local), as here."""
    options = {"method": "vm"} if transport == "local" and not staged else None
    return concurrent_bulk_gbps(transport, size, ROLLOUTS, DP, repeat, options, timeout)


def main(argv: list[str] | None = None) -> int:
    import transports

    ap = argparse.ArgumentParser(prog="update_e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=MODEL_SIZES, default="1g")
    ap.add_argument("--versions", type=int, default=3, help="timed versions per method (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed versions first (connections, plans)")
    ap.add_argument(
        "--transports",
        default="tcp,local",
        help="comma-separated, or 'all' for every available transport (mooncake, nixl and nccl "
        "add about 40 s each here); default: the built-in tcp,local",
    )
    ap.add_argument(
        "--staged",
        default="local",
        help="comma-separated transports to also run with the default staged publisher "
        "(2 slots); 'none' for none (default: local)",
    )
    ap.add_argument("--no-baseline-b", action="store_true", help="skip the per-tensor broadcast baseline")
    ap.add_argument(
        "--bucket-mb",
        type=int,
        default=BUCKET_BYTES >> 20,
        help="baseline A bucket (default 512, verl's and slime's default)",
    )
    ap.add_argument("--bench-repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--json", action="store_true", help="write <out>/<name>.json")
    ap.add_argument("--plot", action="store_true", help="also draw <out>/<name>.png")
    ap.add_argument("--out", default=".", help="directory for <name>.json (default: the working directory)")
    ap.add_argument("--name", default="update_e2e", help="results file name (default update_e2e)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)

    from wbridge.store import open_store

    names = transports.available() if a.transports == "all" else a.transports.split(",")
    missing = [t for t in names if t not in transports.available()]
    if missing:
        ap.error(f"transports {missing} are not available here (available: {transports.available()})")
    staged = [t for t in a.staged.split(",") if t in names] if a.staged != "none" else []
    cfg = model_config(a.model)
    run = Run(a)
    info = machine()
    t_start = time.perf_counter()
    run.log(
        f"update_e2e: {cfg.nbytes / 2**20:.0f} MiB bf16 model, {TP * DP} trainers (TP={TP} x DP={DP}), "
        f"{ROLLOUTS} rollouts (TP={TP}, fused qkv/gate_up), transports {names}, "
        f"{a.warmup}+{a.versions} versions per method, {info['cpus']} CPUs"
    )
    store_url = f"tcp://127.0.0.1:{free_port()}"
    store = open_store(store_url, host_store=True)
    rss: dict[str, dict[str, float]] = {}
    bench: dict[str, dict] = {}

    import update_e2e as mod  # the actor classes by an importable name (also under runpy)

    def actors():
        return start_ranks(mod.Trainer, mod.Rollout, (a.model, store_url), max(a.timeout, 300.0))

    def record_rss(label: str, trainers, rollouts) -> None:
        rss[label] = {"trainer0_mib": trainers[0].call("rss"), "rollout0_mib": rollouts[0].call("rss")}
        run.log(
            f"  peak RSS after {label}: trainer 0 {rss[label]['trainer0_mib']:.0f} MiB, "
            f"rollout 0 {rss[label]['rollout0_mib']:.0f} MiB"
        )

    try:
        # wbridge, in its own process set
        run.log("wbridge (zero copy, then staged):")
        trainers, rollouts = actors()
        try:
            builtin = [t for t in names if t in ("tcp", "local")]
            for name in builtin:
                run.wbridge(trainers, rollouts, name, zero_copy=True)
            record_rss("wbridge", trainers, rollouts)  # before other engines add their own memory
            for name in names:
                if name not in builtin:
                    run.wbridge(trainers, rollouts, name, zero_copy=True)
            if staged:
                for name in staged:
                    run.wbridge(trainers, rollouts, name, zero_copy=False)
                record_rss("wbridge-staged", trainers, rollouts)
        finally:
            stop_all(trainers + rollouts)
        # the yardstick for efficiency, with nothing else running
        per_rollout = max(r["bytes"] for r in run.rows) // ROLLOUTS
        for name in names + [f"{t}-staged" for t in staged]:
            bench[name] = transport_yardstick(
                name.removesuffix("-staged"), per_rollout, a.bench_repeat, a.timeout, staged=name.endswith("-staged")
            )
            run.log(
                f"  {name} bare bulk reads, {ROLLOUTS} readers x {per_rollout / 2**20:.0f} MiB from {DP} "
                f"sources each, 4 MiB ops: "
                f"{bench[name]['gbps']:.2f} GB/s together, {bench[name]['solo_gbps']:.2f} GB/s alone"
            )
        # the baselines, in a fresh process set
        run.log("baselines (torch.distributed gloo):")
        trainers, rollouts = actors()
        try:
            call_all(trainers + rollouts, "dist_init", free_port(), call_timeout=a.timeout)
            run.baseline(trainers, rollouts, "gather-bcast", a.bucket_mb << 20)
            record_rss("gather-bcast", trainers, rollouts)
            if not a.no_baseline_b:
                run.baseline(trainers, rollouts, "per-tensor-bcast", 0)
        finally:
            stop_all(trainers + rollouts)
    finally:
        store.close()

    base = run.median_of("gather-bcast")
    summary: dict[str, Any] = {"methods": {}}
    for method in dict.fromkeys(r["method"] for r in run.rows):
        rows = [r for r in run.rows if r["method"] == method and not r["warmup"]]
        m = {
            "update_s": median([r["update_s"] for r in rows]),
            "versions": len(rows),
            "speedup_vs_gather_bcast": ratio(base, median([r["update_s"] for r in rows])),
        }
        if "transport" in rows[0]:
            gbps = bench[method.removeprefix("wbridge-")]["gbps"]
            effs = [(r["bytes"] / (gbps * 1e9)) / r["pull_window_s"] for r in rows]
            m.update(
                {
                    "pull_window_s": median([r["pull_window_s"] for r in rows]),
                    "bytes": rows[0]["bytes"],
                    "bench_gbps": gbps,
                    "efficiency": median(effs),
                    "update_gbps": rows[0]["bytes"] / median([r["update_s"] for r in rows]) / 1e9,
                    "snapshot_s": median([r["snapshot_s"] for r in rows]),
                }
            )
        summary["methods"][method] = m
    zc = [m for k, m in summary["methods"].items() if k.startswith("wbridge-") and not k.endswith("-staged")]
    summary["efficiency"] = min((m["efficiency"] for m in zc), default=float("nan"))
    summary["rss_mib"] = rss
    summary["rss_ratio"] = ratio(rss["wbridge"]["trainer0_mib"], rss["gather-bcast"]["trainer0_mib"])
    if "wbridge-staged" in rss:
        summary["rss_ratio_staged"] = ratio(rss["wbridge-staged"]["trainer0_mib"], rss["gather-bcast"]["trainer0_mib"])
    wall = time.perf_counter() - t_start

    print(f"{'method':>24} {'update s':>9} {'vs A':>6} {'GB/s':>6} {'efficiency':>10}")
    for method, m in summary["methods"].items():
        extra = f"{m['update_gbps']:>6.2f} {m['efficiency']:>10.2f}" if "efficiency" in m else f"{'':>6} {'':>10}"
        print(f"{method:>24} {m['update_s']:>9.3f} {m['speedup_vs_gather_bcast']:>6.2f} {extra}")
    for label, r in rss.items():
        print(f"peak RSS {label:>15}: trainer 0 {r['trainer0_mib']:.0f} MiB, rollout 0 {r['rollout0_mib']:.0f} MiB")
    print(f"wall time {wall:.0f}s")
    if a.json or a.plot:
        data = {
            "config": {
                **vars(a),
                "model_bytes": cfg.nbytes,
                "model": a.model,
                "tp": TP,
                "dp": DP,
                "rollouts": ROLLOUTS,
                "transports": names,
            },
            "machine": info,
            "summary": summary,
            "rows": run.rows,
            "bench": bench,
            "wall_s": wall,
        }
        path = write_json(f"{a.name}.json", data, a.out)
        print(f"results: {os.path.relpath(path)}")
        if a.plot:
            from plots import plot_update

            print(f"plot: {os.path.relpath(plot_update(data, f'{a.name}.png', a.out))}")

    def speedup(t: str) -> str:
        m = summary["methods"].get(f"wbridge-{t}")
        return fmt_ratio(m["speedup_vs_gather_bcast"]) if m else "n/a"

    print(
        f"update_e2e: local_vs_gather_bcast={speedup('local')} tcp_vs_gather_bcast={speedup('tcp')} "
        f"efficiency={fmt_ratio(summary['efficiency'])} rss_ratio={fmt_ratio(summary['rss_ratio'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
