"""Processes of the ``AsyncVLLMUpdater`` test (run with the vLLM venv's python, the repo on PYTHONPATH).

    python vllm_updater_roles.py trainer CKPT_DIR OUT_DIR PORT   # publishes v1..v6 as the engine asks
    python vllm_updater_roles.py engine CKPT_DIR OUT_DIR PORT    # AsyncLLM + AsyncVLLMUpdater

The two talk through files in OUT_DIR. The trainer publishes v1 (the checkpoint's weights); on
``phase_a`` it publishes v2 (noise added) and the engine, which generates nothing then, must reach
it; on ``phase_b`` it publishes v3..v5 about a second apart while the engine generates, then v6 =
the checkpoint's weights again, and writes ``published``. The engine writes ``engine.json``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time

from cues import wait_file
from vllm_roles import CHANNEL, MAX_TOKENS, PROMPT, TOKEN, engine_args

TIMEOUT = 240.0
# Between a stream's requests in phase B. Back to back, three streams kept the engine's processes
# so busy that the trainer, runnable, waited on the run queue for most of a minute per publish
# (its main thread's /proc schedstat: 2.8 s run, 56 s waiting): phase B took 50-180 s instead of
# 5, 240 CPU-seconds in all, and in a full run it starved the tests beside it (313 s).
PACE_S = 0.05


def trainer(ckpt: str, out: str, port: int) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    from wbridge import Async, Delta, Publisher, Staging
    from wbridge.integrations.dtensor import from_module

    model = Qwen2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(7)

    def perturb() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)

    published = []
    store = f"tcp://127.0.0.1:{port}"
    with Publisher(
        CHANNEL,
        store,
        rank=0,
        world_size=1,
        host_store=True,
        token=TOKEN,
        mode=Async(max_staleness=2),
        staging=Staging(delta=Delta()),
    ) as pub:
        pub.register(from_module(model))
        published.append(pub.publish(timeout=TIMEOUT))  # v1: the checkpoint
        wait_file(os.path.join(out, "phase_a"), TIMEOUT)
        perturb()
        published.append(pub.publish(timeout=TIMEOUT))  # v2, while the engine generates nothing
        wait_file(os.path.join(out, "phase_b"), TIMEOUT)
        for _ in range(3):  # v3..v5 while the engine generates
            time.sleep(1.0)
            perturb()
            published.append(pub.publish(timeout=TIMEOUT))
        time.sleep(1.0)
        with torch.no_grad():
            model.load_state_dict(initial)  # in place: the registered tensors take the values
        published.append(pub.publish(timeout=TIMEOUT))  # v6: the checkpoint again
        with open(os.path.join(out, "published"), "w") as f:
            json.dump(published, f)
        wait_file(os.path.join(out, "engine_done"), 2 * TIMEOUT)  # rank 0 hosts the store


async def _greedy(generate) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    final = None
    async for item in generate({"prompt_token_ids": PROMPT}, sp):
        final = item
    return final


async def _params(engine) -> dict[str, str]:
    (params,) = await engine.collective_rpc("wbridge_parameters")
    return {k: hashlib.sha256(raw).hexdigest() for k, (_, _, raw) in params.items()}


async def engine_main(ckpt: str, out: str, port: int) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from wbridge.integrations.vllm import EXTENSION, AsyncVLLMUpdater

    args = AsyncEngineArgs(
        **engine_args(ckpt),
        enable_prefix_caching=True,  # so each commit drops the cache (requests in flight recompute)
        worker_extension_cls=EXTENSION,
    )
    engine = AsyncLLM.from_engine_args(args)
    res: dict = {}
    try:
        fresh = await _greedy(lambda p, sp: engine.generate(p, sp, "fresh"))
        res["fresh"] = list(fresh.outputs[0].token_ids)
        res["fresh_params"] = await _params(engine)
        updater = AsyncVLLMUpdater(
            engine,
            CHANNEL,
            f"tcp://127.0.0.1:{port}",
            token=TOKEN,
            timeout=TIMEOUT,
            transport="tcp",
            cache_dir=os.path.join(out, "cache"),
        )
        # two first requests at once: each starts the updater, both wait for the first version
        first = await asyncio.gather(_greedy(updater.generate), _greedy(updater.generate))
        res["first_tags"] = [v for v, _ in first]
        async with updater:  # started already: a no-op
            res["start_version"] = updater.version
            v, o = first[0]
            res["v1"] = {"tag": v, "tokens": list(o.outputs[0].token_ids)}
            (res["v1_staging"],) = await engine.collective_rpc("wbridge_digests")

            # Phase A: nothing generates; the watchers pull v2 and the task commits it.
            open(os.path.join(out, "phase_a"), "w").close()
            t0, deadline = time.monotonic(), time.monotonic() + TIMEOUT
            while updater.version != 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            res["phase_a"] = {"version": updater.version, "seconds": time.monotonic() - t0}
            v, o = await _greedy(updater.generate)
            res["v2"] = {"tag": v, "tokens": list(o.outputs[0].token_ids)}

            # Phase B: three streams of sampled requests while v3..v6 arrive.
            open(os.path.join(out, "phase_b"), "w").close()
            stop = asyncio.Event()

            async def stream(i: int) -> list:
                got, n = [], 0
                while not stop.is_set():
                    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, detokenize=False, seed=n)
                    prompt = {"prompt_token_ids": PROMPT[: 3 + i + n % 4]}
                    async for tag, out_ in updater.generate(prompt, sp, f"s{i}-{n}"):
                        if out_.finished:
                            c = out_.outputs[0]
                            spans = [(s.version, s.start, s.end) for s in c.weight_versions or ()]
                            got.append({"tag": tag, "n": len(c.token_ids), "spans": spans})
                    n += 1
                    await asyncio.sleep(PACE_S)  # the engine idles a little: the trainer gets CPU
                return got

            tasks = [asyncio.create_task(stream(i)) for i in range(3)]
            path = os.path.join(out, "published")
            while not os.path.exists(path) and time.monotonic() < deadline + TIMEOUT:
                await asyncio.sleep(0.05)
            published = json.load(open(path))
            res["updated_to"] = await updater.update(min_version=published[-1])
            stop.set()
            res["streams"] = await asyncio.gather(*tasks)
            v, o = await _greedy(updater.generate)
            res["final"] = {"tag": v, "tokens": list(o.outputs[0].token_ids)}
            res["final_params"] = await _params(engine)
            (res["final_staging"],) = await engine.collective_rpc("wbridge_digests")
            res["stats"] = await updater.stats()
            res["repr"] = repr(updater)
            res["label"] = await engine.get_weight_version()
        res["closed_repr"] = repr(updater)
        await updater.close()  # idempotent
        res["published"] = published
    finally:
        with open(os.path.join(out, "engine.json"), "w") as f:
            json.dump(res, f)
        open(os.path.join(out, "engine_done"), "w").close()
        engine.shutdown()


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "trainer":
        trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif role == "engine":
        asyncio.run(engine_main(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    else:
        raise SystemExit(f"unknown role {role}")
