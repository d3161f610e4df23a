"""LoRA RL with plain vLLM: trainers publish a LoRA adapter, two vLLM engines serve its newest version.

    PYTHONPATH=. .venv-vllm/bin/python examples/lora_async_rl.py --check    # after the quick start

The base model is frozen and never published: a tiny Qwen2 (random, built from a config) that
every process loads from its checkpoint. Two trainer processes hold it as FSDP2 shards over gloo
with a PEFT LoRA adapter (rank 8 on q/k/v/o and the MLP projections), take AdamW steps on random
tokens and publish the adapter alone (``from_peft``: its A/B shards, its config as the channel's
metadata) on the channel ``policy-lora``. Two engine processes run vLLM ``AsyncLLM`` CPU engines
with ``enable_lora=True``; ``AsyncVLLMLoRAUpdater`` has each engine's workers pull every new version
in the background, build the adapter from the pulled tensors and install it between two engine
steps: no adapter file is written, and each update reads the adapter's bytes only (128 KiB, 9% of
this tiny model; real models' adapters are well under 1%). Every completion is tagged with the
adapter version that produced it.
``--check``: after the last update each engine's greedy tokens and logprobs with the adapter equal
those of the same engine loading the final adapter from a PEFT checkpoint the trainers write at
the end. ``--out DIR`` writes ``result.json``. The lines that are wbridge's are marked ``# wbridge``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING")

from _rl import command_line, run_procs, write_result  # noqa: E402  # examples/_rl.py: what the examples share

from wbridge import Async, Publisher, Staging  # noqa: E402  # wbridge
from wbridge.integrations.lora import from_peft  # noqa: E402  # wbridge
from wbridge.integrations.vllm import EXTENSION, AsyncVLLMLoRAUpdater  # noqa: E402  # wbridge (imports no vLLM)

PROMPTS = [[11, 42, 7, 99, 3, 58, 21, 5], [17, 3, 250, 9]]
TIMEOUT = 300.0
CHANNEL = "policy-lora"


def trainer(rank: int, args: argparse.Namespace, where: tuple[str, str], token: str, started, results, done) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wbridge.testing.lora import Trainer, full_adapter, peft_model

    dist.init_process_group("gloo", init_method=where[1], rank=rank, world_size=2)
    model = peft_model(args.base, seed=0)  # the frozen base from its checkpoint, a rank-8 adapter
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # adapter (and base) parameters are now DTensor row shards
    step = Trainer(model, lr=args.lr, seed=1000 + rank)  # AdamW on the adapter
    lora = from_peft(model)  # wbridge: this rank's A/B shards, the adapter config as metadata
    pub = Publisher(CHANNEL, where[0], rank=rank, world_size=2, host_store=rank == 0,  # wbridge
                    token=token, mode=Async(max_staleness=2), staging=Staging())  # wbridge  # fmt: skip
    lora.register(pub)  # wbridge
    published = [pub.publish(timeout=TIMEOUT)]  # wbridge: v1, the initial adapter
    started.wait(TIMEOUT)  # both engines serve v1
    for _ in range(args.steps):
        t0 = time.monotonic()
        step.step()
        published.append(pub.publish(timeout=TIMEOUT))  # wbridge: the adapter's bytes only
        time.sleep(max(0.0, args.interval - (time.monotonic() - t0)))
    final = full_adapter(model)  # a collective: the whole adapter on every rank
    if rank == 0:  # the reference for --check: what PEFT's save_pretrained writes, written after the run
        from safetensors.torch import save_file

        os.makedirs(args.final, exist_ok=True)
        model.peft_config["default"].save_pretrained(args.final)
        save_file({k: v.contiguous() for k, v in final.items()}, os.path.join(args.final, "adapter_model.safetensors"))
    results.put(("trainer", rank, {"published": published, "adapter_bytes": lora.adapter.nbytes}))
    done.wait(TIMEOUT)  # rank 0 hosts the store: stay until the engines have left the channel
    pub.close()  # wbridge
    dist.destroy_process_group()


def engine(base: str):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=base, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
        max_model_len=128, max_num_seqs=4, seed=0, enable_lora=True, max_lora_rank=8, max_loras=2,
        max_cpu_loras=3, worker_extension_cls=EXTENSION,  # wbridge: two adapters for the channel, one for --check
    ))  # fmt: skip


async def greedy(llm, lora_request) -> list[dict]:
    """Greedy tokens and logprobs of ``PROMPTS`` with the adapter ``lora_request`` names."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=2)
    out = []
    for i, p in enumerate(PROMPTS):
        final = None
        async for item in llm.generate(
            {"prompt_token_ids": p}, sp, f"greedy-{i}-{time.monotonic_ns()}", lora_request=lora_request
        ):
            final = item
        c = final.outputs[0]
        out.append(
            {"tokens": list(c.token_ids), "logprobs": [{t: lp.logprob for t, lp in s.items()} for s in c.logprobs]}
        )
    return out


async def serve(i: int, args: argparse.Namespace, store: str, token: str, started, stop, last) -> dict:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    llm = engine(args.base)
    lora = AsyncVLLMLoRAUpdater(llm, CHANNEL, store, token=token, timeout=TIMEOUT)  # wbridge
    await lora.start()  # wbridge: subscribes the workers and installs the first version
    await asyncio.to_thread(started.wait, TIMEOUT)
    completions: list = []

    async def stream(k: int) -> None:
        n = 0
        while not stop.is_set():
            sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, detokenize=False, seed=n)
            async for v, out in lora.generate({"prompt_token_ids": PROMPTS[k]}, sp):  # wbridge: tagged outputs
                if out.finished:
                    completions.append((v, len(out.outputs[0].token_ids)))
            n += 1
            await asyncio.sleep(args.pause)

    await asyncio.gather(stream(0), stream(1))
    await lora.update(min_version=last.value)  # wbridge: the last version installed
    result = {"completions": completions, "version": lora.version, "stats": await lora.stats()}  # wbridge
    result["greedy"] = await greedy(llm, lora.lora_request)  # wbridge: the newest version's LoRARequest
    await lora.close()  # wbridge: leaves the channel, drops its adapters
    if args.check:  # the same engine, the final adapter loaded by vLLM from the PEFT checkpoint
        await asyncio.to_thread(wait_path, os.path.join(args.final, "adapter_model.safetensors"))
        result["reference"] = await greedy(llm, LoRARequest("final-from-disk", 1, args.final))
    llm.shutdown()
    return result


def wait_path(path: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def rollout(i: int, args: argparse.Namespace, store: str, token: str, started, stop, last, results) -> None:
    results.put(("rollout", i, asyncio.run(serve(i, args, store, token, started, stop, last))))


def main() -> None:
    check_help = "compare with the final adapter loaded from disk"
    args = command_line(__doc__, steps=6, interval=1.0, lr=2e-2, lr_help="AdamW on the adapter", check_help=check_help)
    with tempfile.TemporaryDirectory(prefix="wbridge-lora-") as tmp:
        args.base, args.final = os.path.join(tmp, "base"), os.path.join(tmp, "final-adapter")
        run(args)


def run(args: argparse.Namespace) -> None:
    from wbridge.testing.hf import make_qwen2  # a random checkpoint: no model hub here

    make_qwen2(args.base)
    trained, rollouts = run_procs(trainer, rollout, args, TIMEOUT, train_timeout=2 * TIMEOUT)
    for i, r in enumerate(rollouts):
        versions = sorted({v for v, _ in r["completions"]})
        nbytes = sorted({s["nbytes"] for s in r["stats"]})
        print(f"engine {i}: {len(r['completions'])} completions on adapter versions {versions}, now v{r['version']}, "
              f"{len(r['stats'])} installs reading {nbytes} bytes each, "
              f"max install {max(s['install_s'] for s in r['stats']) * 1e3:.2f} ms")  # fmt: skip
    print(f"trainers: published {trained['published']}; adapter {trained['adapter_bytes']} bytes")
    out = {"published": trained["published"], "adapter_bytes": trained["adapter_bytes"], "rollouts": rollouts}
    if args.check:
        ok = all(r["greedy"] == r["reference"] for r in rollouts)
        print(f"the final adapter loaded from disk: greedy tokens and logprobs {'match' if ok else 'MISMATCH'}")
        out["exact"] = ok
    write_result(args.out, out)


if __name__ == "__main__":
    main()
