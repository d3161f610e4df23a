"""The LoRA trainer process of the LoRA tests (run with a python that has peft; the repo on
PYTHONPATH), and the engine side of its cues (``subscribe``, ``versions``, ``close``; stdlib only:
the engine roles import them in the engines' venvs).

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
from collections.abc import Callable, Iterator

from cues import cue, wait_file, wanted

TOKEN = "lora-test-token"
CHANNELS = ("lora-a", "lora-b")
REFUSED = {"lora-r16": "rank", "lora-head": "lm_head", "lora-wide": "base"}
VERSIONS = 3  # the versions an engine asks for
PROMPTS = [[11, 42, 7, 99, 3, 58, 21, 5], [17, 3, 250, 9]]  # the engines' greedy prompts
WAIT = 240.0  # an engine's wait for a cue of the trainer (s)


def subscribe(out: str, updater: Callable[[str, float], object]) -> tuple[dict[str, str], list]:
    """An engine's start, once the trainer's channels are up: ``updater(channel, timeout)`` for each
    adapter of ``REFUSED`` (the error it raised, or ``"accepted"``), then, having asked for version
    1, for each of ``CHANNELS``. Returns the errors and the updaters of ``CHANNELS``."""
    wait_file(os.path.join(out, "registered"), WAIT, poll=0.02)
    refused = {}
    for ch in REFUSED:
        try:
            updater(ch, 30.0)
            refused[ch] = "accepted"
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            refused[ch] = f"{type(e).__name__}: {e}"
    cue(out, "want_1")
    return refused, [updater(ch, 120.0) for ch in CHANNELS]


def versions(out: str, asked: Callable[[], None] = lambda: None) -> Iterator[int]:
    """An engine's rounds: yields v = 1..VERSIONS once the trainer published v, having asked for it
    (``want_<v>``; ``subscribe`` asked for 1) and then called ``asked()``."""
    for v in range(1, VERSIONS + 1):
        if v > 1:
            cue(out, f"want_{v}")
        asked()
        wait_file(os.path.join(out, f"published_{v}"), WAIT, poll=0.02)
        yield v


def close(res: dict, updaters: list, nbytes: Callable[[object], int]) -> None:
    """An engine's end: records in ``res`` what TMPDIR holds, each channel's update stats and
    adapter bytes (``nbytes(updater)``), then closes the updaters and records their reprs."""
    res["tmpdir"] = sorted(os.listdir(os.environ["TMPDIR"]))
    res["stats"] = {ch: u.stats() for ch, u in zip(CHANNELS, updaters)}
    res["nbytes"] = {ch: nbytes(u) for ch, u in zip(CHANNELS, updaters)}
    for u in updaters:
        u.close()
    res["closed"] = [repr(u) for u in updaters]


def write_hook(writes: list) -> Callable:
    """An audit hook (``sys.addaudithook``) that appends to ``writes`` each path opened for writing
    and each directory made, file renamed or copied."""

    def hook(event, args):
        if event == "open" and args[1] is not None and any(c in str(args[1]) for c in "wax+"):
            writes.append(str(args[0]))
        elif event in ("os.mkdir", "os.rename", "shutil.copyfile"):
            writes.append(f"{event}:{args[0]}")

    return hook


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
        cue(out, "registered")
        for v in wanted(out, poll=0.02):
            for name, m, t, pub in zip("ab", models, trainers, pubs):
                t.step()
                m.save_pretrained(os.path.join(out, name, f"v{v}"))
                v_pub = pub.publish(timeout=120)
            cue(out, f"published_{v_pub}")
            print(f"trainer: published {v_pub} of {CHANNELS} ({len(TARGETS)} targets)", flush=True)
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
