"""The SGLang engine of the LoRA test (run with the SGLang venv's python; the test puts the repo
and tests/sglang_stubs on PYTHONPATH and sets SGLANG_USE_CPU_ENGINE=1).

    python sglang_lora_roles.py engine BASE OUT PORT

One ``sgl.Engine`` (enable_lora) serves two adapter channels (``lora_roles.CHANNELS``) through
``SGLangLoRAUpdater``s; as ``vllm_lora_roles`` it records, for versions 1..3, the greedy tokens and
logprobs with each adapter and with the same version loaded from the trainer's PEFT checkpoint,
every file this process opened for writing during the updates, what TMPDIR holds, and the errors
of the adapters it must refuse. Results go to ``OUT/engine.json``.
"""

from __future__ import annotations

import json
import os
import sys

from cues import cue
from lora_roles import CHANNELS, PROMPTS, TOKEN, close, subscribe, versions, write_hook

MAX_TOKENS = 8


def _outputs(eng, lora_path):
    sp = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    outs = []
    for p in PROMPTS:
        o = eng.generate(input_ids=p, sampling_params=sp, lora_path=lora_path, return_logprob=True, top_logprobs_num=2)
        outs.append(_record(o))
    return outs


def _record(o) -> dict:
    meta = o["meta_info"]
    return {
        "tokens": list(o["output_ids"]),
        "logprobs": [[lp, t] for lp, t, _ in meta["output_token_logprobs"]],
        "top": [[[lp, t] for lp, t, _ in step] for step in meta["output_top_logprobs"]],
    }


def engine(base: str, out: str, port: int) -> None:
    import sglang as sgl

    from wbridge.integrations.sglang import SGLangLoRAUpdater
    from wbridge.testing.sglang import CPU_ENGINE_ARGS

    store = f"tcp://127.0.0.1:{port}"
    eng = sgl.Engine(
        model_path=base,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        max_loras_per_batch=4,
        lora_backend="torch_native",
        **CPU_ENGINE_ARGS,
    )
    res: dict = {"steps": []}
    writes: list = []
    try:
        res["base"] = _outputs(eng, None)
        res["refused"], updaters = subscribe(
            out, lambda ch, timeout: SGLangLoRAUpdater(eng, ch, store, token=TOKEN, timeout=timeout, transport="tcp")
        )
        res["tmpdir_before"] = sorted(os.listdir(os.environ["TMPDIR"]))
        sys.addaudithook(write_hook(writes))
        for v in versions(out, asked=writes.clear):  # (the cue is the test's)
            step: dict = {"version": v, "mem": {}, "disk": {}, "tags": {}, "paths": {}}
            for name, u in zip("ab", updaters):
                u.update(min_version=v)
                tag, _ = u.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2, "temperature": 0})
                step["tags"][name], step["paths"][name] = tag, u.lora_path
                step["mem"][name] = _outputs(eng, u.lora_path)
            step["writes"] = list(writes)
            for name in "ab":  # the same version loaded by SGLang from the PEFT checkpoint on disk
                disk = f"disk-{name}-v{v}"
                r = eng.load_lora_adapter(disk, os.path.join(out, name, f"v{v}"))
                assert r.success, r.error_message
                step["disk"][name] = _outputs(eng, disk)
                eng.unload_lora_adapter(disk)
            res["steps"].append(step)
        res["loaded"] = {ch: list(u.loaded) for ch, u in zip(CHANNELS, updaters)}
        close(res, updaters, lambda u: u.adapter.nbytes)
    finally:
        cue(out, "stop")
        with open(os.path.join(out, "engine.json"), "w") as f:
            json.dump(res, f)
        eng.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        engine(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown role {sys.argv[1]}")
