"""Shared fixtures and markers. ``gpu`` tests skip where no CUDA device exists; ``heavy`` tests share
one ``xdist_group``, so under ``pytest -n N --dist loadgroup`` (``scripts/test.sh``) they run one at
a time on one worker while the waiting-bound rest of the suite overlaps on the others."""

from __future__ import annotations

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("heavy"))
    if not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
