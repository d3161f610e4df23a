"""Asynchronous RL on Ray with wbridge: FSDP2 trainer actors publish, vLLM rollout actors keep up.

    PYTHONPATH=. .venv-vllm/bin/python examples/ray_async_rl.py           # after the quick start

A local Ray cluster of two emulated nodes (``ray.cluster_utils.Cluster``, CPU only); each node runs
one trainer actor and one rollout actor. The two trainers hold a tiny Qwen2 (random init, fp32
masters) as FSDP2 row shards over gloo, take AdamW steps on random tokens and publish each step
as bf16 (``async``, ``max_staleness=1``). The rollout actors run vLLM CPU engines (bf16) that
generate continuously; every completion carries the weight version that produced it.

``--kill-rollout``: the driver kills rollout 1 (``ray.kill``) while an update is in flight and
tells the channel at once (``ch.evict``), so the trainers never wait for the dead rollout (its
lease, ``--lease-ttl``, would otherwise hold them up to that long); Ray restarts it
(``max_restarts``), and it rejoins and pulls the newest version while the trainers go on.
``--check`` then compares each rollout's greedy tokens with a fresh engine loaded from a checkpoint
of the trainers' final weights. ``--out DIR`` writes the results as ``result.json``.
The lines that are wbridge's are marked ``# wbridge``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING")
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")  # one process per engine (memory)

import ray  # noqa: E402

from wbridge import Async  # noqa: E402  # wbridge
from wbridge.integrations.ray import EXTENSION, VLLMRollout, close_channel, host_channel  # noqa: E402  # wbridge

PROMPT = [11, 42, 7, 99, 3, 58, 21, 5]


def engine(path: str):
    from vllm import LLM

    return LLM(
        model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
        max_model_len=128, max_num_seqs=4, seed=0, enable_prefix_caching=False,
        distributed_executor_backend="uni", worker_extension_cls=EXTENSION,
    )  # fmt: skip


def greedy(llm) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids)


class Trainer:
    def __init__(self, ch, rank: int, world: int, ckpt: str, rendezvous: str) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import Qwen2ForCausalLM

        from wbridge.integrations.dtensor import from_module  # wbridge

        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        self.rank, self.model = rank, Qwen2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)  # parameters are now DTensor row shards (fp32 masters)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.pub = ch.publisher(rank, world, mode=Async(max_staleness=1))  # wbridge
        self.pub.register(from_module(self.model), dtype=torch.bfloat16)  # wbridge: fp32 shards -> bf16
        self.published = [(self.pub.publish(timeout=120.0), time.time(), 0.0)]  # wbridge: v1, the initial weights

    def train(self, steps: int, interval: float) -> list:
        import torch

        gen = torch.Generator().manual_seed(1000 + self.rank)
        for _ in range(steps):
            t0 = time.monotonic()
            ids = torch.randint(2, 256, (2, 16), generator=gen)
            self.model(input_ids=ids, labels=ids).loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            t1 = time.perf_counter()
            v = self.pub.publish(timeout=120.0)  # wbridge: waits only for live rollouts > 1 version behind
            self.published.append((v, time.time(), time.perf_counter() - t1))
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
        return self.published

    def save(self, path: str) -> None:
        """The full (unsharded) weights as a checkpoint vLLM can load (a collective over the trainers)."""
        from safetensors.torch import save_file

        sd = {k: v.full_tensor().contiguous() for k, v in self.model.state_dict().items()}
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            self.model.config.save_pretrained(path)
            save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    def close(self) -> None:
        import torch.distributed as dist

        self.pub.close()  # wbridge
        dist.destroy_process_group()


class Rollout:
    """Generates continuously from construction on (a restarted actor does the same)."""

    def __init__(self, ch, ckpt: str, lease_ttl: float) -> None:
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.started = time.time()
        self.llm = engine(ckpt)
        self.rollout = VLLMRollout(self.llm, ch, lease_ttl=lease_ttl)  # wbridge: subscribe, pull the newest
        self.first = (self.rollout.version, time.time(), greedy(self.llm))
        self.completions: list[tuple[int, int]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": PROMPT[: 4 + i]} for i in range(2)]
        while not self.stopping.is_set():
            for v, out in self.rollout.generate(prompts, sp):  # wbridge: each completion with its version
                self.completions.append((v, len(out.outputs[0].token_ids)))

    def status(self) -> dict:
        r = self.rollout
        return {"version": r.version, "pulling": r.pulling, "restarted": self.restarted, "n": len(self.completions)}

    def finish(self, version: int) -> dict:
        """Stops generating, takes ``version`` (waiting for it), returns what happened."""
        self.stopping.set()
        self.thread.join(60.0)
        deadline = time.monotonic() + 60.0
        while self.rollout.update(wait=True) != version and time.monotonic() < deadline:
            time.sleep(0.1)
        return {
            "restarted": self.restarted, "started": self.started, "first": self.first,
            "completions": self.completions, "version": self.rollout.version, "greedy": greedy(self.llm),
            "verified": self.rollout.verify(),  # wbridge: the engine runs on that version, bit for bit
        }  # fmt: skip

    def close(self) -> None:
        self.rollout.close()  # wbridge


def wait_up(actor, timeout: float = 300.0) -> dict:
    """The actor's status once it answers (Ray refuses calls while it restarts)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(actor.status.remote(), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def kill_mid_update(ch, actor, at_version: int, timeout: float = 120.0) -> tuple[float, int]:
    """Kills ``actor`` (Ray restarts it) once it holds ``at_version`` or later and an update is in
    flight: the trainers committed a version its engine does not run yet (its workers pull or have
    staged it). Tells the channel at once. Returns when it was killed and how many subscribers that
    evicted."""
    deadline = time.monotonic() + timeout
    with ch.subscriber() as watch:  # wbridge: never registered, it only reads the newest version
        while True:
            newest = watch.latest()  # wbridge: first the newest committed, then what the rollout holds
            s = ray.get(actor.status.remote(), timeout=timeout)
            if s["version"] >= at_version and (s["pulling"] or (newest or 0) > s["version"]):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no update in flight past version {at_version} within {timeout}s: {s}")
            time.sleep(0.02)
    ray.kill(actor, no_restart=False)
    t = time.time()
    return t, ch.evict(actor)  # wbridge: it is dead, stop waiting for it now (not after its lease)


def start_cluster():
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=2, object_store_memory=200 * 2**20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, resources={"node0": 2}, include_dashboard=False))
    cluster.add_node(**node, resources={"node1": 2})
    ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    return cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds per trainer step (at least)")
    ap.add_argument("--kill-rollout", action="store_true", help="kill rollout 1 mid-update; Ray restarts it")
    ap.add_argument("--lease-ttl", type=float, default=30.0, help="the rollouts' subscriber lease (s)")
    ap.add_argument("--check", action="store_true", help="compare greedy tokens with a fresh engine")
    ap.add_argument("--out", default=None, help="write result.json here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="wbridge-ray-") as tmp:
        run(args, args.out or tmp)


def run(args: argparse.Namespace, work: str) -> None:
    from wbridge.testing.hf import make_qwen2  # a random checkpoint: no model hub here

    ckpt, final = os.path.join(work, "initial"), os.path.join(work, "final")
    make_qwen2(ckpt)
    cluster = start_cluster()
    trainers, rollouts, ch = [], [], None
    try:
        ch = host_channel("policy")  # wbridge: the store, in an actor of its own
        # the trainers' gloo rendezvous: a file (all nodes are this machine), no port to race for
        gloo = f"file://{os.path.join(tempfile.mkdtemp(prefix='gloo-', dir=work), 'rendezvous')}"
        on = lambda i: {"resources": {f"node{i}": 1}}  # one trainer and one rollout per node
        trainers = [ray.remote(Trainer).options(num_cpus=1, **on(r)).remote(ch, r, 2, ckpt, gloo) for r in range(2)]
        ray.get([t.__ray_ready__.remote() for t in trainers])
        rollouts = [
            ray.remote(Rollout)
            .options(num_cpus=1, max_restarts=1, max_concurrency=4, **on(i))
            .remote(ch, ckpt, args.lease_ttl)
            for i in range(2)
        ]
        ray.get([r.status.remote() for r in rollouts])  # engines up, first version pulled
        training = [t.train.remote(args.steps, args.interval) for t in trainers]
        killed, evicted = kill_mid_update(ch, rollouts[1], 3) if args.kill_rollout else (None, 0)
        published = ray.get(training)[0]
        last = published[-1][0]
        if args.check:
            ray.get([t.save.remote(final) for t in trainers])
        for r in rollouts:
            wait_up(r)  # a restarted rollout may still be starting its engine
        results = ray.get([r.finish.remote(last) for r in rollouts], timeout=300)
        ray.get([r.close.remote() for r in rollouts] + [t.close.remote() for t in trainers])
        for r in rollouts:
            ray.kill(r, no_restart=True)  # frees the engines' memory before the reference engine
        rollouts = []
        for i, res in enumerate(results):
            versions = sorted({v for v, _ in res["completions"]})
            print(f"rollout {i}: {len(res['completions'])} completions on versions {versions}, "
                  f"restarted={res['restarted']}, now v{res['version']} (verified: {res['verified']['ok']}), "
                  f"greedy {res['greedy']}")  # fmt: skip
        print(f"trainers: published v1..v{last}, longest publish wait {max(p[2] for p in published):.2f}s")
        out = {"published": published, "rollouts": results, "last": last, "killed": killed, "evicted": evicted}
        if args.check:
            out["reference"] = greedy(engine(final))
            ok = all(r["greedy"] == out["reference"] for r in results)
            print(f"reference engine from the final checkpoint: {out['reference']}: {'match' if ok else 'MISMATCH'}")
        if args.out:
            with open(os.path.join(args.out, "result.json"), "w") as f:
                json.dump(out, f)
    finally:
        for a in rollouts + trainers:
            ray.kill(a, no_restart=True)
        if ch is not None:
            close_channel(ch)  # wbridge
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
