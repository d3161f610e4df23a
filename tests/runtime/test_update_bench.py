"""``wbridge bench update --serve/--connect`` on one host (loopback): a tiny model published as FP8
blocks with deltas reaches a TP=2 rollout bit-exact, version after version; a client with another
token learns nothing; options of the other side are refused. The shaped two-host run (1 GiB, TP=2)
is in tests/benchmarks/test_bench_two_hosts.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from transports._util import free_port
from wbridge.testing import update_bench
from wbridge.testing.synthetic import ModelConfig, bits_view

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "wbridge.cli", "bench", "update", *args]


def _env(token: str) -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, WBRIDGE_TOKEN=token)


@pytest.mark.slow
def test_fp8_deltas_reach_a_tp2_rollout_bit_exact_and_a_wrong_token_is_refused() -> None:
    port = free_port()
    server = subprocess.Popen(
        _argv("--serve", "--port", str(port), "--model", "tiny", "--fp8", "--delta", "0.1", "--versions", "3",
              "--json"),
        env=_env("right"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        info = json.loads(server.stdout.readline())
        assert info["fp8"] and info["period"] == 10 and info["versions"] == 3, info
        wrong = subprocess.run(
            _argv("--connect", f"127.0.0.1:{port}", "--timeout", "30"),
            env=_env("wrong"), capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert wrong.returncode == 1 and "bad signature" in wrong.stderr, wrong.stderr[-2000:]
        out = subprocess.run(
            _argv("--connect", f"127.0.0.1:{port}", "--tp", "2", "--bench-s", "0.3", "--json"),
            env=_env("right"), capture_output=True, text=True, timeout=200, cwd=ROOT,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert [r["version"] for r in res["rows"]] == [1, 2, 3]
        for r in res["rows"]:
            assert r["exact"] is True and r["bytes"] > 0 and r["pull_s"] > 0 and r["stall_s"] > 0, r
            assert r["vs_transport"] is not None and res["transport_gbps"] > 0, res
        assert server.wait(60) == 0
    finally:
        server.kill()
        server.wait(30)
        server.stdout.close()
        server.stderr.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--serve", "--tp", "4"], "--tp: not for --serve"),
        (["--connect", "h:1", "--params", "8B"], "--params: not for --connect"),
        (["--connect", "h:1", "--port", "3"], "--port is the server's"),
        (["--serve", "--delta", "0.9"], "--delta"),
        (["--serve", "--transport", "local"], "crosses hosts"),
        (["--serve", "--host", "::"], "rollouts are told this address"),
        (["--serve", "--params", "lots"], "not a parameter count"),
    ],
)
def test_options_of_the_other_side_are_refused(args: list[str], says: str, capsys, monkeypatch) -> None:
    monkeypatch.setenv("WBRIDGE_TOKEN", "t")
    with pytest.raises(SystemExit) as e:
        update_bench.main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_model_sizes_by_parameter_count() -> None:
    cfg = ModelConfig.from_params(update_bench.parse_params("8B"))
    assert (cfg.hidden, cfg.layers, cfg.vocab) == (4096, 32, 128256)  # Llama-3-8B's shape
    assert abs(cfg.params - 8.03e9) < 0.01e9
    small = ModelConfig.from_params(update_bench.parse_params("0.54B"))
    assert abs(small.nbytes / 2**30 - 1.0) < 0.05  # about 1 GiB in bf16


def test_the_fp8_check_catches_one_wrong_byte() -> None:
    """What a rollout compares after each FP8 pull: the values of the version pass, garbage and one
    flipped byte (of a weight, of a scale) fail, naming the tensor."""
    cfg = ModelConfig.tiny()
    tensors = update_bench.rollout_tensors(cfg, 2, 1, fused=True, fp8=True)
    assert len(update_bench.fp8_mismatches(cfg, tensors, 3, 10)) == len(tensors)  # garbage everywhere
    update_bench.set_fp8_version(cfg, tensors, 3, 10)
    assert update_bench.fp8_mismatches(cfg, tensors, 3, 10) == []
    assert update_bench.fp8_mismatches(cfg, tensors, 4, 10) != []  # the next version differs
    for name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"):
        bits = bits_view(tensors[name][0])
        bits[-1] ^= 1
        assert update_bench.fp8_mismatches(cfg, tensors, 3, 10) == [name]
        bits[-1] ^= 1


def test_fp8_on_shards_that_split_blocks_is_refused_before_anything_starts(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WBRIDGE_TOKEN", "t")
    port = free_port()  # nothing may listen there afterwards: the store is not hosted
    assert update_bench.main(["--serve", "--port", str(port), "--model", "tiny", "--ranks", "2", "--fp8"]) == 1
    err = capsys.readouterr().err
    assert "--fp8 with --ranks 2" in err and "q_proj.weight" in err and "128x128 blocks" in err, err
