"""``scripts/gpu_check.sh``'s parts with CPU tensors standing in for CUDA ones, so the references
they check against cannot rot before a GPU runs them; the script's SKIP line where no GPU is, and
where no python has torch (a bare machine without ``.venv``); what a GPU machine without nixl runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from wbridge.testing import gpu_check, gpu_check_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_PARTS = [n for n in gpu_check.PARTS if n != "vllm"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", CPU_PARTS)
def test_part_on_cpu_tensors(name) -> None:
    result, _ = gpu_check.run_part(name, gpu_check.PARTS[name], "cpu")
    print(result.line())
    assert result.status == "ok", result.line()


def test_vllm_part_skips_on_cpu() -> None:
    result, _ = gpu_check.run_part("vllm", gpu_check.PARTS["vllm"], "cpu")
    assert result.status == "SKIP" and "CUDA" in result.detail


@pytest.mark.timeout(180)
def test_figures_on_cpu_tensors() -> None:
    result, value = gpu_check.run_part("figures", gpu_check.measure_figures, "cpu")
    assert result.status == "ok", result.line()
    figures = value[0]
    assert figures.stall_vs_d2d > 0 and figures.vram_read_vs_d2d > 0 and figures.delta_encode_gbps > 0


def test_reference_catches_one_wrong_byte() -> None:
    """The check a part ends with fails on a single flipped byte of a pulled tensor."""
    want = gpu_check_data.subscriber_tensors("fp8", 1)
    held = {n: (t.clone(), d) for n, (t, d) in want.items()}
    assert gpu_check_data.differing(held, want) == []
    held["b.weight"][0].view(-1).view(torch.uint8)[1000] ^= 1
    assert gpu_check_data.differing(held, want) == ["b.weight"]


def test_fp8_reference_is_the_format() -> None:
    """The CPU quantiser the fp8 part checks against, on a hand-made block: amax 448 gives scale 1."""
    w = torch.zeros(130, 129)
    w[0, 0], w[1, 1], w[129, 128] = 448.0, -3.0, 0.5
    q, s = gpu_check_data.fp8_reference(w)
    assert s.shape == (2, 2) and s[0, 0] == 1.0 and s[0, 1] == 1.0  # block (0, 1) all zero: 1.0
    assert s[1, 1] == 0.5 / 448.0 and q[129, 128].float() == 448.0 and q[1, 1].float() == -3.0


def test_without_nixl_a_gpu_reads_through_host_staging_and_skips_the_rest(monkeypatch) -> None:
    """What a GPU machine whose python has CUDA torch but no nixl gets: the feature parts through
    tcp with host staging, the nixl part, zero-copy and the figures as SKIPs naming the package."""
    import transports

    monkeypatch.setattr(transports, "available", lambda: ["tcp", "local"])
    route = gpu_check.feature_route("cuda:0")
    assert (route.transport, route.staged) == ("tcp", True) and "nixl-cu12" in route.note
    assert gpu_check.feature_route("cpu") == gpu_check.Route("tcp", False)
    for name, fn in [("nixl", gpu_check.PARTS["nixl"]), ("zero_copy", gpu_check.part_zero_copy)]:
        result, _ = gpu_check.run_part(name, fn, "cuda:0")
        assert result.status == "SKIP" and "nixl-cu12 is not installed" in result.detail, result
        assert result.line().startswith(f"gpu_check: SKIP {name}: "), result.line()
    result, _ = gpu_check.run_part("figures", gpu_check.measure_figures, "cuda:0")
    assert result.status == "SKIP" and "nixl-cu12" in result.detail, result


def test_summary_lines() -> None:
    ok = gpu_check.PartResult("tcp", "ok", "fine")
    skip = gpu_check.PartResult("vllm", "SKIP", "no CUDA build")
    bad = gpu_check.PartResult("local", "FAIL", "TransportError: host memory only")
    fig = gpu_check.Figures(1.5, 0.25, 12.0)
    assert gpu_check.summary([ok, skip], fig) == (
        "gpu_check: ok parts=1 failed=0 stall_vs_d2d=1.50 vram_read_vs_d2d=0.250 delta_encode_gbps=12.00"
    )
    assert gpu_check.summary([ok, bad, skip], None) == (
        "gpu_check: FAILED parts=2 failed=1 stall_vs_d2d=n/a vram_read_vs_d2d=n/a delta_encode_gbps=n/a"
    )


@pytest.mark.gpu  # tests/conftest.py skips it where no CUDA GPU is
@pytest.mark.slow
@pytest.mark.timeout(330)
def test_script_passes_on_the_gpu() -> None:
    """Where a CUDA GPU is: the one command runs every part whose package is installed, bit-exact,
    and ends with its ok line (parts whose package is missing SKIP and do not count)."""
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=320)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert lines[-1].startswith("gpu_check: ok parts=") and not any(" FAIL " in x for x in lines), run.stdout


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script runs for real (minutes)")
def test_script_skips_without_a_gpu() -> None:
    """What CI sees: the one command exits 0 with one SKIP line naming why."""
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[-1].startswith("gpu_check: SKIP: no CUDA GPU here"), run.stdout


def _bare_machine(tmp_path) -> tuple[str, dict[str, str]]:
    """A copy of the script with no ``.venv`` beside it, and an environment whose PATH has one
    python3, without torch (a venv of the interpreter running the tests, without its packages)."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "gpu_check.sh"), tmp_path / "repo" / "scripts")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=60)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(tmp_path / "venv" / "bin" / "python3", bin_dir / "python3")
    for tool in ("dirname", "timeout"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    return str(tmp_path / "repo"), {"PATH": str(bin_dir)}


@pytest.mark.timeout(120)
def test_script_skips_where_no_python_has_torch(tmp_path) -> None:
    """``env -i PATH=... bash scripts/gpu_check.sh`` on a machine whose python3 has no torch and no
    ``.venv``: one SKIP line naming the python it tried, exit 0."""
    repo, env = _bare_machine(tmp_path)
    bash = shutil.which("bash")
    run = subprocess.run([bash, "scripts/gpu_check.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: SKIP: no python here has torch"), run.stdout
    assert str(tmp_path / "bin" / "python3") in lines[0] and not run.stderr, (run.stdout, run.stderr)
    # $PYTHON names one that lacks torch: the same clean line, naming why
    run = subprocess.run(
        [bash, "scripts/gpu_check.sh"],
        cwd=repo,
        env={**env, "PYTHON": str(tmp_path / "bin" / "python3")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and run.stdout.count("\n") == 1, (run.stdout, run.stderr)
    assert "has no torch (ModuleNotFoundError: No module named 'torch')" in run.stdout, run.stdout
