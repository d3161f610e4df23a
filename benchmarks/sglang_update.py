"""An SGLang engine serving requests while new weight versions arrive: how long generation pauses.

Run with the SGLang venv (made by ``scripts/setup.sh``; on a CPU-only host with the test stand-ins)::

    PYTHONPATH=.:tests/sglang_stubs SGLANG_USE_CPU_ENGINE=1 .venv-sglang/bin/python benchmarks/sglang_update.py \
        [--versions 3] [--out DIR]

A trainer process (a transformers Qwen2 built from a config, random init, fp32 masters, AdamW)
publishes a bf16 version after each optimizer step. An SGLang CPU engine (bf16) subscribed through
``wbridge.integrations.sglang`` generates continuously; its scheduler's background thread pulls each
version into staging while generation goes on with the old weights, and the scheduler commits it
between two steps (no forward pass runs meanwhile: the only pause). ``--commit swap`` (default,
``SGLangOptions.commit``): the parameters are pointed at the staging tensors, and the pulling
thread copies staging back into their own memory afterwards; ``--commit copy``: one fused copy
into the live parameters. Measured per version, from the engine's own stats:

- ``pull_s``: the background pull's wall time (``Subscriber.pull``);
- ``pause_s``: the commit on the scheduler thread (with the weight-version record);
- tokens per second while the pull runs, against tokens per second with no update, just before.

The last line is exactly::

    sglang_update: pull_s=<s> pause_s=<s> pause_vs_pull=<r>

(medians over the versions). Target: ``pause_vs_pull`` <= 0.3. The default model (8 layers, 1024
wide, GQA, about 100 M parameters, 0.2 GB in bf16) is big enough that the pull is not dominated by
per-version fixed costs (the version handshake), small enough for a shared 2-core host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.vllm_update import Trainer as VllmTrainer
from benchmarks.vllm_update import _checkpoint

CHANNEL, TOKEN = "sglang-update", "sglang-update-token"
PROMPTS = [[11 + i, 42, 7, 99, 3, 58, 21, 5] for i in range(4)]


class Trainer(VllmTrainer):
    """The trainer process of ``vllm_update``: fp32 model, AdamW steps, a bf16 publish after each."""

    def __init__(self, ckpt: str, port: int) -> None:
        import torch

        super().__init__(ckpt, port, CHANNEL, TOKEN, dtype=torch.bfloat16)


async def _stats(eng) -> dict:
    states = await eng.tokenizer_manager.get_internal_state()
    return [s for st in states for s in (st.get("wbridge") or [])][0]


async def _serve_until(eng, version: int | None, seconds: float) -> float:
    """Generates in short batches until the engine holds ``version`` (or for ``seconds``);
    returns tokens/s."""
    n, t0 = 0, time.perf_counter()
    while True:
        outs = await eng.async_generate(
            input_ids=PROMPTS, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        )
        n += sum(len(o["output_ids"]) for o in outs)
        el = time.perf_counter() - t0
        if version is None and el >= seconds:
            return n / el
        if version is not None and ((await _stats(eng))["version"] or 0) >= version:
            return n / el
        if el > 300:
            raise TimeoutError(f"version {version} not committed within 300 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sglang_update", description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--commit", default="swap", choices=("swap", "copy"), help="SGLangOptions.commit")
    ap.add_argument("--out", default=".", help="directory for sglang_update.json (default: the working directory)")
    a = ap.parse_args(argv)

    import multiprocessing as mp

    import sglang as sgl

    from transports._util import free_port
    from wbridge.integrations.sglang import SGLangOptions, engine_args
    from wbridge.testing.sglang import CPU_ENGINE_ARGS
    from wbridge.testing.workers import Worker

    tmp, ckpt = _checkpoint("wbridge-sglang-update-", a.hidden, a.layers)
    port = free_port()
    trainer = Worker("trainer", Trainer, ckpt, port, timeout=300, context=mp.get_context("spawn"))
    opts = SGLangOptions(channel=CHANNEL, store=f"tcp://127.0.0.1:{port}", token=TOKEN, transport="tcp",
                         dtype="bfloat16", cache_dir=os.path.join(tmp, "cache"), commit=a.commit)  # fmt: skip
    eng = sgl.Engine(model_path=ckpt, dtype="bfloat16", **CPU_ENGINE_ARGS,
                     **engine_args(opts))  # fmt: skip
    run = eng.loop.run_until_complete
    rows = []
    try:
        for k in range(a.versions + 1):  # the first version plans and connects: not counted
            idle = run(_serve_until(eng, None, 3.0))
            v = trainer.call("step_and_publish", call_timeout=300)
            during = run(_serve_until(eng, v, 0.0))
            st = run(_stats(eng))
            rec = next(h for h in st["history"] if h["version"] == v)
            if k:
                rows.append({"version": v, "pull_s": rec["pull_s"], "pause_s": rec["pause_s"], "bytes": rec["bytes"],
                             "idle_tps": idle, "during_tps": during})  # fmt: skip
            print(f"version {v}: pull {rec['pull_s']:.3f}s ({rec['bytes'] / 1e6:.0f} MB), pause {rec['pause_s']:.4f}s, "
                  f"tokens/s idle {idle:.0f} until committed {during:.0f}", file=sys.stderr)  # fmt: skip
    finally:
        eng.shutdown()
        trainer.stop()
    keys = ("pull_s", "pause_s", "idle_tps", "during_tps")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sglang_update.json"), "w") as f:
        meta = {"hidden": a.hidden, "layers": a.layers, "commit": a.commit}
        json.dump({"rows": rows, "median": med, **meta}, f, indent=1)
    print(
        f"sglang_update: pull_s={med['pull_s']:.3f} pause_s={med['pause_s']:.4f} "
        f"pause_vs_pull={med['pause_s'] / med['pull_s']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
