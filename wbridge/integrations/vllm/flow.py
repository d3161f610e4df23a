"""The vLLM updaters' update logic as generators of engine operations, and the two drivers that
perform them.

The updaters (``updater.py``: weights; ``lora_updater.py``: LoRA adapters) write what an update
does once, as flows: generators of ``_Op`` (an RPC to the workers, a pause of the scheduler, a
sleep...). ``_SyncDriver`` performs them by calling a ``vllm.LLM``; ``_AsyncDriver`` by awaiting an
``AsyncLLM``, one flow at a time, and runs the update flow from a background task of the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ...errors import WaitTimeout
from ..base import ChannelUpdater

_T = TypeVar("_T")


@dataclass(frozen=True)
class _Op:
    """One engine operation of the update logic.

    kind: ``rpc`` (``collective_rpc(method, args=, kwargs=)``), ``pause`` / ``resume`` (the
        scheduler, around a commit), ``reset`` (the prefix cache), ``label`` (the engine's
        weight-version label, ``arg``) or ``sleep`` (``arg`` seconds).
    """

    kind: str
    method: str = ""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    arg: Any = None


_Flow = Generator[_Op, Any, Any]


class _Run:
    """One flow in progress: ``op`` is the operation it waits on (None once it has returned
    ``value``); the driver performs it and hands back its result (``send``) or error (``throw``).

    flow: the generator of ``_Op``s.
    """

    def __init__(self, flow: _Flow) -> None:
        self.flow, self.op, self.value = flow, None, None
        self._advance(flow.send, None)

    def _advance(self, how: Any, arg: Any) -> None:
        try:
            self.op = how(arg)
        except StopIteration as stop:
            self.op, self.value = None, stop.value

    def send(self, reply: Any) -> None:
        self._advance(self.flow.send, reply)

    def throw(self, error: BaseException) -> None:
        self._advance(self.flow.throw, error)

    def step(self, do: Any) -> None:
        """Performs ``op`` with ``do`` (a plain call) and hands its outcome back."""
        try:
            reply = do(self.op)
        except BaseException as e:  # noqa: BLE001 - thrown into the flow, which re-raises it
            self.throw(e)
        else:
            self.send(reply)


class _FlowUpdater(ChannelUpdater):
    """An updater whose logic is written as flows: ``_start_flow`` (subscribe the workers, wait for
    the first version) and ``_update_flow(wait, min_version)``, the subclasses'. The parameters are
    ``ChannelUpdater``'s."""

    def __init__(self, engine: Any, channel: str, store: str, **options: Any) -> None:
        super().__init__(engine, channel, store, **options)
        self.state = "new"  # as last seen: idle, pulling vN, failed..., closed
        self.error: BaseException | None = None  # what stopped the updates, raised by every later call
        self._failing_since: float | None = None  # pulls have failed since, with no update after

    def _start_flow(self) -> _Flow:
        raise NotImplementedError

    def _update_flow(self, wait: bool, min_version: int | None) -> _Flow:
        raise NotImplementedError

    def _check(self) -> None:
        """Open, and no error stopped the updates (else that error, again)."""
        self._check_open()
        if self.error is not None:
            raise self.error

    def _wait_flow(self, pending: bool, min_version: int | None, deadline: float, who: str) -> _Flow:
        """The end of one look at the workers in ``_update_flow``: True where nothing is left to
        wait for (the version is at least ``min_version``, nothing ``pending``); else a
        ``WaitTimeout`` (naming ``who``) past ``deadline``, else a sleep of ``poll`` and False."""
        behind = min_version is not None and (self.version or 0) < min_version
        if not behind and not pending:
            return True
        if time.monotonic() >= deadline:
            want = f"version {min_version}" if behind else "the pull in flight"
            raise WaitTimeout(f"{who}, channel {self.channel!r}: no {want} within {self.timeout:.1f}s")
        yield _Op("sleep", arg=self.poll)
        return False


def _describe(states: list[dict], ready: str) -> str:
    """One line for the workers' background pull states (``wbridge_staged``,
    ``wbridge_lora_staged``); ``ready``: the word for a pulled version."""
    kinds = [s["state"] for s in states]
    for kind, word in (("failed", "failed"), ("pulling", "pulling"), ("ready", ready)):
        if kind in kinds:
            s = states[kinds.index(kind)]
            return f"failed: {s['error']}" if kind == "failed" else f"{word} v{s['version']}"
    return "idle"


class _SyncDriver(_FlowUpdater):
    """Performs the flows by calling a ``vllm.LLM`` (``_do``, the subclass's: one operation).
    Construction runs the start flow; where it fails, the subclass's ``close``. The parameters are
    ``ChannelUpdater``'s, ``llm`` its ``engine``."""

    def __init__(self, llm: Any, channel: str, store: str, **options: Any) -> None:
        super().__init__(llm, channel, store, **options)
        self.llm = llm
        try:
            self._drive(self._start_flow())
        except BaseException:
            self.close()
            raise

    def _do(self, op: _Op) -> Any:
        raise NotImplementedError

    def _drive(self, flow: _Flow) -> Any:
        run = _Run(flow)
        while run.op is not None:
            run.step(self._do)
        return run.value

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _AsyncDriver(_FlowUpdater):
    """Performs the flows by awaiting an ``AsyncLLM`` (``_do``, the subclass's: one operation), one
    flow at a time (``_locked``), and runs the update flow from a background task (``_task``, made by
    ``_start_once``; a failed start awaits the subclass's ``close``; ``async with`` awaits its
    ``start``). ``_background``: the task's name prefix, and what the log line calls the updater and
    its work when an error stops the task (the error is kept in ``error``). The parameters are
    ``ChannelUpdater``'s."""

    _background: tuple[str, str, str]  # the task's name prefix, the updater's name, its work
    _task: asyncio.Task | None = None  # the background updates
    _starting: asyncio.Task | None = None  # the start's work, awaited by every caller
    _lock: asyncio.Lock | None = None  # made by the start, in the running loop

    async def _do(self, op: _Op) -> Any:
        raise NotImplementedError

    async def _drive(self, flow: _Flow) -> Any:
        run = _Run(flow)
        while run.op is not None:
            try:
                reply = await self._do(run.op)
            except BaseException as e:  # noqa: BLE001 - thrown into the flow, which re-raises it
                run.throw(e)
            else:
                run.send(reply)
        return run.value

    async def _locked(self, flow: _Flow) -> Any:
        async with self._lock:
            return await self._drive(flow)

    async def _start_once(self) -> int:
        """The start flow, then the background task; idempotent: concurrent first callers all wait
        for the first version. Returns the version."""
        self._check_open()
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._starting)
        return self.version

    async def _start(self) -> None:
        self._lock = asyncio.Lock()
        try:
            await self._locked(self._start_flow())
        except BaseException:
            await self.close()
            raise
        name = f"{self._background[0]}-{self.channel}"
        self._task = asyncio.get_running_loop().create_task(self._updates(), name=name)

    async def _updates(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.poll)
                await self._locked(self._update_flow(wait=False, min_version=None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - raised by the next generate() / update()
            _, who, work = self._background
            log = logging.getLogger(type(self).__module__)
            log.warning("wbridge: the %s of channel %r stopped %s: %s", who, self.channel, work, e)
            self.error = e

    async def _stop_updates(self) -> None:
        """Cancels the background task, never in the middle of a flow, and waits for its end."""
        if self._task is not None:
            async with self._lock:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def __aenter__(self: _T) -> _T:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
