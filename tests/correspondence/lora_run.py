"""What the LoRA engine tests (``test_vllm_lora``, ``test_sglang_lora``) share: one run of the
trainer process (``lora_roles.py``) against an engine process that writes ``OUT/engine.json``, and
the checks both engines' results pass (each test module adds its engine's own)."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator

from .helpers import free_port
from .test_vllm_engine import _wait
from .venvs import HERE, ROOT, spawn


def run_lora(tmp, spawn_role: Callable, script: str, **env: str) -> dict:
    """Runs the trainer and the ``engine`` role of ``script`` (``spawn_role``: the engine venv's
    ``_spawn``; ``env``: more variables) on a tiny Qwen2 made in ``tmp``; returns the engine's
    results. The engine's TMPDIR is a folder of its own (its children inherit it), empty, which must
    stay so. The engine gets 500 s; then the trainer is stopped (it exits once ``OUT/stop`` exists,
    which the engine writes when it is done, or here if it died first) and gets 60 s."""
    from wbridge.testing.hf import make_qwen2

    base, out, tmpdir = tmp / "base", tmp / "out", tmp / "engine_tmp"
    out.mkdir()
    tmpdir.mkdir()
    make_qwen2(str(base))
    port = free_port()
    logs = {n: str(tmp / f"{n}.log") for n in ("trainer", "engine")}
    with open(logs["trainer"], "w") as ft, open(logs["engine"], "w") as fe:
        cmd = [sys.executable, os.path.join(HERE, "lora_roles.py"), "trainer", base, out, port]
        trainer = spawn(cmd, ft, dict(os.environ, PYTHONPATH=ROOT))
        try:
            engine = spawn_role("engine", base, out, port, log=fe, script=script, env={"TMPDIR": str(tmpdir), **env})
            _wait([engine], 500, {"engine": logs["engine"]})
        finally:
            (out / "stop").touch()
            _wait([trainer], 60, {"trainer": logs["trainer"]})
    return json.load(open(out / "engine.json"))


def adapters(run: dict) -> Iterator[tuple[int, str, dict]]:
    """(version, adapter, that version's results) for each version and adapter of a run."""
    return ((s["version"], name, s) for s in run["steps"] for name in "ab")


def check_versions(run: dict) -> None:
    """For each version and adapter, the greedy tokens and logprobs of the installed adapter equal
    those of that version loaded from the trainer's PEFT checkpoint on disk; each version changed
    its adapter's tokens (AdamW steps), and the adapters changed the base's."""
    steps = run["steps"]
    assert [s["version"] for s in steps] == [1, 2, 3]
    for v, name, s in adapters(run):
        mem, disk = s["mem"][name], s["disk"][name]
        assert [o["tokens"] for o in mem] == [o["tokens"] for o in disk], (v, name)
        assert [o["logprobs"] for o in mem] == [o["logprobs"] for o in disk], (v, name)
    for name in "ab":
        tokens = [[o["tokens"] for o in s["mem"][name]] for s in steps]
        assert tokens[0] != tokens[1] != tokens[2], tokens
        assert tokens[0] != [o["tokens"] for o in run["base"]]


def check_apart(run: dict) -> None:
    """The two adapters' tokens differ at every version."""
    for s in run["steps"]:
        a, b = ([o["tokens"] for o in s["mem"][n]] for n in "ab")
        assert a != b, s["version"]


def check_tmpdir_and_bytes(run: dict) -> None:
    """The engine's TMPDIR gained nothing during the updates; each update read the adapter's
    bytes; the updaters closed."""
    assert run["tmpdir"] == run["tmpdir_before"], "a file in TMPDIR appeared during the updates"
    for ch, stats in run["stats"].items():
        assert [s["version"] for s in stats] == [1, 2, 3], stats
        assert all(s["nbytes"] == run["nbytes"][ch] for s in stats), (ch, stats, run["nbytes"])
    assert all("closed" in r for r in run["closed"])


def check_refused(run: dict) -> dict[str, str]:
    """The adapters of too high a rank and of another base's width were refused, naming the module
    (the one on ``lm_head``: each engine's test); returns the errors."""
    refused = run["refused"]
    print(f"\nrefused: {json.dumps(refused, indent=1)}")
    assert refused["lora-r16"].startswith("UsageError: ") and "max_lora_rank 8" in refused["lora-r16"]
    assert re.search(r"module model\.layers\.0\.\S+ has LoRA rank 16", refused["lora-r16"]), refused["lora-r16"]
    assert "does not fit this base model" in refused["lora-wide"], refused["lora-wide"]
    return refused
