"""``examples/sglang_async_rl.py`` end to end: 2 FSDP2 trainer processes (fp32 masters, AdamW,
bf16 published, async mode) and 2 SGLang engines (CPU) that pull and commit on their own."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from .test_sglang_engine import ROOT, SGLANG_PY, STUBS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.skipif(
        not os.path.exists(SGLANG_PY), reason=f"no SGLang venv at {SGLANG_PY} (scripts/setup.sh makes it)"
    ),
]


@pytest.mark.timeout(900)
def test_sglang_async_rl_example(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, STUBS]), SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1")
    cmd = [SGLANG_PY, os.path.join(ROOT, "examples", "sglang_async_rl.py"), "--steps", "3", "--interval", "2"]
    log = tmp_path / "example.log"
    with open(log, "w") as f:
        # a session of its own: a timeout kills the engines' scheduler children too
        p = subprocess.Popen([*cmd, "--check", "--out", str(tmp_path)], stdout=f, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)  # fmt: skip
        try:
            p.wait(timeout=840)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert p.returncode == 0, log.read_text(errors="replace")[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    print(json.dumps(r, indent=1))
    assert r["published"] == [1, 2, 3, 4]
    assert r["match"], r  # greedy tokens equal a fresh engine's on the trainers' final bf16 weights
    for ro in r["rollouts"]:
        assert ro["final"] == 4
        assert ro["completions"] > 0
        assert len(ro["versions_seen"]) >= 2, ro  # completions came from several versions as they rolled in
        assert set(ro["versions_seen"]) <= {"default", "1", "2", "3", "4"}
