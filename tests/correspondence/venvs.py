"""The engines' venvs and how the real-engine tests run a process in them.

vLLM runs in ``.venv-vllm`` and SGLang in ``.venv-sglang`` (made by the set-up script; or
``WBRIDGE_VLLM_PYTHON`` / ``WBRIDGE_SGLANG_PYTHON``); neither has wbridge installed, so each
process gets the repository (and, for SGLang, ``tests/sglang_stubs``) on ``PYTHONPATH``. Such a
process runs in a session of its own (``spawn``), so that a cleanup kills its whole group
(``kill_group``): the engines' scheduler and worker children, a trainer's ranks, Ray's workers. A
test's role process forks from a server of its venv that imported torch, wbridge and the engine
once (``spawn_role``, ``role_host.RoleForks``); the examples start as a user starts them.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence

from .role_host import Forked, RoleForks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VLLM_PY = os.environ.get("WBRIDGE_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python"))
SGLANG_PY = os.environ.get("WBRIDGE_SGLANG_PYTHON", os.path.join(ROOT, ".venv-sglang", "bin", "python"))
STUBS = os.path.join(ROOT, "tests", "sglang_stubs")
NO_VLLM = f"no vLLM venv at {VLLM_PY} (scripts/setup.sh makes it)"
NO_SGLANG = f"no SGLang venv at {SGLANG_PY} (scripts/setup.sh makes it)"


def vllm_env(path: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a process in the vLLM venv (``path``: more of ``PYTHONPATH``)."""
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, *map(str, path)]),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="WARNING",
    )


def sglang_env(path: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a process in the SGLang venv (``path``: more of ``PYTHONPATH``)."""
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, STUBS, *map(str, path)]),
        SGLANG_USE_CPU_ENGINE="1",
    )


def spawn(cmd: Sequence[str], log, env: Mapping[str, str]) -> subprocess.Popen:
    """``cmd`` with ``env``, its output in the open file ``log``, in a session of its own."""
    return subprocess.Popen(
        [str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
    )


#: What each venv's fork server imports once (``spawn_role``).
PRELOAD = {
    "vllm": [
        "torch",
        "wbridge",
        "vllm.entrypoints.llm",
        "vllm.v1.engine.async_llm",
        "vllm.v1.engine.core",  # (what its engine-core and worker processes run)
        "vllm.v1.executor.multiproc_executor",
        "vllm.v1.worker.cpu_worker",
    ],
    "sglang": [
        "torch",
        "wbridge",
        "sglang",
        "sglang.srt.entrypoints.engine",
        "sglang.srt.managers.scheduler",  # (what its scheduler and detokenizer processes run)
        "sglang.srt.managers.detokenizer_manager",
    ],
}
#: The venvs whose fork server also forks the processes the engines spawn (``role_host.RoleForks``):
#: SGLang's scheduler and detokenizer, vLLM's engine core and worker imported the engine afresh,
#: 6-8 CPU-seconds each.
SPAWNS = {"sglang", "vllm"}
_forks: dict[str, RoleForks] = {}


def spawn_role(venv: str, script: str, args: Sequence, log, env: Mapping[str, str]) -> Forked:
    """``script *args`` (a role script of these tests) as a process of ``venv`` (``"vllm"`` or
    ``"sglang"``) with ``env``, its output in the open file ``log``, in a session of its own: forked
    from the venv's fork server (started on first use, ended with this process)."""
    forks = _forks.get(venv)
    if forks is None:
        python, base = (VLLM_PY, vllm_env()) if venv == "vllm" else (SGLANG_PY, sglang_env())
        log_path = os.path.join(tempfile.mkdtemp(prefix=f"wbridge-{venv}-forks-"), "forks.log")
        forks = _forks[venv] = RoleForks(python, base, PRELOAD[venv], log_path, spawns=venv in SPAWNS)
        atexit.register(forks.close)
    return forks.start(script, *args, log=log, env=env)


def kill_group(p: subprocess.Popen | Forked) -> None:
    """Kills the session ``p`` was spawned in (what it left behind too) and reaps ``p``."""
    if isinstance(p, Forked):
        p.kill_group()
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait(timeout=30)


#: The examples' ``--pause`` under test: each rollout rests this long between its batches. Back to
#: back, two engines generating kept both cores busy for an example's whole run, and the suite
#: beside it waited for CPU; a rollout still generates many batches per version.
PAUSE = ("--pause", 0.2)  # (not the Ray example: its driver watches for an update in flight)


def run_example(
    python: str, script: str, args: Sequence, out, timeout: float, env: Mapping[str, str] | None = None
) -> str:
    """Runs ``python examples/SCRIPT *args --check --out OUT`` (``env``: by default this one with
    the repository on ``PYTHONPATH``) to its end, its output in ``OUT/log``, waiting up to
    ``timeout`` s, then kills its group; asserts it exited 0 (the log's tail says why not) and
    returns the log."""
    cmd = [python, os.path.join(ROOT, "examples", script), *args, "--check", "--out", out]
    log = os.path.join(out, "log")
    with open(log, "w") as f:
        p = spawn(cmd, f, dict(os.environ, PYTHONPATH=ROOT) if env is None else env)
        try:
            p.wait(timeout=timeout)
        finally:
            kill_group(p)
    text = open(log, errors="replace").read()
    assert p.returncode == 0, text[-6000:]
    return text
