"""Keeps a named LoRA adapter of a vLLM engine (``LLM`` or ``AsyncLLM``) on the newest version of
an adapter channel, with no file written (the workers' side: ``lora``).

Usage::

    llm = LLM(model=base, enable_lora=True, max_lora_rank=8, max_cpu_loras=4,
              worker_extension_cls=EXTENSION)
    with VLLMLoRAUpdater(llm, "policy-lora", "tcp://trainer:29700", token=token) as lora:
        for version, out in lora.generate(prompts, params): ...      # on the newest adapter
        llm.generate(prompts, params, lora_request=lora.lora_request)  # the same, by hand

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=base, enable_lora=True, ...))
    async with AsyncVLLMLoRAUpdater(engine, "policy-lora", store, token=token) as lora:
        async for version, out in lora.generate(prompt, params): ...

Several updaters (several channels) may share one engine: each keeps its own adapter, under its
own ids. The workers pull each new version in the background and build the adapter from the
pulled tensors; the updater installs it between two engine steps (``VLLMLoRAUpdater`` before each
``generate``, ``AsyncVLLMLoRAUpdater`` from a task of the event loop) and from then on hands out
its ``LoRARequest``: name ``<name>@v<version>``, one of the channel's two ids, and a path that
names the version (``wbridge://<channel>/v<version>``, no file: vLLM never reads it, the adapter is
already loaded). A version goes to the id the current one does not hold, so requests still running
on the old version finish on it, every output is tagged with the one version that produced it, and
no cached KV block crosses versions. The async updater installs a version only while none of its
own requests runs on that id's older version (a request sent with a ``LoRARequest`` taken by hand
should finish before two newer versions are installed).

The engine needs ``enable_lora=True``, ``max_lora_rank`` at least the adapter's rank,
``max_cpu_loras`` at least two per adapter channel (plus what it loads from files), and
``max_loras`` at least two to run two versions of one adapter in one batch (else the newer waits).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ...errors import UsageError, WBridgeError
from ..base import AdapterUpdater
from .flow import _AsyncDriver, _describe, _Flow, _FlowUpdater, _Op, _SyncDriver


class _LoRAUpdater(AdapterUpdater, _FlowUpdater):
    """The update logic both LoRA updaters share, as generators of engine operations
    (``flow._Op``: ``rpc`` and ``sleep`` only); the parameters are the subclasses'."""

    def __init__(self, engine: Any, channel: str, store: str, **options: Any) -> None:
        super().__init__(engine, channel, store, **options)
        self.lora_id: int | None = None
        self.ids: tuple[int, ...] = ()
        self.adapter: dict[str, Any] = {}  # the channel's adapter metadata
        self._running: dict[int, int] = {}  # id -> this updater's requests running on it

    @property
    def lora_request(self) -> Any:
        """The ``LoRARequest`` of the newest installed version (None before the first)."""
        if self.version is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(
            lora_name=self.adapter_name(self.version),
            lora_int_id=self.lora_id,
            lora_path=f"wbridge://{self.channel}/v{self.version}",
        )

    def _start_flow(self) -> _Flow:
        channel, store, kwargs = self._subscription
        kwargs = {**kwargs, "timeout": self.timeout}
        (info, *_) = yield _Op("rpc", "wbridge_lora_subscribe", args=(channel, store), kwargs=kwargs)
        if "refused" in info:
            raise UsageError(info["refused"])
        self.ids, self.adapter = tuple(info["ids"]), info["adapter"]
        return (yield from self._update_flow(wait=True, min_version=1))

    def _update_flow(self, wait: bool, min_version: int | None) -> _Flow:
        """Installs a staged version; waits for one in flight (``wait``) or until at least
        ``min_version`` is installed; returns the installed version."""
        deadline = time.monotonic() + self.timeout
        while True:
            states = yield _Op("rpc", "wbridge_lora_staged", args=(self.channel,))
            kinds = {s["state"] for s in states}
            versions = sorted({s["version"] for s in states if s["state"] == "ready"})
            if kinds == {"ready"} and len(versions) == 1 and not self._busy():
                done = yield _Op("rpc", "wbridge_lora_install", args=(self.channel, versions[0]))
                if {d["id"] for d in done} != {done[0]["id"]}:
                    raise WBridgeError(f"LoRA channel {self.channel!r}: vLLM workers installed {done}")
                self.version, self.lora_id = versions[0], done[0]["id"]
                self.state, self._failing_since = "idle", None
                if min_version is None or self.version >= min_version:
                    return self.version
                continue
            if "failed" in kinds and "pulling" not in kinds and "ready" not in kinds:
                rank, failed = next((i, s) for i, s in enumerate(states) if s["state"] == "failed")
                self.state = f"failed: {failed['error']}"
                err = f"vLLM worker rank {rank}, LoRA channel {self.channel!r}: {failed['error']}"
                now = time.monotonic()
                self._failing_since = self._failing_since or now
                if "watcher stopped" in (failed["error"] or "") or now - self._failing_since >= self.timeout:
                    raise WBridgeError(err)
            else:
                self.state = _describe(states, ready="ready")
            pending = bool(wait and kinds & {"pulling", "ready"})
            if (yield from self._wait_flow(pending, min_version, deadline, "vLLM LoRA updater")):
                return self.version

    def _busy(self) -> bool:
        """Whether requests of this updater still run on the id the next version goes to."""
        if not self.ids:
            return False
        target = self.ids[0] if self.lora_id == self.ids[1] or self.lora_id is None else self.ids[1]
        return self._running.get(target, 0) > 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.channel!r}, name={self.name!r}, version={self.version}, {self.state})"


class VLLMLoRAUpdater(_SyncDriver, _LoRAUpdater):
    """Keeps a named LoRA adapter of a vLLM ``LLM`` on the newest version of an adapter channel.

    - ``llm``: a ``vllm.LLM`` started with ``enable_lora=True`` and ``worker_extension_cls=EXTENSION``.
    - ``channel``: the adapter channel (``wbridge.integrations.lora.from_peft(...).register(pub)``).
    - ``store``: the store URL (``tcp://host:port`` or ``etcd://...``).
    - ``token``: the channel's shared secret (None: unsigned, unauthenticated).
    - ``name``: the adapter's name in requests (``<name>@v<version>``; default: the channel).
    - ``timeout``: seconds to wait for the adapter's metadata, the first version and each pull.
    - ``poll``: seconds between two looks at the workers while ``update`` waits.
    - ``subscriber_options``: more ``Subscriber`` keywords for the workers' subscribers.

    Construction subscribes the workers and waits for the first version.
    """

    def _do(self, op: _Op) -> Any:
        if op.kind == "rpc":
            return self.llm.collective_rpc(op.method, args=op.args, kwargs=op.kwargs)
        return time.sleep(op.arg)

    def update(self, wait: bool = False, min_version: int | None = None) -> int | None:
        """Installs the version the workers have staged and returns the installed version;
        ``wait=True`` also waits for a pull in flight; ``min_version`` waits (at most ``timeout``)
        until at least that version is installed."""
        self._check_open()
        return self._drive(self._update_flow(wait, min_version))

    def generate(self, prompts: Any, params: Any, **kwargs: Any) -> list[tuple[int, Any]]:
        """``llm.generate`` on the newest adapter (after ``update()``): ``[(version, RequestOutput)]``."""
        v = self.update()
        req = self.lora_request
        return [(v, out) for out in self.llm.generate(prompts, params, lora_request=req, use_tqdm=False, **kwargs)]

    def stats(self) -> list[dict]:
        """One dict per installed version (rank 0's): ``version``, ``nbytes``, ``delta``,
        ``pull_s``, ``build_s``, ``install_s``, ``id``."""
        return self.llm.collective_rpc("wbridge_lora_stats", args=(self.channel,))[0]

    def close(self) -> None:
        """Leaves the channel and drops its adapters from the engine (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.state = "closed"
        self.llm.collective_rpc("wbridge_lora_close", args=(self.channel,))


class AsyncVLLMLoRAUpdater(_AsyncDriver, _LoRAUpdater):
    """Keeps a named LoRA adapter of a vLLM ``AsyncLLM`` on the newest version of an adapter
    channel: the workers pull in the background and a task of the event loop installs each version
    between two engine steps.

    - ``engine``: an ``AsyncLLM`` started with ``enable_lora=True`` and ``worker_extension_cls=EXTENSION``.
    - ``channel``: the adapter channel.
    - ``store``: the store URL.
    - ``token``: the channel's shared secret.
    - ``name``: the adapter's name in requests (default: the channel).
    - ``timeout``: seconds to wait for the metadata, the first version and each pull.
    - ``poll``: seconds between two looks at the workers (one RPC, served between engine steps).
    - ``subscriber_options``: more ``Subscriber`` keywords for the workers' subscribers.

    ``start()`` (or ``async with``, or the first ``generate``) subscribes and waits for the first version.
    """

    _background = ("wbridge-lora", "vLLM LoRA updater", "installing")

    async def _do(self, op: _Op) -> Any:
        if op.kind == "rpc":
            return await self.engine.collective_rpc(op.method, args=op.args, kwargs=op.kwargs)
        return await asyncio.sleep(op.arg)

    async def start(self) -> int:
        """Subscribes the workers, waits for the first version and installs it, then installs each
        new version from a background task; returns the version. Idempotent."""
        return await self._start_once()

    async def update(self, wait: bool = False, min_version: int | None = None) -> int | None:
        """What the background task does, now (see ``VLLMLoRAUpdater.update``)."""
        await self.start()
        self._check()
        return await self._locked(self._update_flow(wait, min_version))

    async def generate(
        self, prompt: Any, params: Any, request_id: str | None = None, **kwargs: Any
    ) -> AsyncIterator[tuple[int, Any]]:
        """``engine.generate`` on the newest adapter (``kwargs`` passed on), each output with the
        adapter version that produced all of it."""
        await self.start()
        self._check()
        v, lora_id, req = self.version, self.lora_id, self.lora_request
        self._running[lora_id] = self._running.get(lora_id, 0) + 1
        try:
            request_id = request_id or f"wbridge-lora-{uuid.uuid4().hex}"
            async for out in self.engine.generate(prompt, params, request_id, lora_request=req, **kwargs):
                yield v, out
        finally:
            self._running[lora_id] -= 1

    async def stats(self) -> list[dict]:
        """As ``VLLMLoRAUpdater.stats``."""
        return (await self.engine.collective_rpc("wbridge_lora_stats", args=(self.channel,)))[0]

    async def close(self) -> None:
        """Stops the background installs, leaves the channel and drops its adapters (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stop_updates()
        finally:
            self.state = "closed"
            await self.engine.collective_rpc("wbridge_lora_close", args=(self.channel,))
