"""An engine's follower: a thread that starts a pull as soon as a new version is committed.

Used by the vLLM workers (``vllm.worker``: the pull runs on a thread of its own, the updater commits
it) and by SGLang's scheduler processes (``sglang.runtime``: the pull runs on this thread, the
scheduler commits it between steps). Between a pull's start and its commit the follower waits for
a ``poke``; then it blocks on the channel's next committed version (``Subscriber.wait_version``, a
store wait, not a poll).

Failures, the follower's own (the store unreachable while it waits) and the pulls' it started
(``failed``), are sorted by ``wbridge.integrations.remote.deterministic``: a deterministic one (a
plan that cannot work, a wrong token) stops the follower at once, logged once, and is kept in
``error`` for the engine's next update to raise; a transient one is retried after a backoff that
doubles up to ``backoff[1]`` seconds (counted in ``retries``), until failures have gone on for
``give_up_s``. Any other exception that ends the thread (a bug, ``RuntimeError: can't start new
thread``) is kept in ``error`` too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import WaitTimeout, WBridgeError
from .remote import deterministic

log = logging.getLogger(__name__)


class Watcher:
    """A thread that starts a pull whenever a version above ``floor()`` is committed.

    - ``wait_version``: the subscriber's ``wait_version(after=, timeout=)``.
    - ``floor``: the version nothing at or below is to be pulled (the kernels' or a discarded
      pull's), or None while a pull is in flight or staged (then the watcher waits for ``poke``).
    - ``start``: starts (or runs) the pull of at least the given version; returns False when it
      cannot now (a pull started by hand is in flight: the watcher waits for a ``poke``). What it
      raises ends the watcher (``error``). The pull reports back with ``succeeded`` / ``failed``.
    - ``give_up_s``: how long transient failures may go on before the watcher stops with the last.
    - ``slice_s``: how long one store wait lasts (the bound on each of its store calls, too).
    - ``backoff``: seconds before the first retry after a transient failure, and at most (doubling).
    - ``name``: the thread's name.

    ``start()`` starts the thread; ``close()`` stops it.
    """

    def __init__(
        self,
        wait_version: Callable[..., int],
        floor: Callable[[], int | None],
        start: Callable[[int], bool],
        give_up_s: float = 60.0,
        slice_s: float = 5.0,
        backoff: tuple[float, float] = (0.2, 5.0),
        name: str = "wbridge-watch",
    ) -> None:
        self._wait_version, self._floor, self._start, self._slice = wait_version, floor, start, slice_s
        self._give_up_s, self._backoff = give_up_s, backoff
        self._changed, self._stop = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._failing_since: float | None = None  # failures, with no success since
        self._streak = 0  # failures in a row: the backoff's exponent
        self._not_before = 0.0  # monotonic time before which nothing is started (backoff)
        self.error: BaseException | None = None  # what stopped the thread, if not close()
        self.started = 0  # pulls this watcher started
        self.retries = 0  # transient failures it retried
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Watcher:
        """Starts the thread (once the owner holds this watcher: its pulls report back to it)."""
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def poke(self) -> None:
        """A commit or discard freed the staging, or a pull ended: look at ``floor()`` again now."""
        self._changed.set()

    def succeeded(self) -> None:
        """A pull it started succeeded: failures so far are over."""
        with self._lock:
            self._failing_since, self._streak = None, 0

    def failed(self, e: BaseException) -> bool:
        """A pull it started (or its own store wait) failed with ``e``: True when it is retried
        after the backoff; False when the watcher stopped on it (deterministic, or failures for
        ``give_up_s``) and keeps it in ``error``."""
        with self._lock:
            now = time.monotonic()
            self._failing_since = now if self._failing_since is None else self._failing_since
            if deterministic(e) or now - self._failing_since >= self._give_up_s:
                stop = True
            else:
                stop = False
                self.retries += 1
                first, most = self._backoff
                delay = min(most, first * 2**self._streak)
                self._streak += 1
                self._not_before = now + delay
        if stop:
            self._stop_with(e)
            return False
        (log.info if self._streak == 1 else log.debug)(
            "wbridge: retrying in %.1fs after: %s: %s", delay, type(e).__name__, e
        )
        self.poke()
        return True

    def _stop_with(self, e: BaseException) -> None:
        if self.error is None and not self._stop.is_set():
            self.error = e
            log.warning("wbridge: the channel watcher stopped: %s: %s", type(e).__name__, e)
        self._stop.set()
        self._changed.set()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - whatever ends the thread is kept in ``error``
            self._stop_with(e)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._changed.clear()
            pause = self._not_before - time.monotonic()
            if pause > 0:  # backing off after a failure
                self._stop.wait(min(pause, self._slice))
                continue
            floor = self._floor()
            if floor is None:  # a pull in flight or staged: its end or commit pokes
                self._changed.wait(self._slice)
                continue
            try:
                v = self._wait_version(after=floor, timeout=self._slice)
            except WaitTimeout:  # nothing new within the slice (or a store call ran past it)
                continue
            except WBridgeError as e:
                if self._stop.is_set():
                    return  # closed under it
                self.failed(e)
                continue
            if self._stop.is_set():
                return
            if self._start(v):
                self.started += 1
            else:  # a pull started by hand meanwhile: its end pokes
                self._changed.wait(self._slice)

    def close(self, timeout: float = 1.0) -> None:
        """Stops the thread (idempotent): waits at most ``timeout`` for it to leave its store wait;
        closing the subscriber after this ends a wait still running (the thread then exits quietly)."""
        self._stop.set()
        self._changed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __repr__(self) -> str:
        state = "running" if self.alive else f"stopped ({type(self.error).__name__})" if self.error else "closed"
        return f"Watcher({state}, started={self.started}, retries={self.retries})"


__all__ = ["Watcher"]
