"""Keeps a named LoRA adapter of an SGLang engine on the newest version of an adapter channel,
through SGLang's in-memory adapter loading (no file on either side).

Usage (the offline ``sgl.Engine``, in the process that holds it)::

    engine = sgl.Engine(model_path=base, enable_lora=True, max_lora_rank=8,
                        lora_target_modules=["all"], ...)
    with SGLangLoRAUpdater(engine, "policy-lora", "tcp://trainer:29700", token=token) as lora:
        version, out = lora.generate(input_ids=ids, sampling_params={...})   # the newest adapter
        engine.generate(input_ids=ids, lora_path=lora.lora_path, ...)        # the same, by hand

A ``Subscriber`` in this process reads the adapter's config from the channel's metadata, allocates
its tensors and pulls each newly committed version on a watcher thread (``wbridge.integrations.follow.Watcher``,
the same one vLLM's workers run), into a copy of its own. ``update()`` (and so each ``generate``)
installs a pulled version with SGLang's public ``Engine.load_lora_adapter_from_tensors`` under
the name ``<name>@v<version>``: the scheduler loads it between two steps, from memory (SGLang
passes the tensors to its scheduler in shared memory). Outputs are tagged with the version that
produced them; the version before stays loaded until the next install (requests still running on
it finish there), older ones are unloaded. Several updaters (channels) may share one engine.

The engine needs ``enable_lora=True``, ``max_lora_rank`` at least the adapter's rank,
``lora_target_modules`` covering the adapter's modules (or ``["all"]``) and ``max_loaded_loras``
None or at least two per adapter channel; an adapter that does not fit (or targets a module the
engine lacks) is a ``UsageError`` naming the module, raised at construction. That check reads the
engine's ``server_args`` and two SGLang names: ``sglang.srt.lora.utils.get_normalized_target_modules``
and ``sglang.srt.utils.common.SUPPORTED_LORA_TARGET_MODULES``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ...errors import UsageError, WaitTimeout, WBridgeError
from ..base import AdapterUpdater
from ..lora import LoRAAdapter

log = logging.getLogger("wbridge.sglang")


def engine_limits(engine: Any) -> tuple[int, set[str] | None, Any]:
    """``(max_lora_rank, the modules the engine adapts or None for all, max_loaded_loras)`` of an
    ``sgl.Engine``, from its server arguments; a ``UsageError`` where LoRA is off."""
    args = engine.server_args
    if not getattr(args, "enable_lora", False):
        raise UsageError("wbridge SGLang LoRA: start the engine with enable_lora=True")
    if not args.max_lora_rank or not args.lora_target_modules:
        raise UsageError("wbridge SGLang LoRA: start the engine with max_lora_rank and lora_target_modules")
    targets = set(args.lora_target_modules)
    return int(args.max_lora_rank), (None if targets & {"all", "all-linear"} else targets), args.max_loaded_loras


def check_engine(engine: Any, adapter: LoRAAdapter, who: str) -> None:
    """Refuses an adapter the engine cannot serve, naming the module (``LoRAAdapter.check_base``
    against the engine's base model config and LoRA arguments)."""
    from sglang.srt.lora.utils import get_normalized_target_modules
    from sglang.srt.utils.common import SUPPORTED_LORA_TARGET_MODULES
    from transformers import AutoConfig

    from ..transformers import config_shapes

    max_rank, targets, loaded = engine_limits(engine)
    if loaded is not None and loaded < 2:
        raise UsageError(f"{who}: max_loaded_loras={loaded}; wbridge keeps two versions of each adapter loaded")
    allowed = get_normalized_target_modules(SUPPORTED_LORA_TARGET_MODULES if targets is None else targets)
    names = set(SUPPORTED_LORA_TARGET_MODULES) | {m.rsplit(".", 1)[-1] for m in adapter.modules}
    supported = {n for n in names if get_normalized_target_modules([n]) <= allowed}
    base = config_shapes(AutoConfig.from_pretrained(engine.server_args.model_path))
    adapter.check_base(base, supported, max_rank, who)


class SGLangLoRAUpdater(AdapterUpdater):
    """Keeps a named LoRA adapter of an ``sgl.Engine`` on the newest version of an adapter channel.

    - ``engine``: an ``sgl.Engine`` started with ``enable_lora=True`` (see the module docstring).
    - ``channel``: the adapter channel (``wbridge.integrations.lora.from_peft(...).register(pub)``).
    - ``store``: the store URL (``tcp://host:port`` or ``etcd://...``).
    - ``token``: the channel's shared secret (None: unsigned, unauthenticated).
    - ``name``: the adapter's name in requests (``<name>@v<version>``; default: the channel).
    - ``timeout``: seconds to wait for the adapter's metadata, the first version and each pull.
    - ``poll``: seconds between two looks while ``update`` waits for a pull.
    - ``subscriber_options``: more ``Subscriber`` keywords (``transport``, ``name``...).

    Construction joins the channel and installs the first version (waiting for it). Call it from
    the thread that drives the engine (SGLang's engine calls run its event loop there).
    """

    def __init__(self, engine: Any, channel: str, store: str, **options: Any) -> None:
        from ...subscriber import Subscriber
        from ..follow import Watcher

        super().__init__(engine, channel, store, **options)
        self.loaded: list[int] = []  # versions loaded in the engine, oldest first
        self.history: list[dict[str, Any]] = []
        self.error: str | None = None  # the last failed pull
        self._lock = threading.Lock()
        self._staged: tuple[int, dict[str, Any], dict[str, Any]] | None = None  # (version, tensors, stats)
        channel, store, subscriber_options = self._subscription
        self.sub = Subscriber(channel, store, **subscriber_options)
        self.watcher = None
        try:
            self.adapter = LoRAAdapter.from_metadata(self.sub.metadata(self.timeout), channel)
            check_engine(engine, self.adapter, f"LoRA channel {channel!r}")
            self.staging = self.adapter.allocate()
            self.sub.register(self.adapter.entries(self.staging))
            self.watcher = Watcher(self.sub.wait_version, self._floor, self._pull, give_up_s=self.timeout)
            self.watcher.start()
            self.update(wait=True, min_version=1)
        except BaseException:
            self.close()
            raise

    @property
    def lora_path(self) -> str | None:
        """The adapter name of the newest installed version (SGLang's ``lora_path`` argument)."""
        return None if self.version is None else self.adapter_name(self.version)

    def _floor(self) -> int:
        with self._lock:
            return max(self.version or 0, self._staged[0] if self._staged else 0)

    def _pull(self, want: int) -> bool:
        """On the watcher's thread: pulls ``want`` or newer into a copy of its own; a failure goes
        to the watcher (retried after its backoff, or it stops on a deterministic one)."""
        try:
            t0 = time.perf_counter()
            v = self.sub.pull(min_version=want, timeout=self.timeout)
            tensors = {k: t.clone() for k, t in self.staging.items()}  # SGLang keeps what it is given
            last = self.sub.stats.last
            stats = {"version": v, "nbytes": last.nbytes if last else 0, "delta": bool(last and last.delta)}
            stats["pull_s"] = time.perf_counter() - t0
            with self._lock:
                self._staged, self.error = (v, tensors, stats), None
            self.watcher.succeeded()
        except Exception as e:  # noqa: BLE001 - reported by update(); pulled again
            self.error = f"{type(e).__name__}: {e}"
            log.warning("wbridge SGLang LoRA channel %r: the pull failed: %s", self.channel, self.error)
            self.watcher.failed(e)
        return True

    def update(self, wait: bool = False, min_version: int | None = None) -> int | None:
        """Installs a pulled version and returns the installed one; ``wait=True`` waits for a pull
        in flight too, ``min_version`` (at most ``timeout``) until at least that one is installed."""
        self._check_open()
        deadline = time.monotonic() + self.timeout
        while True:
            with self._lock:
                staged, self._staged = self._staged, None
            if staged is not None:
                self._install(*staged)
                continue
            behind = min_version is not None and (self.version or 0) < min_version
            if not behind and not wait:
                return self.version
            if self.watcher is not None and self.watcher.error is not None:
                raise WBridgeError(f"LoRA channel {self.channel!r}: the channel watcher stopped: {self.watcher.error}")
            if time.monotonic() >= deadline:
                why = f"; the last pull failed: {self.error}" if self.error else ""
                raise WaitTimeout(f"SGLang LoRA updater, channel {self.channel!r}: no new version within "
                                  f"{self.timeout:.1f}s{why}")  # fmt: skip
            if wait and not behind and self.sub.latest() in (None, self.version):
                return self.version
            time.sleep(self.poll)

    def _install(self, v: int, tensors: dict[str, Any], stats: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        res = self.engine.load_lora_adapter_from_tensors(self.adapter_name(v), tensors, dict(self.adapter.peft_config))
        if not getattr(res, "success", False):
            raise WBridgeError(f"LoRA channel {self.channel!r}: SGLang refused version {v}: {res.error_message}")
        self.version = v
        self.loaded.append(v)
        while len(self.loaded) > 2:  # the version before stays for requests still running on it
            old = self.loaded.pop(0)
            self.engine.unload_lora_adapter(self.adapter_name(old))
        self.history.append({**stats, "install_s": time.perf_counter() - t0})
        del self.history[:-64]
        if self.watcher is not None:
            self.watcher.poke()

    def generate(self, **kwargs: Any) -> tuple[int, Any]:
        """``engine.generate(**kwargs)`` on the newest adapter (after ``update()``): ``(version, output)``."""
        v = self.update()
        return v, self.engine.generate(lora_path=self.lora_path, **kwargs)

    def stats(self) -> list[dict[str, Any]]:
        """One dict per installed version: ``version``, ``nbytes`` read, ``delta``, ``pull_s``,
        ``install_s`` (SGLang's load between steps, as the caller waited for it)."""
        return [dict(h) for h in self.history]

    def close(self) -> None:
        """Stops pulling, leaves the channel and unloads this channel's adapters (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.watcher is not None:
            self.watcher.close()
        try:
            self.sub.close()
        except WBridgeError as e:  # the publishers (and their store) may be gone already
            log.warning("wbridge SGLang LoRA channel %r: closing the subscriber: %s", self.channel, e)
        for v in self.loaded:
            self.engine.unload_lora_adapter(self.adapter_name(v))
        self.loaded = []

    def __enter__(self) -> SGLangLoRAUpdater:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"version={self.version}"
        return f"SGLangLoRAUpdater({self.channel!r}, name={self.name!r}, {state})"
