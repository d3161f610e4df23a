"""The engines' venvs and how the real-engine tests run a process in them.

vLLM runs in ``.venv-vllm`` and SGLang in ``.venv-sglang`` (made by the set-up script; or
``WBRIDGE_VLLM_PYTHON`` / ``WBRIDGE_SGLANG_PYTHON``); neither has wbridge installed, so each
process gets the repository (and, for SGLang, ``tests/sglang_stubs``) on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

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
        OMP_NUM_THREADS="1",
        VLLM_LOGGING_LEVEL="WARNING",
    )


def sglang_env(path: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a process in the SGLang venv (``path``: more of ``PYTHONPATH``)."""
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, STUBS, *map(str, path)]),
        SGLANG_USE_CPU_ENGINE="1",
        OMP_NUM_THREADS="1",
    )
