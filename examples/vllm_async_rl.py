"""Asynchronous RL with plain vLLM (no Ray): trainer processes publish, vLLM engines keep up.

    PYTHONPATH=. .venv-vllm/bin/python examples/vllm_async_rl.py --check    # after the quick start

The plain-vLLM counterpart of ``examples/ray_async_rl.py``: two trainer processes hold a tiny Qwen2
(random init, fp32 masters) as FSDP2 row shards over gloo, take AdamW steps on random tokens and
publish each step as bf16 (``mode=Async(max_staleness=1)``, ``staging=Staging(delta=Delta())``); trainer rank 0 hosts
the store. Two engine processes run vLLM CPU engines (bf16) that only generate: ``VLLMUpdater``
has the engine's workers watch the channel and pull each new version while the engine generates,
commits it between two ``generate`` calls, and tags every completion with the version that
produced it. (``AsyncVLLMUpdater`` does the same for an ``AsyncLLM``, committing between steps.)
``--check`` compares each engine's greedy tokens after the last update with a fresh engine loaded
from a checkpoint of the trainers' final weights. ``--out DIR`` writes ``result.json``.
The lines that are wbridge's are marked ``# wbridge``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING")
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")  # one process per engine (memory)

from _rl import command_line, run_procs, write_result  # noqa: E402  # examples/_rl.py: what the examples share

from wbridge import Async, Delta, Publisher, Staging  # noqa: E402  # wbridge
from wbridge.integrations.dtensor import from_module  # noqa: E402  # wbridge
from wbridge.integrations.vllm import EXTENSION, VLLMUpdater  # noqa: E402  # wbridge (imports no vLLM)

PROMPT = [11, 42, 7, 99, 3, 58, 21, 5]
TIMEOUT = 300.0


def engine(path: str):
    from vllm import LLM

    return LLM(
        model=path, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
        max_model_len=128, max_num_seqs=4, seed=0, enable_prefix_caching=False,
        distributed_executor_backend="uni", worker_extension_cls=EXTENSION,  # wbridge
    )  # fmt: skip


def greedy(llm) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids)


def trainer(rank: int, args: argparse.Namespace, where: tuple[str, str], token: str, started, results, done) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2ForCausalLM

    dist.init_process_group("gloo", init_method=where[1], rank=rank, world_size=2)
    model = Qwen2ForCausalLM.from_pretrained(args.ckpt, torch_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # parameters are now DTensor row shards (fp32 masters)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    store = where[0]
    pub = Publisher("policy", store, rank=rank, world_size=2, host_store=rank == 0, token=token,  # wbridge
                    mode=Async(max_staleness=1), staging=Staging(delta=Delta()))  # wbridge  # fmt: skip
    pub.register(from_module(model), dtype=torch.bfloat16)  # wbridge: fp32 shards -> bf16
    published = [pub.publish(timeout=TIMEOUT)]  # wbridge: v1, the initial weights
    started.wait(TIMEOUT)  # both engines are up on v1
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(args.steps):
        t0 = time.monotonic()
        ids = torch.randint(2, 256, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        published.append(pub.publish(timeout=TIMEOUT))  # wbridge: waits only for engines > 1 version behind
        time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
    sd = {k: v.full_tensor().contiguous() for k, v in model.state_dict().items()}  # a collective
    if rank == 0:
        from safetensors.torch import save_file

        os.makedirs(args.final, exist_ok=True)
        model.config.save_pretrained(args.final)
        save_file(sd, os.path.join(args.final, "model.safetensors"), metadata={"format": "pt"})
    results.put(("trainer", rank, {"published": published}))
    done.wait(TIMEOUT)  # rank 0 hosts the store: stay until the engines have left the channel
    pub.close()  # wbridge
    dist.destroy_process_group()


def rollout(i: int, args: argparse.Namespace, store: str, token: str, started, stop, last, results) -> None:
    from vllm import SamplingParams

    llm = engine(args.ckpt)
    updater = VLLMUpdater(llm, "policy", store, token=token, timeout=TIMEOUT)  # wbridge
    started.wait(TIMEOUT)
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": PROMPT[: 4 + k]} for k in range(2)]
    completions = []
    while not stop.is_set():
        for v, out in updater.generate(prompts, sp):  # wbridge: each completion with its version
            completions.append((v, len(out.outputs[0].token_ids)))
        stop.wait(args.pause)
    updater.update(min_version=last.value)  # wbridge: waits until the kernels hold the last version
    stats = updater.stats()  # wbridge: per update: version, bytes, delta and why, pull/commit/pause seconds
    result = {"completions": completions, "version": updater.version, "greedy": greedy(llm), "stats": stats}
    updater.close()  # wbridge
    results.put(("rollout", i, result))


def main() -> None:
    lr_help = "AdamW; small steps leave most bf16 words as they were"
    check_help = "compare greedy tokens with a fresh engine"
    args = command_line(__doc__, steps=8, interval=1.5, lr=1e-4, lr_help=lr_help, check_help=check_help)
    with tempfile.TemporaryDirectory(prefix="wbridge-vllm-") as tmp:
        args.ckpt, args.final = os.path.join(tmp, "initial"), os.path.join(tmp, "final")
        run(args)


def run(args: argparse.Namespace) -> None:
    from wbridge.testing.hf import make_qwen2  # a random checkpoint: no model hub here

    make_qwen2(args.ckpt)
    trained, rollouts = run_procs(trainer, rollout, args, TIMEOUT, train_timeout=TIMEOUT)
    published = trained["published"]
    for i, r in enumerate(rollouts):
        versions = sorted({v for v, _ in r["completions"]})
        deltas = sum(s["delta"] for s in r["stats"])
        print(f"engine {i}: {len(r['completions'])} completions on versions {versions}, now v{r['version']}, "
              f"{len(r['stats'])} updates ({deltas} delta), greedy {r['greedy']}")  # fmt: skip
    print(f"trainers: published {published}")
    out = {"published": published, "rollouts": rollouts, "last": published[-1]}
    if args.check:
        out["reference"] = greedy(engine(args.final))
        ok = all(r["greedy"] == out["reference"] for r in rollouts)
        print(f"reference engine from the final checkpoint: {out['reference']}: {'match' if ok else 'MISMATCH'}")
    write_result(args.out, out)


if __name__ == "__main__":
    main()
