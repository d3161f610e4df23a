"""What one vLLM worker holds for its wbridge subscription, as one typed object.

``WBridgeWorkerExtension`` (``worker``) keeps a ``WorkerState`` from ``wbridge_subscribe`` to
``wbridge_close``; the weight-transfer engine (``transfer``) keeps its own. A background pull
(``Background``) runs on a thread of its own, started by the channel watcher or by hand.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..follow import Watcher
from .commit import CommitPlan


@dataclass(frozen=True)
class Fetched:
    """A pull into staging, not committed yet.

    version: the version pulled.
    pull_s: seconds the pull took.
    prepare_s: seconds building the repacked layers' kernels from staging took.
    prepared: those kernels, ``{module name: cpu_linear}`` (``commit.prepare``).
    stats: the subscriber's record of the pull (``PullStats``).
    transport: the transports it read over (``"tcp"``, ``"local,tcp"``...).
    """

    version: int
    pull_s: float
    prepare_s: float
    prepared: dict[str, Any]
    stats: Any
    transport: str


class Background:
    """One pull on a worker thread: ``result`` (a ``Fetched``) or ``error`` once it ends.

    fetch: the pull, ``fetch(timeout, min_version) -> Fetched``.
    timeout: seconds it may take.
    min_version: the version it pulls at least (None: the newest).
    auto: started by the watcher (which retries it on failure), not by hand.
    done: called on the thread with this object once it ended.
    """

    def __init__(
        self,
        fetch: Callable[[float, int | None], Fetched],
        timeout: float,
        min_version: int | None,
        auto: bool,
        done: Callable[[Background], None],
    ) -> None:
        self.min_version, self.auto = min_version, auto
        self.result: Fetched | None = None
        self.error: BaseException | None = None
        self._fetch, self._timeout, self._done = fetch, timeout, done
        self.thread = threading.Thread(target=self._run, name="wbridge-vllm-pull", daemon=True)

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    def _run(self) -> None:
        try:
            self.result = self._fetch(self._timeout, self.min_version)
        except BaseException as e:  # noqa: BLE001 - reported through wbridge_staged / wbridge_commit
            self.error = e
        self._done(self)


@dataclass
class WorkerState:
    """One worker's subscription (``wbridge_subscribe`` to ``wbridge_close``).

    - ``sub``: the registered ``Subscriber``; ``staging`` its destination, the checkpoint-format
      tensors by name; ``plan`` how each reaches the kernels (``commit.CommitPlan``).
    - ``rank``: the worker's rank in the engine (named in errors).
    - ``version``: the version the kernels hold (None: none known).
    - ``fetched``: a pull into staging not committed yet (by ``wbridge_pull`` or a transfer backend).
    - ``background``: the background pull, running or ended and not committed.
    - ``watcher``: the channel watcher (``wbridge_watch``).
    - ``skip``: the watcher pulls only above this (``wbridge_discard(min_version=)``).
    - ``failures``: pulls that failed since the last commit (retried by the watcher).
    - ``verifying``: a ``wbridge_verify`` runs: the watcher starts no pull meanwhile.
    - ``stats``: one dict per committed update (``wbridge_stats``).
    - ``lock``: guards ``background`` (the watcher's thread and RPCs both take it).
    """

    sub: Any
    staging: dict[str, Any]
    plan: CommitPlan
    rank: int
    version: int | None = None
    fetched: Fetched | None = None
    background: Background | None = None
    watcher: Watcher | None = None
    skip: int = 0
    failures: int = 0
    verifying: bool = False
    stats: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


__all__ = ["Background", "Fetched", "WorkerState"]
