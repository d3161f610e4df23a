"""Worker processes driven by the test through a pipe: the test sends a command, the worker runs it
and answers. Every call has a timeout, and every worker is killed when the test ends."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from transports._util import free_port  # noqa: F401 (re-exported for callers)

# forkserver: one process imports torch and wbridge once, every worker is a cheap fork of it
# (spawn re-imports torch in every worker: seconds each on a loaded 2-core machine).
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "numpy", "wbridge", "wbridge.testing.synthetic", "tests.runtime.actors"])


class WorkerError(RuntimeError):
    def __init__(self, name: str, exc_type: str, text: str) -> None:
        super().__init__(f"{name}: {exc_type}\n{text}")
        self.exc_type = exc_type


def _loop(conn, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        obj = factory(*args, **kwargs)
        conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001
        conn.send(("err", (type(e).__name__, traceback.format_exc())))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        method, a, kw = msg
        try:
            conn.send(("ok", getattr(obj, method)(*a, **kw)))
        except BaseException as e:  # noqa: BLE001
            conn.send(("err", (type(e).__name__, traceback.format_exc())))
    close = getattr(obj, "close", None)
    if close:
        close()


class Worker:
    """Runs ``factory(*args, **kwargs)`` in a spawned process; ``call`` invokes its methods."""

    def __init__(
        self, name: str, factory: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any
    ) -> None:
        self.name = name
        self._conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_loop, args=(child, factory, args, kwargs), name=name, daemon=True)
        self.proc.start()
        self._pending = False
        self._result(timeout)

    def _result(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout}s (alive={self.proc.is_alive()})")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise WorkerError(self.name, "EOFError", f"worker exited with {self.proc.exitcode}") from None
        if status == "err":
            raise WorkerError(self.name, *value)
        return value

    def send(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Starts a call without waiting; collect it with ``result``."""
        self._conn.send((method, args, kwargs))

    def result(self, timeout: float = 60.0) -> Any:
        return self._result(timeout)

    def ready(self) -> bool:
        return self._conn.poll(0)

    def call(self, method: str, *args: Any, call_timeout: float = 90.0, **kwargs: Any) -> Any:
        self.send(method, *args, **kwargs)
        return self._result(call_timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
        return self.proc.exitcode


def call_all(workers: list[Worker], method: str, *args: Any, call_timeout: float = 90.0, **kwargs: Any) -> list[Any]:
    """Starts ``method`` on every worker at once (collectives), then collects every answer."""
    for w in workers:
        w.send(method, *args, **kwargs)
    deadline = time.monotonic() + call_timeout
    return [w.result(max(0.1, deadline - time.monotonic())) for w in workers]
