"""Asynchronous RL with SGLang rollouts: FSDP2 trainers publish, SGLang engines keep up.

    PYTHONPATH=.:tests/sglang_stubs SGLANG_USE_CPU_ENGINE=1 .venv-sglang/bin/python examples/sglang_async_rl.py

(``tests/sglang_stubs`` stands in for SGLang's CUDA-only kernel package on a CPU-only machine; a GPU
deployment drops it and the CPU engine flags.) Two trainer processes hold a tiny Qwen2 (random
init, fp32 masters) as FSDP2 row shards over gloo, take AdamW steps on random tokens and publish
each step as bf16 (``mode=Async(1)``: a trainer waits only for a rollout more than one version
behind). Two SGLang engines (bf16) generate continuously; each subscribed at start in its
scheduler process, pulls every new version in the background and commits it between two
scheduler steps, so every completion carries the weight version that produced it
(``meta_info["weight_version"]``).

``--check`` then compares each engine's greedy tokens with a fresh engine loaded from a checkpoint
of the trainers' final bf16 weights. ``--out DIR`` writes the results as ``result.json``.
The lines that are wbridge's are marked ``# wbridge``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time

from _rl import free_port, next_result  # examples/_rl.py: what the examples share

CHANNEL, TOKEN = "policy", "example-token"
PROMPT = [11, 42, 7, 99, 3, 58, 21, 5]


def trainer(rank: int, world: int, ckpt: str, store: str, rendezvous: str, args: dict, go, done, results) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2ForCausalLM

    from wbridge import Async, Publisher  # wbridge
    from wbridge.integrations.dtensor import from_module  # wbridge

    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    model = Qwen2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # parameters are now DTensor row shards (fp32 masters)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pub = Publisher(  # wbridge: rank 0 hosts the channel's store
        CHANNEL, store, rank=rank, world_size=world, host_store=rank == 0, token=TOKEN, mode=Async(1)
    )
    pub.register(from_module(model), dtype=torch.bfloat16)  # wbridge: fp32 shards -> bf16
    published = [(pub.publish(timeout=120.0), time.time())]  # wbridge: v1, the initial weights
    go.wait()  # the rollouts are up
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(args["steps"]):
        t0 = time.monotonic()
        ids = torch.randint(2, 256, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        published.append((pub.publish(timeout=120.0), time.time()))  # wbridge
        time.sleep(max(0.0, args["interval"] - (time.monotonic() - t0)))
    sd = {k: v.full_tensor().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if rank == 0:  # the final weights as the bf16 checkpoint a fresh engine loads (--check)
        from safetensors.torch import save_file

        final = os.path.join(args["work"], "final")
        os.makedirs(final, exist_ok=True)
        model.config.save_pretrained(final)
        save_file(sd, os.path.join(final, "model.safetensors"), metadata={"format": "pt"})
    results.put(("trainer", rank, published))
    done.wait()  # the store stays up until every rollout holds the final version
    pub.close()  # wbridge
    dist.destroy_process_group()


def engine(path: str, subscribe: bool, store: str = ""):
    import sglang as sgl

    from wbridge.integrations.sglang import SGLangOptions, engine_args  # wbridge
    from wbridge.testing.sglang import CPU_ENGINE_ARGS

    extra = {}
    if subscribe:  # wbridge: the engine's scheduler subscribes at start, pulls and commits by itself
        extra = engine_args(SGLangOptions(channel=CHANNEL, store=store, token=TOKEN, dtype="bfloat16"))
    return sgl.Engine(model_path=path, dtype="bfloat16", **CPU_ENGINE_ARGS, **extra)


def greedy(eng) -> list[int]:
    return eng.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0})["output_ids"]


def rollout(i: int, ckpt: str, store: str, pause: float, up, stop, final_version, results) -> None:
    from wbridge.integrations.sglang import server_stats, wait_version  # wbridge

    eng = engine(ckpt, True, store)
    up.put(i)
    seen = []  # (weight version, time) of each completion
    gen = 0
    while not stop.is_set():
        prompts = [[3 + (gen + k) % 200, 17, 29, 5] for k in range(2)]
        for out in eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 1.0}):
            seen.append((out["meta_info"]["weight_version"], time.time()))  # the version that produced it
        gen += 1
        stop.wait(pause)
    stats = wait_version(eng, final_version.value, timeout=120.0)  # wbridge
    results.put(("rollout", i, {"seen": seen, "tokens": greedy(eng), "stats": stats or server_stats(eng)}))
    eng.shutdown()


def reference_engine(path: str, results) -> None:
    """``--check``'s fresh engine, in a process of its own: an engine's shutdown kills every child
    of its process, and in the main one that includes multiprocessing's resource tracker (which
    then reports the main process's queues and events as leaked)."""
    eng = engine(path, False)
    results.put(("reference", 0, greedy(eng)))
    eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps (each one version)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds per training step")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds a rollout rests between batches (0: none)")
    ap.add_argument("--check", action="store_true", help="compare with a fresh engine on the final weights")
    ap.add_argument("--out", help="write result.json here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        result = run(args, work)
    print(json.dumps({k: v for k, v in result.items() if k != "rollouts"}, indent=1))
    for r in result["rollouts"]:
        print(f"rollout {r['index']}: versions seen {r['versions_seen']}, final {r['final']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    if args.check and not result["match"]:
        raise SystemExit("rollouts disagree with a fresh engine on the final weights")


def run(args: argparse.Namespace, work: str) -> dict:
    from wbridge.testing.hf import make_qwen2

    ckpt = os.path.join(work, "ckpt")
    make_qwen2(ckpt)
    # each process forks from one that imported torch, wbridge and SGLang once (a spawned one
    # imports them itself)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "wbridge", "sglang", "sglang.srt.entrypoints.engine"])
    go, done, stop = ctx.Event(), ctx.Event(), ctx.Event()
    up, results = ctx.Queue(), ctx.Queue()
    final_version = ctx.Value("i", 0)
    store, rendezvous = f"tcp://127.0.0.1:{free_port()}", f"file://{os.path.join(work, 'gloo')}"
    targs = {"steps": args.steps, "interval": args.interval, "work": work}
    procs = [
        ctx.Process(target=trainer, args=(r, 2, ckpt, store, rendezvous, targs, go, done, results), name=f"trainer {r}")
        for r in range(2)
    ]
    rargs = (ckpt, store, args.pause, up, stop, final_version, results)
    procs += [ctx.Process(target=rollout, args=(i, *rargs), name=f"rollout {i}") for i in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in range(2):
            next_result(up, procs, 300)
        t0 = time.time()
        go.set()
        got = {}
        for _ in range(2):
            kind, idx, value = next_result(results, procs, 300 + args.steps * args.interval)
            got[(kind, idx)] = value
        train_s = time.time() - t0
        final_version.value = got[("trainer", 0)][-1][0]
        stop.set()
        for _ in range(2):
            kind, idx, value = next_result(results, procs, 300)
            got[(kind, idx)] = value
        done.set()
        for p in procs:
            p.join(60)
        reference = None
        if args.check:
            final = os.path.join(work, "final")
            procs.append(ctx.Process(target=reference_engine, args=(final, results), name="reference engine"))
            procs[-1].start()
            reference = next_result(results, procs, 300)[2]
            procs[-1].join(60)
    finally:
        done.set()
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
    rollouts = []
    for i in range(2):
        r = got[("rollout", i)]
        versions = sorted({v for v, _ in r["seen"]}, key=lambda v: (v != "default", int(v) if v.isdigit() else 0))
        rollouts.append(
            {
                "index": i,
                "versions_seen": versions,
                "completions": len(r["seen"]),
                "final": r["stats"][0]["version"],
                "tokens": r["tokens"],
                "pause_s": [h["pause_s"] for h in r["stats"][0]["history"]],
                "pull_s": [h["pull_s"] for h in r["stats"][0]["history"]],
            }
        )
    return {
        "published": [v for v, _ in got[("trainer", 0)]],
        "train_s": train_s,
        "final_version": final_version.value,
        "reference_tokens": reference,
        "match": reference is not None and all(r["tokens"] == reference for r in rollouts),
        "rollouts": rollouts,
    }


if __name__ == "__main__":
    main()
