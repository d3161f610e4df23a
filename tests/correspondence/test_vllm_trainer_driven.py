"""vLLM's trainer-driven flow over wbridge: a vLLM OpenAI server (CPU, RL routes on) runs the
``wbridge`` weight-transfer backend; the trainer drives it with vLLM's own
``HTTPVLLMWeightSyncClient`` through ``WeightTransferTrainerFactory`` (wbridge's trainer engine),
which publishes each optimizer step and runs start -> update -> finish. Checked: the server labels
each update with the version published, the engine's kernels hold it, and the checkpoint-format
tensors it reloaded are the trainer's weights, fused the vLLM way, bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
import torch

from .helpers import free_port
from .test_vllm_engine import ROOT, VLLM_PY, _plugin_dist, _spawn, _wait

pytestmark = [
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.skipif(not os.path.exists(VLLM_PY), reason=f"no vLLM venv at {VLLM_PY} (scripts/setup.sh makes it)"),
]


def _serve(ckpt, port: int, plugin, log):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, str(plugin)]),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="WARNING",
        VLLM_SERVER_DEV_MODE="1",  # vLLM serves its RL weight-sync routes only in dev mode
    )
    args = [
        # the server's own entry (the `vllm` CLI asks for the `vllm` distribution; this is vllm-cpu)
        "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(ckpt),
        "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.3",
        "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0", "--no-enable-prefix-caching",
        "--worker-extension-cls", "wbridge.integrations.vllm.WBridgeWorkerExtension",
        "--weight-transfer-config", json.dumps({"backend": "wbridge"}),
    ]  # fmt: skip
    return subprocess.Popen([VLLM_PY, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _healthy(url: str, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"vLLM server not healthy within {timeout}s")


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.timeout(900)
def test_vllm_http_client_drives_updates_over_wbridge(tmp_path, qwen2_ckpt):
    ckpt, out = qwen2_ckpt, tmp_path / "out"
    out.mkdir()
    plugin = _plugin_dist(tmp_path / "plugin")
    logs = {n: str(tmp_path / f"{n}.log") for n in ("server", "trainer")}
    http, store = free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    with open(logs["server"], "w") as slog, open(logs["trainer"], "w") as tlog:
        server = _serve(ckpt, http, plugin, slog)
        try:
            _healthy(url, server, 400)
            _wait([_spawn("http_trainer", ckpt, out, store, url, log=tlog)], 400, {"trainer": logs["trainer"]})
        finally:
            try:
                os.killpg(server.pid, signal.SIGKILL)  # the server and its engine processes
            except ProcessLookupError:
                pass
            server.wait(timeout=30)
    rounds = torch.load(out / "http_trainer.pt", weights_only=False)["rounds"]
    assert [r["version"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["label"] == str(r["version"]), r["label"]  # finish_weight_update labelled it
        assert r["held"] == str(r["version"])  # what the kernels were reloaded with (the route sends text)
        tr, dig = r["trainer"], r["digests"]
        for i in range(2):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            want = {
                a + "qkv_proj.weight": torch.cat([tr[a + f"{x}_proj.weight"] for x in "qkv"]),
                a + "o_proj.weight": tr[a + "o_proj.weight"],
                p + "mlp.gate_up_proj.weight": torch.cat(
                    [tr[p + "mlp.gate_proj.weight"], tr[p + "mlp.up_proj.weight"]]
                ),
                p + "mlp.down_proj.weight": tr[p + "mlp.down_proj.weight"],
            }
            for k, v in want.items():
                assert dig[k] == _sha(v), k
        for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            assert dig[k] == _sha(tr[k]), k
    assert rounds[0]["digests"] != rounds[1]["digests"], "the second step changed nothing"
