"""Worker processes for the tests (``wbridge.testing.workers``), forked from one preloaded forkserver."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from transports._util import free_port  # noqa: F401 (re-exported for callers)
from wbridge.testing.workers import Worker as _Worker
from wbridge.testing.workers import WorkerError, call_all  # noqa: F401 (re-exported for callers)

# forkserver: one process imports torch and wbridge once, every worker is a cheap fork of it
# (spawn re-imports torch in every worker: seconds each on a loaded 2-core machine).
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(
    ["torch", "numpy", "wbridge", "wbridge.testing.synthetic", "tests.runtime.actors", "tests.runtime.warm"]
)


class Worker(_Worker):
    """A ``wbridge.testing.workers.Worker`` forked from this suite's preloaded forkserver."""

    def __init__(self, name: str, factory: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any):
        super().__init__(name, factory, *args, timeout=timeout, context=CTX, **kwargs)
