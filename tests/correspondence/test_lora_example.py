"""``examples/lora_async_rl.py`` end to end: two FSDP2 trainer ranks publish a rank-8 PEFT LoRA
adapter after each AdamW step; two vLLM ``AsyncLLM`` engines keep it installed with
``AsyncVLLMLoRAUpdater`` while they generate; afterwards each engine's greedy tokens and logprobs
with the adapter equal those of the same engine loading the final adapter from a PEFT checkpoint."""

from __future__ import annotations

import json
import os

import pytest

from .venvs import NO_VLLM, PAUSE, VLLM_PY, run_example


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=NO_VLLM)
@pytest.mark.timeout(600)
def test_lora_async_rl_example(tmp_path):
    run_example(VLLM_PY, "lora_async_rl.py", ["--steps", 4, "--interval", 1.0, *PAUSE], tmp_path, timeout=560)
    res = json.load(open(tmp_path / "result.json"))
    published, last = res["published"], res["published"][-1]
    print(f"\npublished {published}; adapter {res['adapter_bytes']} bytes; exact {res['exact']}")
    assert published == list(range(1, last + 1)) and last == 5
    for r in res["rollouts"]:
        versions = [v for v, _ in r["completions"]]
        print(f"engine: {len(versions)} completions on {sorted(set(versions))}; stats {r['stats']}")
        assert versions and all(type(v) is int and 1 <= v <= last for v in versions), "a version on every output"
        assert len(set(versions)) >= 2, "updates arrived while the engine generated"
        assert r["version"] == last
        assert [s["version"] for s in r["stats"]] == sorted({s["version"] for s in r["stats"]})
        assert r["stats"][-1]["version"] == last
        assert all(s["nbytes"] == res["adapter_bytes"] for s in r["stats"]), "each update reads the adapter"
        assert r["greedy"] == r["reference"], "the installed adapter = the same adapter loaded from disk"
    assert res["exact"] is True
