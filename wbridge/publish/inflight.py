"""At most one publish in flight: ``Publisher.publish_async()``'s worker thread and what waits for it.

``InFlight`` holds the start lock (held while a publish is started, and by ``close``), the one worker
thread ``publish_async()`` submits to (made on first use), the future of the publish in flight with
its deadline, and the stop signal ``close()`` gives so that a publish waiting on subscribers gives up
at once (``check_stopped``). ``publish()``, ``publish_async()`` and ``register()`` first ``settle``
the publish in flight (wait for it, bounded); ``close()`` stops it, waits ``CLOSE_WAIT_S`` at most,
and no publish starts after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from .._deadline import Deadline
from ..errors import UsageError, WaitTimeout

log = logging.getLogger("wbridge")

CLOSE_WAIT_S = 10.0  # how long close() waits for a publish in flight before it tears down anyway


class InFlight:
    """One publisher rank's publish in flight.

    - ``rank``: the publisher rank (in messages, and the worker thread's name).
    - ``channel``: the channel's name (likewise).
    """

    def __init__(self, rank: int, channel: str) -> None:
        self.rank, self.channel, self.who = rank, channel, f"publisher rank {rank}"
        self.lock = threading.Lock()  # held while a publish is started (and by close)
        self.stop = threading.Event()
        self.future: Future | None = None
        self.deadline = Deadline(0.0)  # the publish in flight's
        self._worker: ThreadPoolExecutor | None = None
        self._ident: int | None = None  # the worker thread's

    @property
    def busy(self) -> bool:
        fut = self.future
        return fut is not None and not fut.done()

    def settle(self, deadline: Deadline, what: str, version: int) -> None:
        """Under ``lock``: waits until the publish in flight (of ``version``), if any, is done; its
        outcome is its future's. ``WaitTimeout`` at ``deadline``."""
        fut = self.future
        if fut is None:
            return
        done, _ = wait_futures([fut], timeout=deadline.left())
        if not done:
            raise WaitTimeout(
                f"{self.who}: {what} timed out waiting for the publish of version {version} still in flight"
            )
        self.future = None

    def submit(self, deadline: Deadline, fn: Callable[..., int], *args: Any) -> Future[int]:
        """Under ``lock``, once settled: runs ``fn(*args)`` on the worker thread, bounded by ``deadline``."""
        if self._worker is None:
            name = f"wbridge-publish-{self.channel}-{self.rank}"
            self._worker = ThreadPoolExecutor(1, thread_name_prefix=name)
        fut = self._worker.submit(self._run, fn, *args)
        self.future, self.deadline = fut, deadline
        return fut

    def _run(self, fn: Callable[..., int], *args: Any) -> int:
        self._ident = threading.get_ident()
        return fn(*args)

    def check_stopped(self, v: int | None = None) -> None:
        """``UsageError`` once ``close()`` began (``v``: the version being published)."""
        if self.stop.is_set():
            during = f" while publishing version {v}" if v is not None else ""
            raise UsageError(f"{self.who} of channel {self.channel!r} closed{during}")

    def close(self) -> None:
        """Tells the publish in flight to stop waiting on subscribers, gives it ``CLOSE_WAIT_S`` to
        finish, and shuts the worker down; no publish starts from here on."""
        self.stop.set()
        started = self.lock.acquire(timeout=CLOSE_WAIT_S)
        try:
            fut = self.future
            if fut is not None and not wait_futures([fut], timeout=CLOSE_WAIT_S).done:
                log.warning("%s: closing with a publish still in flight", self.who)
            worker, self._worker = self._worker, None
            if worker is not None:
                # not from the worker itself (a finalizer may run there): it cannot join itself
                own = threading.get_ident() == self._ident
                worker.shutdown(wait=(fut is None or fut.done()) and not own)
        finally:
            if started:
                self.lock.release()


__all__ = ["CLOSE_WAIT_S", "InFlight"]
