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
import time
from collections.abc import Callable

from ...errors import UsageError, WaitTimeout

log = logging.getLogger(__name__)


class Watcher:
    """A thread that starts a background pull whenever a version above ``floor()`` is committed.

    - ``wait_version``: the worker subscriber's ``wait_version(after=, timeout=)``.
    - ``floor``: the version nothing at or below is to be pulled (the kernels' or a discarded
      pull's), or None while a pull is in flight or staged (then the watcher waits for ``poke``).
    - ``start``: starts the background pull of at least the given version.
    - ``give_up_s``: how long the store may keep failing (unreachable, timing out) before the
      watcher stops and reports it (``error``); shorter failures are retried.
    - ``slice_s``: how long one store wait lasts (the bound on each of its store calls, too).
    """

    def __init__(
        self,
        wait_version: Callable[..., int],
        floor: Callable[[], int | None],
        start: Callable[[int], None],
        give_up_s: float = 60.0,
        slice_s: float = 5.0,
    ) -> None:
        self._wait_version, self._floor, self._start, self._slice = wait_version, floor, start, slice_s
        self._give_up_s = give_up_s
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
        failing_since: float | None = None
        while not self._stop.is_set():
            self._changed.clear()
            floor = self._floor()
            if floor is None:  # a pull in flight or staged: its commit pokes
                self._changed.wait(self._slice)
                continue
            try:
                v = self._wait_version(after=floor, timeout=self._slice)
                failing_since = None
            except WaitTimeout:  # nothing new within the slice (or a store call ran past it)
                continue
            except BaseException as e:  # noqa: BLE001 - retried, then reported through wbridge_staged
                if self._stop.is_set():
                    return  # closed under it
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if isinstance(e, UsageError) or now - failing_since >= self._give_up_s:
                    log.warning("wbridge: the channel watcher stopped: %s", e)
                    self.error = e
                    return
                log.info("wbridge: the channel watcher retries after: %s", e)
                self._stop.wait(min(1.0, self._slice))
                continue
            if self._stop.is_set():
                return
            try:
                self._start(v)
                self.started += 1
            except UsageError:  # a pull started by hand meanwhile (wbridge_pull_start): wait for it
                self._changed.wait(self._slice)

    def close(self, timeout: float = 1.0) -> None:
        """Stops the thread (idempotent): waits at most ``timeout`` for it to leave its store wait;
        closing the subscriber after this ends a wait still running (the thread then exits quietly)."""
        self._stop.set()
        self._changed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
