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

from lora_roles import CHANNELS, REFUSED, TOKEN
from vllm_lora_roles import PROMPTS, VERSIONS, _wait_file

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
        _wait_file(os.path.join(out, "registered"))
        res["refused"] = {}
        for ch in REFUSED:
            try:
                SGLangLoRAUpdater(eng, ch, store, token=TOKEN, timeout=30.0, transport="tcp")
                res["refused"][ch] = "accepted"
            except Exception as e:  # noqa: BLE001 - the message is what the test checks
                res["refused"][ch] = f"{type(e).__name__}: {e}"
        open(os.path.join(out, "want_1"), "w").close()
        updaters = [SGLangLoRAUpdater(eng, ch, store, token=TOKEN, timeout=120.0, transport="tcp") for ch in CHANNELS]
        res["tmpdir_before"] = sorted(os.listdir(os.environ["TMPDIR"]))

        def hook(event, args):
            if event == "open" and args[1] is not None and any(c in str(args[1]) for c in "wax+"):
                writes.append(str(args[0]))
            elif event in ("os.mkdir", "os.rename", "shutil.copyfile"):
                writes.append(f"{event}:{args[0]}")

        sys.addaudithook(hook)
        for v in range(1, VERSIONS + 1):
            if v > 1:
                open(os.path.join(out, f"want_{v}"), "w").close()
            writes.clear()  # (the cue above is the test's)
            _wait_file(os.path.join(out, f"published_{v}"))
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
        res["tmpdir"] = sorted(os.listdir(os.environ["TMPDIR"]))
        res["stats"] = {ch: u.stats() for ch, u in zip(CHANNELS, updaters)}
        res["nbytes"] = {ch: u.adapter.nbytes for ch, u in zip(CHANNELS, updaters)}
        res["loaded"] = {ch: list(u.loaded) for ch, u in zip(CHANNELS, updaters)}
        for u in updaters:
            u.close()
        res["closed"] = [repr(u) for u in updaters]
    finally:
        open(os.path.join(out, "stop"), "w").close()
        with open(os.path.join(out, "engine.json"), "w") as f:
            json.dump(res, f)
        eng.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        engine(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown role {sys.argv[1]}")
