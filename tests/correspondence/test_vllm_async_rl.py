"""Plain vLLM end to end (no Ray): ``examples/vllm_async_rl.py`` with two trainer processes
(FSDP2 fp32 masters publishing bf16, ``async``, ``delta=True``) and two vLLM CPU engines kept up to
date by ``VLLMUpdater`` while they generate. Its log stays quiet: the trainer steps are longer than
the engines' 5 s store waits for the next version, so each engine's wait times out idle between
versions (torch's own timed wait logged ``[c10d] waitForInput`` there), and no resource-tracker
report follows the exit (``tests.logs``)."""

from __future__ import annotations

import json
import os

import pytest

from tests.logs import noise

from .venvs import NO_VLLM, PAUSE, VLLM_PY, run_example


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=NO_VLLM)
@pytest.mark.timeout(600)
def test_vllm_async_rl_example(tmp_path):
    # 7 s steps: above the watcher's 5 s wait slice (wbridge.integrations.follow), so idle waits time out
    args = ["--steps", 2, "--interval", 7, *PAUSE]
    log = run_example(VLLM_PY, "vllm_async_rl.py", args, tmp_path, timeout=560)
    assert not noise(log), "\n".join(noise(log)[:10])
    res = json.load(open(tmp_path / "result.json"))
    last, published = res["last"], res["published"]
    for i, r in enumerate(res["rollouts"]):
        st, seen = r["stats"], sorted({v for v, _ in r["completions"]})
        print(f"\nengine {i}: {len(r['completions'])} completions on versions {seen}, "
              f"{len(st)} updates, delta {[s['delta'] for s in st]}, bytes {[s['nbytes'] for s in st]}, "
              f"max commit {max(s['commit_s'] for s in st) * 1e3:.2f} ms; greedy {r['greedy']}")  # fmt: skip
    print(f"published {published}; reference {res['reference']}")
    assert published == list(range(1, last + 1))
    for r in res["rollouts"]:
        versions = [v for v, _ in r["completions"]]
        assert versions and all(type(v) is int and 1 <= v <= last for v in versions), "a version on every completion"
        assert versions == sorted(versions), "an engine's versions never go back"
        assert r["version"] == last
        assert r["greedy"] == res["reference"], "after the last update: a fresh engine's greedy tokens"
        stats = r["stats"]
        assert [s["version"] for s in stats] == sorted({s["version"] for s in stats}) and stats[-1]["version"] == last
        assert all(s["nbytes"] > 0 and s["commit_s"] >= 0 and s["pull_s"] > 0 for s in stats)
        assert any(s["delta"] for s in stats[1:]), "with delta=True later updates read deltas"
