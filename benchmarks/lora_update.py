"""A LoRA adapter update, trainer to vLLM engine: how many bytes move and how soon the new version
generates.

Run with the vLLM venv (made by ``scripts/setup.sh``)::

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/lora_update.py [--updates 10] [--out DIR]

The trainer (this process) holds the tiny Qwen2 of ``wbridge.testing.hf`` (random, from a config)
with a PEFT LoRA adapter (rank 8 on q/k/v/o and the MLP projections) and publishes only the adapter
(``from_peft``; the frozen base is loaded by the engine from its checkpoint). A vLLM CPU ``LLM``
(``enable_lora``; its engine core, where the worker pulls, is a process of its own) is kept on the
newest adapter by ``VLLMLoRAUpdater``. Per update: an AdamW step, ``publish()``; from the moment
``publish()`` returns, the engine's worker (blocked on the channel) pulls the adapter, builds vLLM's
adapter from the pulled tensors, the updater installs it between two steps and a request on the new
version generates its first token. Measured per update, medians over ``--updates``:

- ``pull_s``: the worker's pull of the adapter; ``install_s``: the install between two steps;
- ``publish_to_first_token_ms``: ``publish()`` returning to the first token generated on that
  version (``update(min_version=v)`` then a one-token request), in this process's clock.

``adapter_bytes`` is the adapter's size and ``model_bytes`` the base model's; every update must read
exactly ``adapter_bytes``. ``exact=yes`` when every update read exactly that, the engine's pulled
tensors equal the trainer's (SHA-256), and after the last update the greedy tokens and logprobs
with the installed adapter equal those of the same engine loading that version from a PEFT
checkpoint (``save_pretrained``, written after the run). The last line is exactly::

    lora_update: adapter_bytes=<n> model_bytes=<n> pull_s=<s> install_s=<s> publish_to_first_token_ms=<ms> exact=yes|no

Target: ``publish_to_first_token_ms`` <= 50 with the tiny model on a 2-core CPU host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

CHANNEL, TOKEN = "lora-update", "lora-update-token"
PROMPT = [11, 42, 7, 99, 3, 58, 21, 5]


def _digest(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _greedy(llm, lora_request) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=2)
    c = llm.generate([{"prompt_token_ids": PROMPT}], sp, lora_request=lora_request, use_tqdm=False)[0].outputs[0]
    return {"tokens": list(c.token_ids), "logprobs": [{t: lp.logprob for t, lp in s.items()} for s in c.logprobs]}


def run(updates: int, tmp: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from wbridge import Publisher
    from wbridge.integrations.lora import from_peft
    from wbridge.integrations.vllm import EXTENSION, VLLMLoRAUpdater
    from wbridge.testing.hf import make_qwen2
    from wbridge.testing.lora import Trainer, full_adapter, peft_model

    base = os.path.join(tmp, "base")
    make_qwen2(base)
    model = peft_model(base, seed=0)
    trainer = Trainer(model, lr=1e-2)
    lora = from_peft(model)
    model_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    pub = Publisher(CHANNEL, "tcp://127.0.0.1:0", host_store=True, token=TOKEN)  # one_step_off: returns at commit
    lora.register(pub)
    pub.publish(timeout=60)  # v1
    llm = LLM(
        model=base, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
        max_model_len=128, max_num_seqs=4, seed=0, enable_lora=True, max_lora_rank=8, max_loras=2,
        max_cpu_loras=3, worker_extension_cls=EXTENSION,
    )  # fmt: skip
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    rows = []
    with VLLMLoRAUpdater(llm, CHANNEL, pub.store_url, token=TOKEN, timeout=60.0, poll=0.0005, transport="tcp") as up:
        llm.generate([{"prompt_token_ids": PROMPT}], one, lora_request=up.lora_request, use_tqdm=False)  # warm
        for _ in range(updates):
            trainer.step()
            v = pub.publish(timeout=60)
            t0 = time.perf_counter()
            up.update(min_version=v)
            ((tag, _out),) = up.generate([{"prompt_token_ids": PROMPT}], one)
            rows.append({"version": v, "tag": tag, "publish_to_first_token_ms": (time.perf_counter() - t0) * 1e3})
        stats = {s["version"]: s for s in up.stats()}
        (pulled,) = llm.collective_rpc("wbridge_lora_digests", args=(CHANNEL,))
        after = _greedy(llm, up.lora_request)
        trained = {k: _digest(t) for k, t in full_adapter(model).items()}
    model.save_pretrained(os.path.join(tmp, "adapter"))  # the disk reference, after the run
    disk = _greedy(llm, LoRARequest("from-disk", 1, os.path.join(tmp, "adapter")))
    llm.llm_engine.engine_core.shutdown()  # before the store (this process hosts it) goes
    pub.close()
    for r in rows:
        r.update({k: stats[r["version"]][k] for k in ("nbytes", "pull_s", "build_s", "install_s", "delta")})
    read_ok = all(r["nbytes"] == lora.adapter.nbytes and r["tag"] == r["version"] for r in rows)
    return {
        "adapter_bytes": lora.adapter.nbytes,
        "model_bytes": model_bytes,
        "rows": rows,
        "bytes_ok": read_ok,
        "tensors_ok": pulled == trained,
        "disk_ok": after == disk,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--out", default=None, help="write lora_update.json here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="wbridge-lora-bench-") as tmp:
        res = run(args.updates, tmp)
    rows = res["rows"]
    for r in rows:
        print(f"v{r['version']}: read {r['nbytes']} B, pull {r['pull_s'] * 1e3:.2f} ms, "
              f"build {r['build_s'] * 1e3:.2f} ms, install {r['install_s'] * 1e3:.2f} ms, "
              f"publish to first token {r['publish_to_first_token_ms']:.1f} ms")  # fmt: skip
    print(f"bytes read per update = adapter bytes: {res['bytes_ok']}; pulled tensors = trainer's: "
          f"{res['tensors_ok']}; greedy tokens and logprobs = the PEFT checkpoint's: {res['disk_ok']}")  # fmt: skip
    med = {k: statistics.median(r[k] for r in rows) for k in ("pull_s", "install_s", "publish_to_first_token_ms")}
    exact = res["bytes_ok"] and res["tensors_ok"] and res["disk_ok"]
    if args.out:
        with open(os.path.join(args.out, "lora_update.json"), "w") as f:
            json.dump({**res, "median": med, "exact": exact}, f, indent=1)
    print(
        f"lora_update: adapter_bytes={res['adapter_bytes']} model_bytes={res['model_bytes']} "
        f"pull_s={med['pull_s']:.4f} install_s={med['install_s']:.4f} "
        f"publish_to_first_token_ms={med['publish_to_first_token_ms']:.1f} exact={'yes' if exact else 'no'}"
    )


if __name__ == "__main__":
    main()
