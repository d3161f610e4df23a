"""``examples/sglang_async_rl.py`` end to end: 2 FSDP2 trainer processes (fp32 masters, AdamW,
bf16 published, async mode) and 2 SGLang engines (CPU) that pull and commit on their own."""

from __future__ import annotations

import json
import os

import pytest

from .venvs import NO_SGLANG, PAUSE, SGLANG_PY, run_example, sglang_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.skipif(not os.path.exists(SGLANG_PY), reason=NO_SGLANG),
]


@pytest.mark.timeout(900)
def test_sglang_async_rl_example(tmp_path):
    run_example(SGLANG_PY, "sglang_async_rl.py", ["--steps", 3, "--interval", 2, *PAUSE], tmp_path, 840, sglang_env())
    r = json.loads((tmp_path / "result.json").read_text())
    print(json.dumps(r, indent=1))
    assert r["published"] == [1, 2, 3, 4]
    assert r["match"], r  # greedy tokens equal a fresh engine's on the trainers' final bf16 weights
    for ro in r["rollouts"]:
        assert ro["final"] == 4
        assert ro["completions"] > 0
        assert len(ro["versions_seen"]) >= 2, ro  # completions came from several versions as they rolled in
        assert set(ro["versions_seen"]) <= {"default", "1", "2", "3", "4"}
