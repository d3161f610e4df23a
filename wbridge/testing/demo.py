"""``wbridge demo``: 4 trainer processes (TP=2 x DP=2) publish a synthetic transformer, 2 rollout
processes (TP=2, fused qkv and gate_up) pull every version and check it bit-exactly."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
import traceback
from dataclasses import asdict, dataclass

from transports._util import free_port  # noqa: F401 (re-exported for callers)

from .synthetic import ModelConfig, make_tensors, mismatches, set_version, total_bytes

TOKEN = "wbridge-demo-token"
CHANNEL = "demo"


@dataclass(frozen=True)
class DemoConfig:
    versions: int = 3
    model: ModelConfig = ModelConfig.demo()
    trainer_tp: int = 2
    trainer_dp: int = 2
    rollout_tp: int = 2
    transport: str = "auto"
    mode: str = "one_step_off"
    fault: str | None = None  # "flip-bit": corrupt one read on rollout 0 (proves the check)
    timeout: float = 120.0


def _trainer(cfg: DemoConfig, rank: int, url: str, results: mp.Queue, done: mp.Event) -> None:
    from ..publisher import Publisher

    try:
        tp_rank = rank % cfg.trainer_tp
        tensors = make_tensors(cfg.model, cfg.trainer_tp, tp_rank, fused=False, version=None)
        world = cfg.trainer_tp * cfg.trainer_dp
        with Publisher(
            CHANNEL,
            url,
            rank=rank,
            world_size=world,
            host_store=(rank == 0),
            token=TOKEN,
            mode=cfg.mode,
            transport=_served(cfg.transport),
        ) as pub:
            pub.register(tensors)
            results.put(("ready", rank, None))
            deadline = time.monotonic() + cfg.timeout
            while pub.live_subscribers() < cfg.rollout_tp:  # so every rollout sees every version
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"trainer rank {rank}: rollouts did not join within {cfg.timeout}s (live: {pub.subscribers()})"
                    )
                time.sleep(0.05)
            for v in range(1, cfg.versions + 1):
                set_version(tensors, v)  # a fake training step
                got = pub.publish(timeout=cfg.timeout)
                if got != v:
                    raise RuntimeError(f"trainer rank {rank}: published version {got}, expected {v}")
                s = pub.stats.last
                results.put(("publish", rank, {"version": v, "stall_s": s.stall_s, "wait_s": s.wait_s}))
            pub.wait_acked(cfg.versions, timeout=cfg.timeout)
            results.put(("trainer-done", rank, None))
            done.wait(cfg.timeout)  # rank 0 hosts the store: stay until all finished
    except BaseException:  # noqa: BLE001 - report to the parent, which exits non-zero
        results.put(("error", f"trainer {rank}", traceback.format_exc()))


def _served(transport: str):
    return "auto" if transport == "auto" else [transport]


def _rollout(cfg: DemoConfig, idx: int, url: str, results: mp.Queue) -> None:
    from ..subscriber import Subscriber
    from .faults import FlipBit, inject

    try:
        tensors = make_tensors(cfg.model, cfg.rollout_tp, idx, fused=True, version=None, fill_value=0xFF)
        with Subscriber(CHANNEL, url, token=TOKEN, transport=cfg.transport, name=f"rollout-{idx}") as sub:
            if cfg.fault == "flip-bit" and idx == 0:
                inject(sub, FlipBit)
            sub.register(tensors)
            v = 0
            while v < cfg.versions:
                v = sub.pull(min_version=v + 1, timeout=cfg.timeout)
                st = sub.stats.last
                t0 = time.perf_counter()
                bad = mismatches(tensors, v)
                check_s = time.perf_counter() - t0
                results.put(
                    (
                        "pull",
                        idx,
                        {
                            "version": v,
                            "bytes": st.nbytes if st else 0,
                            "pull_s": st.seconds if st else 0.0,
                            "gbps": st.gbps if st else 0.0,
                            "bad": bad,
                            "check_s": check_s,
                            "transport": sorted({n for n, _ in sub.stats.transports.values()}),
                            "total": total_bytes(tensors),
                        },
                    )
                )
    except BaseException:  # noqa: BLE001
        results.put(("error", f"rollout {idx}", traceback.format_exc()))


def _bar(done: int, total: int, width: int = 30) -> str:
    n = int(width * done / max(total, 1))
    return "[" + "#" * n + "." * (width - n) + f"] {done}/{total}"


def run(cfg: DemoConfig, *, out=sys.stdout, err=sys.stderr, as_json: bool = False) -> int:
    ctx = mp.get_context("forkserver")  # torch and wbridge are imported once, not per process
    ctx.set_forkserver_preload(
        ["torch", "numpy", "wbridge.publisher", "wbridge.subscriber", "wbridge.testing.synthetic"]
    )
    url = f"tcp://127.0.0.1:{free_port()}"
    results: mp.Queue = ctx.Queue()
    done = ctx.Event()
    world = cfg.trainer_tp * cfg.trainer_dp
    print(
        f"wbridge demo: {cfg.model.nbytes / 2**20:.0f} MiB model, {world} trainers "
        f"(TP={cfg.trainer_tp} x DP={cfg.trainer_dp}), {cfg.rollout_tp} rollouts (TP={cfg.rollout_tp}, "
        f"fused qkv/gate_up), store {url}, {cfg.versions} versions",
        file=err,
    )
    procs = [ctx.Process(target=_trainer, args=(cfg, r, url, results, done), name=f"trainer-{r}") for r in range(world)]
    procs[0].start()
    time.sleep(0.5)  # rank 0 hosts the store; the others retry connecting anyway
    for p in procs[1:]:
        p.start()
    rollouts = [
        ctx.Process(target=_rollout, args=(cfg, i, url, results), name=f"rollout-{i}") for i in range(cfg.rollout_tp)
    ]
    for p in rollouts:
        p.start()
    pulls, publishes, errors = [], [], []
    pending_rollouts = {i: 0 for i in range(cfg.rollout_tp)}
    trainers_done = 0
    deadline = time.monotonic() + cfg.timeout * (cfg.versions + 1)
    total_steps = cfg.versions * cfg.rollout_tp
    try:
        while time.monotonic() < deadline:
            if errors:
                break
            if trainers_done == world and all(v >= cfg.versions for v in pending_rollouts.values()):
                break
            try:
                kind, who, payload = results.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty: check for dead children
                dead = [p.name for p in procs + rollouts if p.exitcode not in (None, 0)]
                if dead:
                    errors.append((",".join(dead), "exited abnormally"))
                continue
            if kind == "error":
                errors.append((who, payload))
            elif kind == "publish":
                publishes.append((who, payload))
            elif kind == "trainer-done":
                trainers_done += 1
            elif kind == "pull":
                pulls.append((who, payload))
                pending_rollouts[who] = payload["version"]
                print("\r" + _bar(len(pulls), total_steps) + " pulls", end="", file=err, flush=True)
        else:
            errors.append(("demo", f"timed out after {cfg.timeout * (cfg.versions + 1):.0f}s"))
    finally:
        print("", file=err)
        done.set()
        for p in rollouts + procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(5)
    bad = [(who, p["version"], p["bad"]) for who, p in pulls if p["bad"]]
    stalls: dict[int, list[float]] = {}
    for _, p in publishes:
        stalls.setdefault(p["version"], []).append(p["stall_s"])
    rows = []
    for who, p in sorted(pulls, key=lambda x: (x[1]["version"], x[0])):
        rows.append(
            {
                "version": p["version"],
                "rollout": who,
                "bytes": p["bytes"],
                "pull_s": p["pull_s"],
                "gbps": p["gbps"],
                "stall_s": max(stalls.get(p["version"], [0.0])),
                "transport": "+".join(p["transport"]),
                "exact": not p["bad"],
            }
        )
    if as_json:
        json.dump({"config": asdict(cfg), "rows": rows, "errors": [list(e) for e in errors]}, out, default=str)
        out.write("\n")
    else:
        print(
            f"{'version':>7} {'rollout':>7} {'MiB':>8} {'pull s':>8} {'GB/s':>6} {'stall s':>8} "
            f"{'transport':>10} {'bit-exact':>9}",
            file=out,
        )
        for r in rows:
            print(
                f"{r['version']:>7} {r['rollout']:>7} {r['bytes'] / 2**20:>8.1f} {r['pull_s']:>8.3f} "
                f"{r['gbps']:>6.2f} {r['stall_s']:>8.3f} {r['transport']:>10} "
                f"{'yes' if r['exact'] else 'NO':>9}",
                file=out,
            )
    for who, msg in errors:
        print(f"error in {who}:\n{msg}", file=err)
    for who, v, names in bad:
        print(f"rollout {who}: version {v} is NOT bit-exact in {len(names)} tensors, e.g. {names[:3]}", file=err)
    ok = not errors and not bad and rows
    print("demo: OK, every pull bit-exact" if ok else "demo: FAILED", file=err)
    return 0 if ok else 1
