"""LoRA adapter channels on a real SGLang engine (0.5.23, CPU, enable_lora): one engine serves two
adapter channels that a PEFT trainer process updates three times, through ``SGLangLoRAUpdater``
(SGLang's in-memory ``load_lora_adapter_from_tensors``).

After each update, for each adapter: greedy tokens and logprobs equal those of the same engine
loading that version from the trainer's PEFT checkpoint on disk, exactly; the two adapters stay
apart; outputs are tagged with the version. Nothing in the updater's process opened a file for
writing during the updates and the engine's TMPDIR gains nothing; each update read the adapter's
bytes; at most two versions of an adapter stay loaded. Adapters the engine cannot serve are refused
with the module named. One engine start serves all of it.
"""

from __future__ import annotations

import json
import re

import pytest

from .test_sglang_engine import ROOT, SGLANG_PY, STUBS, os
from .test_vllm_lora import HERE, _trainer, free_port, run_engine_and_trainer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.timeout(600),  # the first test runs the module's engine
    pytest.mark.skipif(
        not os.path.exists(SGLANG_PY), reason=f"no SGLang venv at {SGLANG_PY} (scripts/setup.sh makes it)"
    ),
]


def _engine(base, out, port, tmpdir, log):
    import subprocess

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, STUBS, HERE]),
        SGLANG_USE_CPU_ENGINE="1",
        OMP_NUM_THREADS="1",
        TMPDIR=str(tmpdir),
    )
    cmd = [SGLANG_PY, os.path.join(HERE, "sglang_lora_roles.py"), "engine", str(base), str(out), str(port)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from wbridge.testing.hf import make_qwen2

    tmp = tmp_path_factory.mktemp("sglang_lora")
    base, out, tmpdir = tmp / "base", tmp / "out", tmp / "engine_tmp"
    out.mkdir()
    tmpdir.mkdir()
    make_qwen2(str(base))
    port = free_port()
    logs = {n: str(tmp / f"{n}.log") for n in ("trainer", "engine")}
    with open(logs["trainer"], "w") as ft, open(logs["engine"], "w") as fe:
        trainer = _trainer(base, out, port, ft)
        run_engine_and_trainer(_engine(base, out, port, tmpdir, fe), trainer, out, logs)
    return json.load(open(out / "engine.json"))


def test_each_version_equals_the_adapter_loaded_from_disk(run):
    steps = run["steps"]
    assert [s["version"] for s in steps] == [1, 2, 3]
    for s in steps:
        v = s["version"]
        for name in "ab":
            mem, disk = s["mem"][name], s["disk"][name]
            assert [o["tokens"] for o in mem] == [o["tokens"] for o in disk], (v, name)
            assert [o["logprobs"] for o in mem] == [o["logprobs"] for o in disk], (v, name)
            assert [o["top"] for o in mem] == [o["top"] for o in disk], (v, name)
            assert s["tags"][name] == v and s["paths"][name] == f"lora-{name}@v{v}", (s["tags"], s["paths"])
    for name in "ab":
        tokens = [[o["tokens"] for o in s["mem"][name]] for s in steps]
        assert tokens[0] != tokens[1] != tokens[2], tokens
        assert tokens[0] != [o["tokens"] for o in run["base"]]


def test_two_adapters_stay_apart(run):
    for s in run["steps"]:
        a, b = ([o["tokens"] for o in s["mem"][n]] for n in "ab")
        assert a != b, s["version"]


def test_no_file_written_per_update_and_bytes_read_are_the_adapters(run):
    assert all(s["writes"] == [] for s in run["steps"]), [s["writes"] for s in run["steps"]]
    assert run["tmpdir"] == run["tmpdir_before"], "a file in TMPDIR appeared during the updates"
    for ch, stats in run["stats"].items():
        assert [s["version"] for s in stats] == [1, 2, 3], stats
        assert all(s["nbytes"] == run["nbytes"][ch] for s in stats), (ch, stats)
    assert run["loaded"] == {"lora-a": [2, 3], "lora-b": [2, 3]}, run["loaded"]
    assert all("closed" in r for r in run["closed"])


def test_adapters_the_engine_cannot_serve_are_refused_naming_the_module(run):
    refused = run["refused"]
    print(f"\nrefused: {json.dumps(refused, indent=1)}")
    assert refused["lora-r16"].startswith("UsageError: ") and "max_lora_rank 8" in refused["lora-r16"]
    assert re.search(r"module model\.layers\.0\.\S+ has LoRA rank 16", refused["lora-r16"]), refused["lora-r16"]
    assert refused["lora-head"].startswith("UsageError: ") and "module lm_head" in refused["lora-head"]
    assert "does not fit this base model" in refused["lora-wide"], refused["lora-wide"]
