"""The LoRA trainer process of the LoRA tests (run with a python that has peft; the repo on
PYTHONPATH).

    python lora_roles.py trainer BASE OUT PORT     # hosts the store, publishes adapters on cue

It trains two PEFT adapters of the checkpoint at BASE (rank 8 on q/k/v/o and the MLP
projections, AdamW) on channels ``lora-a`` and ``lora-b`` of one store (tcp://127.0.0.1:PORT), and
registers three adapters an engine must refuse: ``lora-r16`` (rank 16), ``lora-head`` (LoRA on
``lm_head``), ``lora-wide`` (trained on a base of another hidden size). Files in OUT are the cues:
``want_<v>`` asks for version v of both adapters; the trainer takes a step on each, saves each
with PEFT's ``save_pretrained`` to ``OUT/<a|b>/v<v>`` (the engines' disk reference), publishes
both and writes ``published_<v>``; ``stop`` ends it. ``registered`` says every channel is up.
"""

from __future__ import annotations

import os
import sys
import time

TOKEN = "lora-test-token"
CHANNELS = ("lora-a", "lora-b")
REFUSED = {"lora-r16": "rank", "lora-head": "lm_head", "lora-wide": "base"}


def _publisher(channel: str, store: str, host: bool):
    from wbridge import Publisher, Staging

    return Publisher(channel, store, host_store=host, token=TOKEN, mode="one_step_off", staging=Staging())


def trainer(base: str, out: str, port: int) -> None:
    from wbridge.integrations.lora import from_peft
    from wbridge.testing.lora import TARGETS, Trainer, peft_model

    store = f"tcp://127.0.0.1:{port}"
    models = [peft_model(base, seed=1), peft_model(base, seed=2)]
    trainers = [Trainer(m, lr=2e-2, seed=i) for i, m in enumerate(models)]
    pubs = []
    try:
        for i, (ch, m) in enumerate(zip(CHANNELS, models)):
            pubs.append(_publisher(ch, store, host=i == 0))
            from_peft(m).register(pubs[-1])
        refused = {
            "lora-r16": peft_model(base, seed=3, r=16),
            "lora-head": peft_model(base, seed=4, targets=("q_proj", "lm_head")),
            "lora-wide": _wide_model(),
        }
        for ch, m in refused.items():
            pubs.append(_publisher(ch, store, host=False))
            from_peft(m).register(pubs[-1])
        open(os.path.join(out, "registered"), "w").close()
        v = 0
        while not os.path.exists(os.path.join(out, "stop")):
            if not os.path.exists(os.path.join(out, f"want_{v + 1}")):
                time.sleep(0.02)
                continue
            for name, m, t, pub in zip("ab", models, trainers, pubs):
                t.step()
                m.save_pretrained(os.path.join(out, name, f"v{v + 1}"))
                v_pub = pub.publish(timeout=120)
            v = v_pub
            open(os.path.join(out, f"published_{v}"), "w").close()
            print(f"trainer: published {v} of {CHANNELS} ({len(TARGETS)} targets)", flush=True)
    finally:
        for p in pubs:
            p.close()


def _wide_model():
    """A PEFT adapter of a Qwen2 with hidden size 160: it does not fit the 128-wide base."""
    import torch
    from peft import get_peft_model
    from transformers import Qwen2ForCausalLM

    from wbridge.testing.hf import qwen2_config
    from wbridge.testing.lora import lora_config

    torch.manual_seed(5)
    return get_peft_model(Qwen2ForCausalLM(qwen2_config(hidden_size=160)).float(), lora_config())


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown role {sys.argv[1]}")
