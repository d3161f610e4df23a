"""Objects in worker processes driven through a pipe: the driver sends a method call, the worker
runs it and answers. Every wait has a timeout; ``kill``/``stop`` end a worker. Tests, the soak and
the end-to-end benchmarks all drive their publisher and subscriber processes through this."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any


class WorkerError(RuntimeError):
    """A call failed inside a worker; carries the exception's type name and the traceback."""

    def __init__(self, name: str, exc_type: str, text: str) -> None:
        super().__init__(f"{name}: {exc_type}\n{text}")
        self.exc_type = exc_type


def _loop(conn, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        obj = factory(*args, **kwargs)
        conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001 - reported to the driver
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
        except BaseException as e:  # noqa: BLE001 - reported to the driver
            conn.send(("err", (type(e).__name__, traceback.format_exc())))
    close = getattr(obj, "close", None)
    if close:
        close()


class Worker:
    """Runs ``factory(*args, **kwargs)`` in a new process; ``call`` invokes the object's methods.

    - ``name``: shown in errors and timeouts.
    - ``factory``, ``args``, ``kwargs``: what builds the object in the worker (picklable).
    - ``timeout``: seconds to wait for the constructor; ``None`` returns at once (collect the
      constructor's answer with ``result``, e.g. to start many workers in parallel).
    - ``context``: the multiprocessing context (default: spawn).
    """

    def __init__(
        self,
        name: str,
        factory: Callable[..., Any],
        *args: Any,
        timeout: float | None = 60.0,
        context: Any = None,
        **kwargs: Any,
    ) -> None:
        self.name = name
        ctx = context or mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_loop, args=(child, factory, args, kwargs), name=name, daemon=True)
        self.proc.start()
        child.close()
        if timeout is not None:
            self.result(timeout)

    def send(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Starts a call without waiting; collect it with ``result``."""
        self._conn.send((method, args, kwargs))

    def result(self, timeout: float = 60.0) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout:.0f}s (alive={self.proc.is_alive()})")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise WorkerError(self.name, "EOFError", f"worker exited with {self.proc.exitcode}") from None
        if status == "err":
            raise WorkerError(self.name, *value)
        return value

    def ready(self) -> bool:
        return self._conn.poll(0)

    def call(self, method: str, *args: Any, call_timeout: float = 90.0, **kwargs: Any) -> Any:
        self.send(method, *args, **kwargs)
        return self.result(call_timeout)

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

    def __repr__(self) -> str:
        return f"Worker({self.name!r}, pid={self.proc.pid}, alive={self.proc.is_alive()})"


def gather(workers: Sequence[Worker], timeout: float) -> list[Any]:
    """Collects one pending answer from each worker within a shared deadline."""
    deadline = time.monotonic() + timeout
    return [w.result(max(0.1, deadline - time.monotonic())) for w in workers]


def call_all(workers: Sequence[Worker], method: str, *args: Any, call_timeout: float = 90.0, **kwargs: Any) -> list:
    """Starts ``method`` on every worker at once (collectives need that), then collects every answer."""
    for w in workers:
        w.send(method, *args, **kwargs)
    return gather(workers, call_timeout)
