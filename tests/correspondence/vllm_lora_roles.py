"""The vLLM engine of the LoRA test (run with the vLLM venv's python, the repo on PYTHONPATH).

    python vllm_lora_roles.py engine BASE OUT PORT

One ``LLM`` (enable_lora) serves two adapter channels (``lora_roles.CHANNELS``) through
``VLLMLoRAUpdater``s. For versions 1..3 it asks the trainer (``want_<v>``), installs both, and
records the greedy tokens and logprobs with each adapter, then with the same version loaded from
the trainer's PEFT checkpoint on disk; it records every file the worker process opened for writing
during the updates (an audit hook) and what TMPDIR holds; it subscribes to the adapters it must
refuse and records the errors, and checks the vLLM internals the install names. Results go to
``OUT/engine.json``.
"""

from __future__ import annotations

import json
import os
import sys

from cues import cue
from lora_roles import PROMPTS, TOKEN, close, subscribe, versions, write_hook
from vllm_roles import engine_args

MAX_TOKENS = 8


def _audit(worker) -> None:
    """Runs in the worker process: records every path opened for writing (and every directory
    made) from now on, in ``sys.wbridge_test_writes``."""
    import sys as _sys

    if hasattr(_sys, "wbridge_test_writes"):
        _sys.wbridge_test_writes.clear()
        return
    _sys.wbridge_test_writes = []
    _sys.addaudithook(write_hook(_sys.wbridge_test_writes))


def _writes(worker) -> list:
    import sys as _sys

    return list(getattr(_sys, "wbridge_test_writes", []))


def _outputs(llm, lora_request):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, lora_request=lora_request, use_tqdm=False)
    return [_record(o) for o in outs]


def _record(out) -> dict:
    c = out.outputs[0]
    return {
        "tokens": list(c.token_ids),
        "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs],
    }


def engine(base: str, out: str, port: int) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from wbridge.integrations.vllm import EXTENSION, VLLMLoRAUpdater

    store = f"tcp://127.0.0.1:{port}"
    llm = LLM(
        **engine_args(base),
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        max_cpu_loras=6,
        worker_extension_cls=EXTENSION,
    )
    res: dict = {"vllm": vllm.__version__, "steps": []}
    try:
        res["internals"] = llm.collective_rpc("wbridge_lora_internals")
        res["base"] = _outputs(llm, None)
        # the adapters this engine cannot serve are refused at subscribe, naming the module
        res["refused"], updaters = subscribe(
            out, lambda ch, timeout: VLLMLoRAUpdater(llm, ch, store, token=TOKEN, timeout=timeout, transport="tcp")
        )
        res["reprs"] = [repr(u) for u in updaters]
        llm.collective_rpc(_audit)
        res["tmpdir_before"] = sorted(os.listdir(os.environ["TMPDIR"]))  # vLLM's own, from its start
        for v in versions(out):
            step: dict = {"version": v, "mem": {}, "disk": {}, "tags": {}, "requests": {}}
            for name, u in zip("ab", updaters):
                u.update(min_version=v)
                step["tags"][name] = [tag for tag, _ in u.generate([{"prompt_token_ids": PROMPTS[0]}],
                                      SamplingParams(temperature=0.0, max_tokens=2, detokenize=False))]  # fmt: skip
                req = u.lora_request
                step["requests"][name] = [req.lora_name, req.lora_int_id, req.lora_path]
                step["mem"][name] = _outputs(llm, req)
            # the same versions loaded by vLLM from the trainer's PEFT checkpoints on disk
            for i, name in enumerate("ab"):
                disk = LoRARequest(f"disk-{name}-v{v}", 10 * v + i + 1, os.path.join(out, name, f"v{v}"))
                step["disk"][name] = _outputs(llm, disk)
            res["steps"].append(step)
        res["writes"] = llm.collective_rpc(_writes)
        close(res, updaters, lambda u: u.adapter and _nbytes(u.adapter))
    finally:
        cue(out, "stop")
        with open(os.path.join(out, "engine.json"), "w") as f:
            json.dump(res, f)


def _nbytes(meta: dict) -> int:
    from wbridge.integrations.lora import LoRAAdapter

    return LoRAAdapter.from_metadata(meta).nbytes


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        engine(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown role {sys.argv[1]}")
