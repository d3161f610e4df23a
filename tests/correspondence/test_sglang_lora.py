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

import os
from functools import partial

import pytest

from .lora_run import adapters, check_apart, check_refused, check_tmpdir_and_bytes, check_versions, run_lora
from .test_sglang_engine import _spawn
from .venvs import HERE, NO_SGLANG, SGLANG_PY

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.timeout(600),  # the first test runs the module's engine
    pytest.mark.skipif(not os.path.exists(SGLANG_PY), reason=NO_SGLANG),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_lora(tmp_path_factory.mktemp("sglang_lora"), partial(_spawn, path=[HERE]), "sglang_lora_roles.py")


def test_each_version_equals_the_adapter_loaded_from_disk(run):
    check_versions(run)
    for v, name, s in adapters(run):
        mem, disk = s["mem"][name], s["disk"][name]
        assert [o["top"] for o in mem] == [o["top"] for o in disk], (v, name)
        assert s["tags"][name] == v and s["paths"][name] == f"lora-{name}@v{v}", (s["tags"], s["paths"])


def test_two_adapters_stay_apart(run):
    check_apart(run)


def test_no_file_written_per_update_and_bytes_read_are_the_adapters(run):
    assert all(s["writes"] == [] for s in run["steps"]), [s["writes"] for s in run["steps"]]
    check_tmpdir_and_bytes(run)
    assert run["loaded"] == {"lora-a": [2, 3], "lora-b": [2, 3]}, run["loaded"]


def test_adapters_the_engine_cannot_serve_are_refused_naming_the_module(run):
    refused = check_refused(run)
    assert refused["lora-head"].startswith("UsageError: ") and "module lm_head" in refused["lora-head"]
