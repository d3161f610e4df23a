"""A vLLM worker's channel watcher: starts the background pull as soon as a new version is committed.

It runs on a thread of each vLLM worker (``WBridgeWorkerExtension.wbridge_watch``), next to the
pulls it starts, so nothing in the user's process calls into the engine from another thread: the
updater (``updater``) only asks, between two engine steps, whether a pull is staged and commits it.
Between a pull's start and its commit (or discard) the watcher waits; then it blocks on the
channel's next committed version (``Subscriber.wait_version``, a store wait, not a poll).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ...errors import UsageError, WaitTimeout

log = logging.getLogger(__name__)


class Watcher:
    """A thread that starts a background pull whenever a version above ``floor()`` is committed.

    - ``wait_version``: the worker subscriber's ``wait_version(after=, timeout=)``.
    - ``floor``: the version nothing at or below is to be pulled (the kernels' or a discarded
      pull's), or None while a pull is in flight or staged (then the watcher waits for ``poke``).
    - ``start``: starts the background pull of at least the given version.
    - ``slice_s``: the longest the thread blocks before it looks at ``close`` again.
    """

    def __init__(
        self,
        wait_version: Callable[..., int],
        floor: Callable[[], int | None],
        start: Callable[[int], None],
        slice_s: float = 0.5,
    ) -> None:
        self._wait_version, self._floor, self._start, self._slice = wait_version, floor, start, slice_s
        self._changed, self._stop = threading.Event(), threading.Event()
        self.error: BaseException | None = None  # what stopped the thread, if not close()
        self.started = 0  # pulls this watcher started
        self._thread = threading.Thread(target=self._run, name="wbridge-vllm-watch", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def poke(self) -> None:
        """A commit or discard freed the staging: look at ``floor()`` again now."""
        self._changed.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._changed.clear()
            floor = self._floor()
            if floor is None:  # a pull in flight or staged: its commit pokes
                self._changed.wait(self._slice)
                continue
            try:
                v = self._wait_version(after=floor, timeout=self._slice)
            except WaitTimeout:
                continue
            except BaseException as e:  # noqa: BLE001 - reported through wbridge_staged
                if not self._stop.is_set():
                    log.warning("wbridge: the channel watcher stopped: %s", e)
                    self.error = e
                return
            if self._stop.is_set():
                return
            try:
                self._start(v)
                self.started += 1
            except UsageError:  # a pull started by hand meanwhile (wbridge_pull_start): wait for it
                self._changed.wait(self._slice)

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread (idempotent); returns once it has left its store wait."""
        self._stop.set()
        self._changed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
