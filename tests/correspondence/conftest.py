"""Session fixtures of the real-engine tests: the tiny checkpoints they start engines from (made once,
read only) and the reference hosts, one process per engine venv that runs fresh reference engines
one after the other for every test that compares against one (an engine started in a warm process
costs seconds; a process of its own, its imports first)."""

from __future__ import annotations

import os

import pytest

from .role_host import RoleHost
from .venvs import HERE, NO_SGLANG, NO_VLLM, SGLANG_PY, VLLM_PY, sglang_env, vllm_env


def _made(tmp_path_factory, name: str, make, *args) -> str:
    import torch

    path = str(tmp_path_factory.mktemp(name) / "ckpt")
    with torch.random.fork_rng():  # the makers seed torch's global generator
        make(path, *args)
    return path


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory) -> str:
    """The vLLM tests' random Qwen2 (``vllm_roles.make``)."""
    from .vllm_roles import make

    return _made(tmp_path_factory, "qwen2", make)


@pytest.fixture(scope="session")
def hf_qwen2_ckpt(tmp_path_factory) -> str:
    """The random Qwen2 of ``wbridge.testing.hf.make_qwen2`` (SGLang and LoRA tests)."""
    from wbridge.testing.hf import make_qwen2

    return _made(tmp_path_factory, "hf_qwen2", make_qwen2)


def _host(tmp_path_factory, python: str, script: str, env: dict, missing: str):
    if not os.path.exists(python):
        pytest.skip(missing)
    log = str(tmp_path_factory.mktemp(os.path.splitext(script)[0]) / "host.log")
    host = RoleHost(python, os.path.join(HERE, script), env, log)
    yield host
    host.close()


@pytest.fixture(scope="session")
def vllm_host(tmp_path_factory):
    """``vllm_roles.py``'s ``reference`` and ``moe_reference`` in one vLLM process."""
    yield from _host(tmp_path_factory, VLLM_PY, "vllm_roles.py", vllm_env(), NO_VLLM)


@pytest.fixture(scope="session")
def sglang_host(tmp_path_factory):
    """``sglang_roles.py``'s ``reference`` in one SGLang process."""
    yield from _host(tmp_path_factory, SGLANG_PY, "sglang_roles.py", sglang_env(), NO_SGLANG)
