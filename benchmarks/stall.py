"""GPU stall per RL step: wbridge's sync modes against the gather-and-broadcast baseline.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/stall.py`` (or ``wbridge bench stall``).

Real processes emulate an RL loop: 4 trainers (TP=2 x DP=2) and 2 rollout engines (TP=2, fused
layout) of a synthetic Qwen-like model (``--model``). A training step is ``--train-s`` seconds of
CPU work that writes the next version's values into the trainer's shards (the optimizer step); a
generation step is ``--gen-s`` seconds of CPU work that starts by checking, bit for bit, the
version the rollout holds (``synthetic.mismatches``; a mismatch aborts the run). The work runs at a
lower CPU priority (``_common.Compute``, ``--nice 10``; ``--nice 0`` competes as an equal),
standing in for GPU kernels that leave the host CPUs to the weight transfer. ``--steps`` steps per
mode:

* ``gather-bcast`` (baseline A, sync): generate, train, then everyone joins the gather + bucketed
  broadcast (``_common``) and a final barrier: one on-policy step after another. The write of the
  new values runs a quarter into the training step (``BOOKKEEPING_AT``).
* ``sync``: the same loop with ``Publisher(mode="sync")``: trainers ``publish()`` (blocking: returns
  when every rollout acked), rollouts pull.
* ``one_step_off`` / ``async`` (``max_staleness=2``): trainers and rollouts run freely. A trainer
  step is laid out as on a GPU: ``--train-s`` of compute that only reads the weights (forward and
  backward), then the optimizer's write of the next version's values, then
  ``Publisher.publish_async()``, whose snapshot copy (and the mode's waits) run on the publisher's
  thread while the next step computes; the next step calls ``.result()`` right before its write, as
  the API's contract asks. (The compute part is shortened by the last write's duration, so a step
  still lasts about ``--train-s``.) Rollouts pull in a background thread while they generate
  (``--pull background``, default; into a second copy of their weights, copied into the live weights
  at a step boundary, as an engine must, so that a step never runs on half a version) or between
  steps (``--pull between``). Generation step k+1 needs a version at most one (one_step_off) or two
  (async) versions behind the trainers' k-th update; a rollout blocks only when it holds none.

Stall (per process per step): time blocked in publish(), in publish_async() and in its future's
``.result()`` before the write, in a pull or a version swap, or in the baseline's
gather/broadcast/barrier. Not stall: waiting for the other side's compute in the sync loops (the
algorithm's data dependency, the same in both). The last version's future is awaited after the
timed steps and not counted (the next step's compute would overlap it), as step 1's previous
publish (the initial version) completed before them; that wait is reported as ``drain_s``. The
average is over all 6 processes (each stands for a GPU); ratios are baseline stall over mode stall
(higher is better).

Reader-ordered packing (``--pack-tp``, default 4; 0 skips it): the rollouts above split every
tensor as the trainers do, so their slots need little reordering. After the modes, each trainer
TP rank's snapshot copy runs twice over, alternating, in this process (``pack_copy.measure``: the
publisher's own ``snapshot`` on slots made as a publisher makes them, ``--transport``'s): into the
plain slot, and into a slot packed for fused rollouts of TP=``--pack-tp``, whose row-parallel
``o_proj``/``down_proj`` are cut into column strips. Its line, before the last::

    stall_pack: pack_vs_plain=<r> plain_ms=<ms> packed_ms=<ms> rollout_tp=<n> cells=<n>

``pack_vs_plain``: the median over the ``--pack-repeat`` pairs of both TP ranks of the packed copy's
time over the plain copy's next to it (the issue's target: <= 1.2); the times are medians.

Last line: ``stall: async_vs_baseline=<r> one_step_off_vs_baseline=<r> sync_vs_baseline=<r>``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
from typing import Any

from _common import (
    BUCKET_BYTES,
    MODEL_SIZES,
    Compute,
    baseline_rollout_update,
    baseline_trainer_update,
    bucket_plan,
    call_all,
    fmt_ratio,
    free_port,
    gather,
    machine,
    model_config,
    ratio,
    stop_all,
    write_json,
)
from _ranks import DP, ROLLOUTS, TP, RolloutRank, TrainerRank, start_ranks

STALENESS = {"sync": 0, "one_step_off": 1, "async": 2}
# In the baseline and sync loops the benchmark's own memory-heavy work (writing a version's values,
# checking one) runs a quarter into a step, away from the step boundaries where pulls and swaps
# happen: on a GPU node it would not share host memory bandwidth with the transfer. (The free
# running modes write at the end of the step instead, where an optimizer does.)
BOOKKEEPING_AT = 0.25


class _Side:
    """What trainers and rollouts of this benchmark add to their ``_ranks`` class (the next base
    class): emulated compute at niceness ``nice``, the baseline's buckets, a barrier."""

    def __init__(self, *args: Any, nice: int) -> None:
        super().__init__(*args)
        self.compute = Compute(nice)
        self.buckets = bucket_plan(self.cfg.specs(), BUCKET_BYTES)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.groups.world)

    def close(self) -> None:
        # the compute thread stops before the groups are left: the other order ends the actor
        # processes with "terminate called without an active exception"
        self.compute.close()
        super().close()


class Trainer(_Side, TrainerRank):
    def __init__(self, rank: int, model: str, store_url: str, nice: int) -> None:
        super().__init__(rank, model, store_url, nice=nice)
        self.fut = None  # the publish_async() in flight
        self.write_s = 0.0  # the last optimizer write's duration

    def _set(self, content: int):
        from wbridge.testing.synthetic import set_version

        return lambda: set_version(self.tensors, content)

    def train(self, seconds: float, content: int) -> float:
        return self.compute.step(seconds, self._set(content), at=BOOKKEEPING_AT)[0]

    def train_overlapped(self, seconds: float, content: int, timeout: float) -> float:
        """One step of the free-running modes; returns its stall. Compute that only reads the
        weights (the previous snapshot copy overlaps it), then the previous publish's ``result()``
        (stall), the optimizer's write (compute), and ``publish_async()`` (stall while it starts)."""
        self.compute.step(max(0.0, seconds - self.write_s))
        t0 = time.perf_counter()
        if self.fut is not None:
            self.fut.result(timeout=timeout)
            self.fut = None
        stall = time.perf_counter() - t0
        self.write_s = self.compute.step(0.0, self._set(content))[0]
        t1 = time.perf_counter()
        self.fut = self.pub.publish_async(timeout=timeout)
        return stall + time.perf_counter() - t1

    # -- baseline ------------------------------------------------------------------------------
    def baseline_update(self) -> float:
        t0 = time.perf_counter()
        baseline_trainer_update(self.groups, self.rank, self.cfg, self.tensors, self.boxes, self.buckets)
        self.barrier()
        return time.perf_counter() - t0

    # -- wbridge -------------------------------------------------------------------------------
    def open(self, channel: str, mode: str, transport: str) -> None:
        from wbridge import Async

        self.open_publisher(channel, transport, mode=Async(max_staleness=STALENESS[mode]) if mode == "async" else mode)

    def publish(self, timeout: float) -> float:
        t0 = time.perf_counter()
        self.pub.publish(timeout=timeout)
        return time.perf_counter() - t0

    def loop(self, steps: int, seconds: float, base: int, timeout: float) -> dict:
        """Free-running: compute, write, publish_async, repeat; versions base+2 .. base+steps+1."""
        t_start = time.perf_counter()
        stalls = [self.train_overlapped(seconds, base + k + 1, timeout) for k in range(1, steps + 1)]
        wall = time.perf_counter() - t_start
        t0 = time.perf_counter()
        self.fut.result(timeout=timeout)  # drain, not counted: the next step's compute would overlap it
        self.fut = None
        drain = time.perf_counter() - t0
        snaps = [s.stall_s for s in list(self.pub.stats.history)[-steps:]]  # the copies, now off the trainer's path
        self.pub.wait_acked(steps + 1, timeout=timeout)  # keep serving until every rollout has the last one
        return {"stalls": stalls, "snapshot_s": snaps, "drain_s": drain, "wall_s": wall}

    def close_channel(self) -> None:
        self.fut = None
        super().close_channel()


class Rollout(_Side, RolloutRank):
    def __init__(self, idx: int, model: str, store_url: str, nice: int) -> None:
        super().__init__(idx, model, store_url, nice=nice)
        self.shadow = None
        self.held = 0  # content version in the live tensors (0: none)
        self.checked_version = 0  # the last content version checked
        self.checked = 0
        self.background = False

    def _check(self, content: int):
        from wbridge.testing.synthetic import mismatches

        def run() -> None:
            bad = mismatches(self.tensors, content)
            if bad:
                raise RuntimeError(
                    f"rollout {self.idx}: NOT bit-exact at content version {content} in "
                    f"{len(bad)} tensors, e.g. {bad[:3]}"
                )
            self.checked += 1

        return run

    def generate(self, seconds: float) -> float:
        """One generation step; it starts by checking the weights it runs on (not yet checked)."""
        fn = self._check(self.held) if self.held and self.checked_version != self.held else None
        self.checked_version = self.held
        return self.compute.step(seconds, fn, at=BOOKKEEPING_AT)[0]

    # -- baseline ------------------------------------------------------------------------------
    def baseline_update(self, content: int) -> float:
        t0 = time.perf_counter()
        baseline_rollout_update(self.groups, self.cfg, self.targets, self.buckets)
        self.barrier()
        self.held = content
        return time.perf_counter() - t0

    # -- wbridge -------------------------------------------------------------------------------
    def open(self, channel: str, transport: str, background: bool) -> None:
        if background and self.shadow is None:
            self.shadow = self.new_tensors()
        self.open_subscriber(channel, transport, self.shadow if background else None)
        self.background = background

    def pull(self, version: int, base: int, timeout: float) -> float:
        """Blocking pull of at least ``version`` into the registered tensors; returns the seconds."""
        t0 = time.perf_counter()
        v = self.sub.pull(min_version=version, timeout=timeout)
        if self.background:
            self._swap()
        self.held = base + v
        return time.perf_counter() - t0

    def _swap(self) -> None:
        """The engine's copy of a complete version into its live weights (a plain memcpy; on a GPU
        a device-to-device copy)."""
        for name, (t, _) in self.tensors.items():
            src = self.shadow[name][0]
            ctypes.memmove(t.data_ptr(), src.data_ptr(), t.numel() * t.element_size())

    def loop(self, steps: int, seconds: float, base: int, lag: int, timeout: float) -> dict:
        """Free-running: generate, then make sure the next step's weights are recent enough.

        Generation step k+1 needs channel version >= k + 1 - lag (version 1 is the initial one,
        the trainers' k-th update is version k + 1). ``between``: at each boundary pull the newest
        version if there is a newer one (blocking). ``background``: a thread pulls each new version
        into the shadow copy; at a boundary the newest complete one is copied in (a swap).
        """
        final = steps + 1
        stalls = []
        t_start = time.perf_counter()
        if not self.background:
            held_v = self.held - base
            for k in range(1, steps + 1):
                self.generate(seconds)
                t0 = time.perf_counter()
                latest = self.sub.latest() or 0
                if latest > held_v or held_v < k + 1 - lag:
                    held_v = self.sub.pull(min_version=max(held_v + 1, k + 1 - lag), timeout=timeout)
                    self.held = base + held_v
                stalls.append(time.perf_counter() - t0)
            wall = time.perf_counter() - t_start
            while held_v < final:  # drain, not counted: the trainers wait for the last acks
                held_v = self.sub.pull(min_version=held_v + 1, timeout=timeout)
            self.held = base + held_v
        else:
            state = {"ready": self.held - base, "error": None}
            cv = threading.Condition()
            swapped = {"v": self.held - base}

            def puller() -> None:
                try:
                    while state["ready"] < final:
                        v = self.sub.pull(min_version=state["ready"] + 1, timeout=timeout)
                        with cv:
                            state["ready"] = v
                            cv.notify_all()
                            while swapped["v"] < v:  # the shadow is ours again only after the swap
                                cv.wait()
                except BaseException as e:  # noqa: BLE001 - surfaced by the main thread
                    with cv:
                        state["error"] = e
                        cv.notify_all()

            th = threading.Thread(target=puller, name="bg-pull", daemon=True)
            th.start()

            def boundary(need: int) -> None:
                """Copies in the newest complete version, waiting for one >= ``need``. A version
                staged while it waits is copied in at once: the puller pulls the next one only
                after that copy (waiting with it staged would deadlock on a later ``need``)."""
                deadline = time.monotonic() + timeout
                with cv:
                    while True:
                        if state["error"] is not None:
                            raise state["error"]
                        if state["ready"] > swapped["v"]:
                            self._swap()
                            swapped["v"] = state["ready"]
                            self.held = base + swapped["v"]
                            cv.notify_all()
                        if swapped["v"] >= need:
                            return
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError(f"rollout {self.idx}: no version >= {need} within {timeout:.0f}s")
                        cv.wait(left)

            for k in range(1, steps + 1):
                self.generate(seconds)
                t0 = time.perf_counter()
                boundary(k + 1 - lag)
                stalls.append(time.perf_counter() - t0)
            wall = time.perf_counter() - t_start
            boundary(final)  # drain, not counted
            th.join(timeout)
        self.compute.step(0.0, self._check(self.held))
        self.checked_version = self.held
        return {"stalls": stalls, "wall_s": wall, "final": self.held - base, "checked": self.checked}


# ----------------------------------------------------------------------------------------------


def run_sync_loop(trainers, rollouts, a, update) -> dict:
    """Generate, train, update, one after another; ``update(k)`` returns per-process stall seconds."""
    t_stalls = [[] for _ in trainers]
    r_stalls = [[] for _ in rollouts]
    t0 = time.perf_counter()
    for k in range(1, a.steps + 1):
        call_all(rollouts, "generate", a.gen_s, call_timeout=a.timeout)
        call_all(trainers, "train", a.train_s, a.base + k + 1, call_timeout=a.timeout)
        ts, rs = update(k + 1)
        for lst, s in zip(t_stalls + r_stalls, ts + rs):
            lst.append(s)
    wall = time.perf_counter() - t0
    call_all(rollouts, "generate", 0.0, call_timeout=a.timeout)  # checks the last version
    return {"trainer_stalls": t_stalls, "rollout_stalls": r_stalls, "wall_s": wall}


def mode_baseline(trainers, rollouts, a) -> dict:
    def update(v: int):
        for t in trainers:
            t.send("baseline_update")
        for r in rollouts:
            r.send("baseline_update", a.base + v)
        res = gather(trainers + rollouts, a.timeout)
        return res[: len(trainers)], res[len(trainers) :]

    call_all(trainers, "train", 0.0, a.base + 1, call_timeout=a.timeout)
    update(1)  # the initial weights, not counted
    return run_sync_loop(trainers, rollouts, a, update)


def open_channel(trainers, rollouts, a, mode: str, background: bool) -> None:
    channel = f"stall-{mode}-{a.base}"
    call_all(trainers, "open", channel, mode, a.transport, call_timeout=a.timeout)
    for r in rollouts:
        r.send("open", channel, a.transport, background)
    gather(rollouts, a.timeout)
    # the initial weights (version 1), not counted
    call_all(trainers, "train", 0.0, a.base + 1, call_timeout=a.timeout)
    for r in rollouts:
        r.send("pull", 1, a.base, a.timeout)
    call_all(trainers, "publish", a.timeout, call_timeout=a.timeout)
    gather(rollouts, a.timeout)


def mode_sync(trainers, rollouts, a) -> dict:
    open_channel(trainers, rollouts, a, "sync", background=False)

    def update(v: int):
        for r in rollouts:
            r.send("pull", v, a.base, a.timeout)
        ts = call_all(trainers, "publish", a.timeout, call_timeout=a.timeout)
        return ts, gather(rollouts, a.timeout)

    try:
        return run_sync_loop(trainers, rollouts, a, update)
    finally:
        call_all(rollouts, "close_channel", call_timeout=a.timeout)
        call_all(trainers, "close_channel", call_timeout=a.timeout)


def mode_free(trainers, rollouts, a, mode: str, background: bool) -> dict:
    open_channel(trainers, rollouts, a, mode, background)
    try:
        for t in trainers:
            t.send("loop", a.steps, a.train_s, a.base, a.timeout)
        for r in rollouts:
            r.send("loop", a.steps, a.gen_s, a.base, STALENESS[mode], a.timeout)
        tres = gather(trainers, a.timeout * (a.steps + 2))
        rres = gather(rollouts, a.timeout)
    finally:
        call_all(rollouts, "close_channel", call_timeout=a.timeout)
        call_all(trainers, "close_channel", call_timeout=a.timeout)
    return {
        "trainer_stalls": [r["stalls"] for r in tres],
        "rollout_stalls": [r["stalls"] for r in rres],
        "snapshot_s": [r["snapshot_s"] for r in tres],
        "drain_s": [r["drain_s"] for r in tres],
        "wall_s": max(r["wall_s"] for r in tres + rres),
        "checked": [r["checked"] for r in rres],
    }


def summarize(res: dict, steps: int) -> dict:
    def avg(lists):  # mean over processes of the per-step mean
        per_proc = [sum(x) / len(x) for x in lists if x]
        return sum(per_proc) / len(per_proc) if per_proc else 0.0

    t, r = avg(res["trainer_stalls"]), avg(res["rollout_stalls"])
    nt, nr = len(res["trainer_stalls"]), len(res["rollout_stalls"])
    return {
        "trainer_stall_s": t,
        "rollout_stall_s": r,
        "stall_s": (t * nt + r * nr) / (nt + nr),
        "step_wall_s": res["wall_s"] / steps,
    }


def measure_packing(cfg: Any, a: argparse.Namespace, log: Any) -> dict:
    """The trainers' snapshot copy into slots packed for TP=``a.pack_tp`` rollouts against the
    plain one (``pack_copy.measure``), for every trainer TP rank (DP replicas pack alike)."""
    from pack_copy import measure

    runs = []
    for rank in range(TP):
        transport = a.transport if a.transport in ("local", "tcp") else None
        runs.append(measure(cfg, TP, rank, a.pack_tp, a.pack_repeat, transport, full_check=False))
    plain = [x for r in runs for x in r["plain"]]
    packed = [x for r in runs for x in r["packed"]]
    out = {
        "pack_vs_plain": statistics.median(q / p for p, q in zip(plain, packed)),
        "plain_ms": statistics.median(plain) * 1e3,
        "packed_ms": statistics.median(packed) * 1e3,
        "cells": sum(r["cells"] for r in runs),
        "slot_over_plain": max(r["slot_over_plain"] for r in runs),
        "plain_s": plain,
        "packed_s": packed,
    }
    log(
        f"  packed snapshot copy (rollout TP={a.pack_tp}): {out['packed_ms']:.1f} ms against "
        f"{out['plain_ms']:.1f} ms plain, {out['cells']} cells, slot/plain {out['slot_over_plain']:.4f}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    import transports

    ap = argparse.ArgumentParser(prog="stall", description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=MODEL_SIZES, default="512m")
    ap.add_argument("--steps", type=int, default=5, help="RL steps per mode")
    ap.add_argument("--train-s", type=float, default=3.0, help="seconds of one training step")
    ap.add_argument("--gen-s", type=float, default=3.0, help="seconds of one generation step")
    ap.add_argument("--transport", default="local", help="the transport publishers serve and rollouts use")
    ap.add_argument(
        "--pull",
        choices=["background", "between"],
        default="background",
        help="how rollouts pull in one_step_off and async",
    )
    ap.add_argument("--modes", default="gather-bcast,sync,one_step_off,async")
    ap.add_argument(
        "--nice",
        type=int,
        default=10,
        help="CPU niceness of the emulated compute (0: equal priority with the transfer)",
    )
    ap.add_argument("--pack-tp", type=int, default=4, help="rollout TP the packed snapshot copy packs for (0: skip)")
    ap.add_argument("--pack-repeat", type=int, default=9, help="plain/packed snapshot pairs per trainer TP rank")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--json", action="store_true", help="write <out>/stall.json")
    ap.add_argument("--plot", action="store_true", help="also draw <out>/stall.png")
    ap.add_argument("--out", default=".", help="directory for stall.json (default: the working directory)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if "gather-bcast" not in modes:
        ap.error("--modes must include the baseline gather-bcast")

    from wbridge.store import open_store

    cfg = model_config(a.model)
    info = machine()
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        if not a.quiet:
            print(f"[{time.perf_counter() - t_start:5.0f}s] {msg}", file=sys.stderr, flush=True)

    log(
        f"stall: {cfg.nbytes / 2**20:.0f} MiB model, {TP * DP} trainers, {ROLLOUTS} rollouts, {a.steps} steps "
        f"of {a.train_s}s train / {a.gen_s}s generate, transport {a.transport}, pull {a.pull}, "
        f"transports here {transports.available()}"
    )
    store_url = f"tcp://127.0.0.1:{free_port()}"
    store = open_store(store_url, host_store=True)
    import stall as mod  # the actor classes by an importable name (also under runpy)

    results: dict[str, Any] = {}
    try:
        trainers, rollouts = start_ranks(mod.Trainer, mod.Rollout, (a.model, store_url, a.nice), max(a.timeout, 300.0))
        acts = trainers + rollouts
        try:
            call_all(acts, "dist_init", free_port(), call_timeout=a.timeout)
            a.base = 0
            for mode in modes:
                a.base += 1000  # content versions of each mode differ from every other mode's
                if mode == "gather-bcast":
                    res = mode_baseline(trainers, rollouts, a)
                elif mode == "sync":
                    res = mode_sync(trainers, rollouts, a)
                else:
                    res = mode_free(trainers, rollouts, a, mode, background=(a.pull == "background"))
                results[mode] = {**summarize(res, a.steps), "raw": res}
                s = results[mode]
                log(
                    f"  {mode:>13}: stall/step trainers {s['trainer_stall_s'] * 1e3:8.1f} ms, rollouts "
                    f"{s['rollout_stall_s'] * 1e3:8.1f} ms, all {s['stall_s'] * 1e3:8.1f} ms; "
                    f"{s['step_wall_s']:.2f} s/step; every pull bit-exact"
                )
                if "snapshot_s" in res:
                    snap = [x for per in res["snapshot_s"] for x in per]
                    log(
                        f"  {'':>13}  trainers' snapshot copy {sum(snap) / len(snap) * 1e3:.1f} ms/step on the "
                        f"publish thread, overlapped with compute (the last one's drain: "
                        f"{max(res['drain_s']) * 1e3:.1f} ms, not counted)"
                    )
        finally:
            stop_all(acts)
    finally:
        store.close()

    pack = measure_packing(cfg, a, log) if a.pack_tp else None
    base = results["gather-bcast"]["stall_s"]
    for s in results.values():
        s["vs_baseline"] = ratio(base, s["stall_s"])
    wall = time.perf_counter() - t_start
    print(f"{'mode':>13} {'trainer ms':>10} {'rollout ms':>10} {'all ms':>9} {'s/step':>7} {'vs baseline':>11}")
    for mode, s in results.items():
        print(
            f"{mode:>13} {s['trainer_stall_s'] * 1e3:>10.1f} {s['rollout_stall_s'] * 1e3:>10.1f} "
            f"{s['stall_s'] * 1e3:>9.1f} {s['step_wall_s']:>7.2f} {fmt_ratio(s['vs_baseline']):>11}"
        )
    print(f"wall time {wall:.0f}s")
    if a.json or a.plot:
        data = {
            "config": {**vars(a), "model_bytes": cfg.nbytes, "tp": TP, "dp": DP, "rollouts": ROLLOUTS},
            "machine": info,
            "modes": results,
            "packing": pack,
            "wall_s": wall,
        }
        path = write_json("stall.json", data, a.out)
        print(f"results: {os.path.relpath(path)}")
        if a.plot:
            from plots import plot_stall

            print(f"plot: {os.path.relpath(plot_stall(data, a.out))}")

    if pack is not None:
        print(
            f"stall_pack: pack_vs_plain={pack['pack_vs_plain']:.2f} plain_ms={pack['plain_ms']:.1f} "
            f"packed_ms={pack['packed_ms']:.1f} rollout_tp={a.pack_tp} cells={pack['cells']}"
        )

    def r(mode: str) -> str:
        return fmt_ratio(results[mode]["vs_baseline"]) if mode in results else "n/a"

    print(
        f"stall: async_vs_baseline={r('async')} one_step_off_vs_baseline={r('one_step_off')} "
        f"sync_vs_baseline={r('sync')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
