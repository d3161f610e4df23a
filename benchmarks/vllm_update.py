"""A vLLM engine serving requests while new weight versions arrive: how long generation pauses.

Run with the vLLM venv (made by ``scripts/setup.sh``)::

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/vllm_update.py [--versions 3] [--out DIR]

A trainer process (a transformers Qwen2 built from a config, random init, fp32, AdamW) publishes a
new version after each optimizer step. A vLLM CPU engine (``WeightTransferConfig(backend="wbridge")``)
generates continuously; for each version it calls ``start_weight_update``, then ``update_weights``
with ``background: true`` (returns at once: the pull, and the rebuild of the repacked linear layers'
GEMM kernels from the pulled tensors, run on a worker thread while generation goes on with the old
weights), keeps generating until that thread is done, and then ``finish_weight_update`` (the commit:
one fused copy for the parameters whose vLLM processing is the identity, a swap of the rebuilt
kernels; the only pause). Measured per version:

- ``pull_s``: the background thread's wall time (pull + kernel rebuild; both in the JSON);
- ``pause_s``: the ``finish_weight_update`` call as the caller sees it (no generation step runs
  meanwhile), which includes vLLM's RPC round trip to the worker (the worker's own commit time is
  ``commit_s`` in the JSON);
- tokens per second while the background thread runs, against tokens per second with no update at
  all, measured just before.

The last line is exactly::

    vllm_update: pull_s=<t> pause_s=<t> pause_vs_pull=<r> tokens_per_s_during_pull_vs_idle=<r>

(medians over the versions). Target: ``pause_vs_pull`` <= 0.3. The default model (8 layers, 1024
wide, GQA, about 100 M parameters, 0.4 GB in fp32) is big enough that the pull is not dominated by
per-version fixed costs (RPCs, the version handshake), small enough for a shared 2-core host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

CHANNEL, TOKEN = "vllm-update", "vllm-update-token"
PROMPTS = [[11 + i, 42, 7, 99, 3, 58, 21, 5] for i in range(4)]


def _config(hidden: int, layers: int):
    from wbridge.testing.hf import qwen2_config

    return qwen2_config(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=512,
    )


def _checkpoint(prefix: str, hidden: int, layers: int) -> tuple[str, str]:
    """A fresh temporary directory and, in it, the benchmark's random-init (seed 0) fp32 checkpoint
    of ``_config(hidden, layers)``: ``(directory, checkpoint path)``."""
    import torch
    from transformers import Qwen2ForCausalLM

    tmp = tempfile.mkdtemp(prefix=prefix)
    ckpt = os.path.join(tmp, "ckpt")
    torch.manual_seed(0)
    Qwen2ForCausalLM(_config(hidden, layers)).float().save_pretrained(ckpt, safe_serialization=True)
    return tmp, ckpt


class Trainer:
    """The trainer process: fp32 model, AdamW steps on random tokens, a publish after each (in
    ``dtype``, None: as trained) on ``channel`` with ``token``."""

    def __init__(self, ckpt: str, port: int, channel: str = CHANNEL, token: str = TOKEN, dtype=None) -> None:
        import torch
        from transformers import Qwen2ForCausalLM

        from wbridge import Async, Publisher
        from wbridge.integrations.dtensor import from_module

        self.model = Qwen2ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        url, mode = f"tcp://127.0.0.1:{port}", Async(max_staleness=10)
        self.pub = Publisher(channel, url, host_store=True, token=token, mode=mode, transport="tcp")
        self.pub.register(from_module(self.model), dtype=dtype)

    def step_and_publish(self) -> int:
        import torch

        ids = torch.randint(2, 4096, (2, 32))
        self.opt.zero_grad()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        return self.pub.publish(timeout=120.0)

    def close(self) -> None:
        self.pub.close()


def _generate(llm, n_tokens: int) -> int:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in out)


def _tokens_per_s(llm, seconds: float, until=None) -> float:
    """Generates in short batches for ``seconds`` (or until ``until()``); returns tokens/s."""
    n, t0 = 0, time.perf_counter()
    while True:
        n += _generate(llm, 8)
        el = time.perf_counter() - t0
        if (until is not None and until()) or (until is None and el >= seconds) or el > 120:
            return n / el


def _with_plugin(argv: list[str] | None) -> None:
    """vLLM's worker processes register the ``wbridge`` backend through wbridge's
    ``vllm.general_plugins`` entry point; from a source tree (no installed wbridge) re-run this
    script once with a distribution declaring it on ``PYTHONPATH``."""
    from importlib.metadata import entry_points

    if any(ep.name == "wbridge" for ep in entry_points(group="vllm.general_plugins")):
        return
    from wbridge.testing.vllm_plugin import plugin_dist

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plugin = plugin_dist(tempfile.mkdtemp(prefix="wbridge-vllm-plugin-"), os.path.join(root, "pyproject.toml"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (plugin, os.environ.get("PYTHONPATH")) if p))
    args = sys.argv[1:] if argv is None else argv
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *args], env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm_update", description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default=".", help="directory for vllm_update.json (default: the working directory)")
    a = ap.parse_args(argv)
    _with_plugin(argv)

    import multiprocessing as mp

    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from transports._util import free_port
    from wbridge.integrations.vllm import register
    from wbridge.testing.workers import Worker

    register()
    tmp, ckpt = _checkpoint("wbridge-vllm-update-", a.hidden, a.layers)
    port = free_port()
    trainer = Worker("trainer", Trainer, ckpt, port, timeout=300, context=mp.get_context("spawn"))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=ckpt, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=256, max_num_seqs=4, seed=0, enable_prefix_caching=False,
              weight_transfer_config=WeightTransferConfig(backend="wbridge"),
              worker_extension_cls="wbridge.integrations.vllm.WBridgeWorkerExtension")  # fmt: skip
    rows = []
    try:
        v = trainer.call("step_and_publish", call_timeout=300)
        llm.init_weight_transfer_engine(
            {
                "init_info": {
                    "channel": CHANNEL,
                    "store": f"tcp://127.0.0.1:{port}",
                    "token": TOKEN,
                    "transport": "tcp",
                    "cache_dir": os.path.join(tmp, "cache"),
                }
            }  # fmt: skip
        )
        plan = llm.collective_rpc("wbridge_commit_plan")[0]
        print(f"commit plan: {len(plan['direct'])} parameters copied, {len(plan['repack'])} layers repacked in the "
              f"background, {len(plan['reload'])} layers reloaded", file=sys.stderr)  # fmt: skip
        _generate(llm, 8)  # warm-up
        for k in range(a.versions + 1):  # the first round plans and connects: not counted
            idle = _tokens_per_s(llm, 3.0)
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": v, "timeout": 120.0, "background": True}})
            during = _tokens_per_s(llm, 0.0, until=lambda: llm.collective_rpc("wbridge_pull_done")[0])
            t0 = time.perf_counter()
            llm.finish_weight_update(weight_version=str(v))
            pause = time.perf_counter() - t0
            # the first batch on the new kernels (oneDNN primitives are cached by shape, so none
            # should be rebuilt): a slow one would be a pause hidden in the next generation step
            t0 = time.perf_counter()
            first = _generate(llm, 8) / (time.perf_counter() - t0)
            st = llm.collective_rpc("wbridge_stats")[0][-1]
            pull = st["pull_s"] + st["prepare_s"]  # the background thread's work
            if k:
                rows.append({"version": v, "pull_s": pull, "pause_s": pause, "idle_tps": idle, "during_tps": during,
                             "pull_only_s": st["pull_s"], "prepare_s": st["prepare_s"],
                             "commit_s": st["commit_s"], "first_batch_tps": first})  # fmt: skip
            print(f"version {v}: pull {st['pull_s']:.3f}s + prepare {st['prepare_s']:.3f}s, pause {pause:.3f}s "
                  f"(commit {st['commit_s']:.3f}s), tokens/s idle {idle:.0f} during {during:.0f} "
                  f"first batch after {first:.0f}",
                  file=sys.stderr)  # fmt: skip
            v = trainer.call("step_and_publish", call_timeout=300)
        llm.shutdown_weight_transfer_engine()
    finally:
        trainer.stop()
    keys = ("pull_s", "pause_s", "idle_tps", "during_tps", "pull_only_s", "prepare_s", "commit_s", "first_batch_tps")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "vllm_update.json"), "w") as f:
        json.dump({"rows": rows, "median": med, "hidden": a.hidden, "layers": a.layers, "plan": plan}, f, indent=1)
    print(
        f"vllm_update: pull_s={med['pull_s']:.3f} pause_s={med['pause_s']:.3f} "
        f"pause_vs_pull={med['pause_s'] / med['pull_s']:.2f} "
        f"tokens_per_s_during_pull_vs_idle={med['during_tps'] / med['idle_tps']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
