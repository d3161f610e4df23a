"""Shared fixtures and markers. ``gpu`` tests skip where no CUDA device exists.

``heavy`` tests (CPU-bound for long: real vLLM engines, Ray, multi-process training) run one at a
time under ``pytest -n N`` (``scripts/test.sh``): collection puts them first, so xdist's load
scheduling, which hands each worker a run of consecutive tests, gives them all to the first worker
(module fixtures such as test_dtensor's gloo runs then run once), and a lock shared by the run's
workers serialises any that land elsewhere. (``xdist_group`` would say this directly, but xdist
3.8 cannot rename pytest 9's node ids, so ``--dist loadgroup`` ignores the groups.)"""

from __future__ import annotations

import fcntl
import os
import tempfile

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)  # stable: heavy first
    if not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout: waiting is not the test's time
def pytest_runtest_protocol(item, nextitem):
    run = getattr(item.config, "workerinput", {}).get("testrunuid")
    if run is None or item.get_closest_marker("heavy") is None:
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), f"wbridge-heavy-{run}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
