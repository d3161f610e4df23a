"""vLLM workers serving LoRA adapter channels: each pulls the newest adapter in the background and
installs it between two engine steps, from memory (no file on either side).

Each adapter channel (``wbridge.integrations.lora``) a worker subscribes to gets two LoRA ids in
the engine and a ``_Channel``: a ``Subscriber`` whose destination is the adapter's A/B tensors
(allocated from the channel's metadata), and a watcher thread (``wbridge.integrations.follow.Watcher``) that pulls each
newly committed version and builds vLLM's adapter object from the pulled tensors
(``lora_internals.build``) while the engine generates. ``wbridge_lora_install`` (an engine RPC:
it runs between two steps) puts the staged adapter under the id the newest version does not hold,
so requests still running on the old version keep their adapter until they finish and no KV block
computed with one version is reused by another (vLLM keys cached blocks by the adapter's name and
path, which name the version). The updaters (``lora_updater``) drive these RPCs and hand out the
``LoRARequest`` of the newest version.

Every vLLM internal this takes lives in ``lora_internals``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ...errors import UsageError, WBridgeError
from ..follow import Watcher
from ..lora import LoRAAdapter
from . import lora_internals as vl

log = logging.getLogger(__name__)

#: LoRA ids wbridge gives its adapters: ``ID_BASE + 2 * k`` and ``+ 1`` for the k-th channel a
#: worker subscribes to (far above the small ids users give adapters they load from files)
ID_BASE = 1 << 30


def _base_shapes(worker: Any) -> dict[str, tuple[int, ...]]:
    from ..transformers import config_shapes

    cfg = getattr(worker, "vllm_config", None) or worker.model_runner.vllm_config
    return config_shapes(cfg.model_config.hf_config)


class _Channel:
    """One adapter channel of a vLLM worker: its subscriber, pulled tensors, the adapter built from
    them and not installed yet (``staged``), and what the engine holds (``installed``).

    worker: the vLLM worker (its LoRA manager is where adapters go).
    channel: the channel name.
    ids: the two LoRA ids this channel's versions alternate between.
    subscriber: the registered-to-be ``Subscriber`` (joined here once the adapter is known).
    timeout: seconds a pull may take, and that the metadata is waited for.
    """

    def __init__(self, worker: Any, channel: str, ids: tuple[int, int], subscriber: Any, timeout: float) -> None:
        self.worker, self.channel, self.ids, self.sub, self.timeout = worker, channel, ids, subscriber, timeout
        self.lock = threading.Lock()
        self.installed: tuple[int, int] | None = None  # (version, id) the engine serves
        self.staged: tuple[int, Any] | None = None  # (version, LoRAModel) pulled, not installed
        self.pulling: int | None = None
        self.error: str | None = None
        self.history: list[dict[str, Any]] = []
        self._pending: dict[str, Any] = {}  # the staged version's pull stats
        self.adapter: LoRAAdapter | None = None
        self.staging: dict[str, Any] = {}
        self._join(LoRAAdapter.from_metadata(subscriber.metadata(timeout), channel))
        self.watcher = Watcher(subscriber.wait_version, self._floor, self._pull, give_up_s=timeout)
        self.watcher.start()

    def _join(self, adapter: LoRAAdapter) -> None:
        """Checks ``adapter`` against the engine and (re)registers its tensors as the destination."""
        lim = vl.limits(self.worker)
        adapter.check_base(_base_shapes(self.worker), lim.supported, lim.max_rank, f"LoRA channel {self.channel!r}")
        staging = adapter.allocate()
        self.sub.register(adapter.entries(staging))
        self.adapter, self.staging = adapter, staging

    def _floor(self) -> int:
        with self.lock:
            return max((self.installed or (0, 0))[0], (self.staged or (0, None))[0])

    def _target(self) -> int:
        """The id the next version goes to: the one the installed version does not hold."""
        held = self.installed[1] if self.installed else self.ids[1]
        return self.ids[0] if held == self.ids[1] else self.ids[1]

    def _pull(self, want: int) -> bool:
        """On the watcher's thread: pulls ``want`` or newer and builds its adapter; a failure goes
        to the watcher (retried after its backoff, or it stops on a deterministic one)."""
        self.pulling = want
        try:
            adapter = LoRAAdapter.from_metadata(self.sub.metadata(self.timeout), self.channel)
            if adapter != self.adapter:  # the trainers registered another adapter (a new rank, say)
                self._join(adapter)
            t0 = time.perf_counter()
            v = self.sub.pull(min_version=want, timeout=self.timeout)
            t1 = time.perf_counter()
            lora = vl.build(self.worker, self._target(), self.staging, self.adapter.peft_config)
            last = self.sub.stats.last
            stats = {
                "version": v,
                "nbytes": last.nbytes if last else 0,
                "delta": bool(last and last.delta),
                "pull_s": t1 - t0,
                "build_s": time.perf_counter() - t1,
                "staged_at": time.time(),
            }
            with self.lock:
                self.staged, self._pending, self.error = (v, lora), stats, None
            self.watcher.succeeded()
        except Exception as e:  # noqa: BLE001 - reported through wbridge_lora_staged; pulled again later
            self.error = f"{type(e).__name__}: {e}"
            log.warning("wbridge LoRA channel %r: the pull failed: %s", self.channel, self.error)
            self.watcher.failed(e)
        finally:
            self.pulling = None
        return True

    def state(self) -> dict[str, Any]:
        with self.lock:
            held = self.installed[0] if self.installed else None
            out = {"state": "idle", "version": None, "error": self.error, "held": held}
            if self.watcher.error is not None:
                out.update(state="failed", error=f"the channel watcher stopped: {self.watcher.error}")
            elif self.staged is not None:
                out.update(state="ready", version=self.staged[0])
            elif self.pulling is not None:
                out.update(state="pulling", version=self.pulling)
            elif self.error is not None:
                out.update(state="failed")
            return out

    def install(self, version: int) -> dict[str, Any]:
        """Between two steps: the staged ``version`` into the engine; returns its id."""
        with self.lock:
            if self.staged is None or self.staged[0] != version:
                have = None if self.staged is None else self.staged[0]
                raise UsageError(f"LoRA channel {self.channel!r}: version {version} is not staged (staged: {have})")
            (v, lora), stats, target = self.staged, self._pending, self._target()
            t0 = time.perf_counter()
            vl.install(self.worker, lora, target)
            self.installed, self.staged = (v, target), None
            self.history.append({**stats, "install_s": time.perf_counter() - t0, "id": target})
            del self.history[:-64]
        self.watcher.poke()
        return {"version": v, "id": target}

    def __repr__(self) -> str:
        return (
            f"_Channel({self.channel!r}, ids={self.ids}, installed={self.installed}, "
            f"staged={None if self.staged is None else self.staged[0]}, error={self.error!r})"
        )

    def close(self) -> None:
        """Stops the watcher, leaves the channel and drops this channel's adapters from the engine."""
        self.watcher.close()
        try:
            self.sub.close()
        except WBridgeError as e:  # the publishers (and their store) may be gone already
            log.warning("wbridge LoRA channel %r: closing the subscriber: %s", self.channel, e)
        held = vl.installed(self.worker)
        for i in self.ids:
            if i in held:
                vl.remove(self.worker, i)


class LoRAState:
    """A worker's adapter channels (one attribute on the worker: ``_wbridge_lora``).

    channels: channel name -> its ``_Channel``.
    next_slot: the k of the next channel's ids (``ID_BASE + 2k``, ``+ 1``).
    """

    def __init__(self) -> None:
        self.channels: dict[str, _Channel] = {}
        self.next_slot = 0

    def __repr__(self) -> str:
        return f"LoRAState(channels={list(self.channels.values())}, next_slot={self.next_slot})"


class LoRAWorkerMixin:
    """The adapter-channel RPCs of ``WBridgeWorkerExtension`` (``collective_rpc``, every rank)."""

    def _wbridge_lora_state(self) -> LoRAState:
        state = getattr(self, "_wbridge_lora", None)
        if state is None:
            state = self._wbridge_lora = LoRAState()
        return state

    def _wbridge_lora_channel(self, channel: str) -> _Channel:
        ch = self._wbridge_lora_state().channels.get(channel)
        if ch is None:
            raise UsageError(f"wbridge LoRA: not subscribed to channel {channel!r} (wbridge_lora_subscribe)")
        return ch

    def wbridge_lora_subscribe(
        self, channel: str, store: str, token: str | None = None, timeout: float = 60.0, **subscriber_kwargs: Any
    ) -> dict[str, Any]:
        """Joins the adapter channel ``channel``: reads its adapter from the channel's metadata
        (waiting at most ``timeout`` for the trainers to register), checks the engine can serve
        it, allocates its tensors and starts pulling; returns ``{"ids": [a, b], "adapter":
        <metadata>, "nbytes": ...}``, or ``{"refused": message}`` for an adapter the engine cannot
        serve (the updater raises it as the ``UsageError`` it is: vLLM's RPC keeps only messages)."""
        import os

        from ...subscriber import Subscriber

        state = self._wbridge_lora_state()
        if channel in state.channels:
            self.wbridge_lora_close(channel)
        try:
            lim = vl.limits(self)
            if 2 * (len(state.channels) + 1) > lim.capacity:
                raise UsageError(
                    f"wbridge LoRA: channel {channel!r} would be adapter channel {len(state.channels) + 1}, and "
                    f"each keeps two adapters in the engine: max_cpu_loras={lim.capacity} holds {lim.capacity // 2}"
                )
            rank = int(getattr(self, "rank", 0))
            kw = {"name": f"vllm-lora-{channel}-rank{rank}-{os.getpid()}", **subscriber_kwargs}
            sub = Subscriber(channel, store, token=token, **kw)
            ids = (ID_BASE + 2 * state.next_slot, ID_BASE + 2 * state.next_slot + 1)
            try:
                ch = _Channel(self, channel, ids, sub, timeout)
            except BaseException:
                sub.close()
                raise
        except UsageError as e:
            return {"refused": str(e)}
        state.next_slot += 1
        state.channels[channel] = ch
        return {"ids": list(ids), "adapter": ch.adapter.metadata, "nbytes": ch.adapter.nbytes}

    def wbridge_lora_staged(self, channel: str) -> dict[str, Any]:
        """The channel's background pull: ``{"state", "version", "error", "held"}``, ``state`` one
        of ``idle``, ``pulling``, ``ready`` (``version`` staged: ``wbridge_lora_install`` puts it
        in at once), ``failed`` (``error`` says why; the watcher pulls again); ``held``: the
        version the engine serves."""
        return self._wbridge_lora_channel(channel).state()

    def wbridge_lora_install(self, channel: str, version: int) -> dict[str, Any]:
        """Installs the staged ``version`` (between two steps); returns ``{"version", "id"}``."""
        return self._wbridge_lora_channel(channel).install(version)

    def wbridge_lora_stats(self, channel: str) -> list[dict[str, Any]]:
        """One dict per installed version: ``version``, ``nbytes`` read, ``delta``, ``pull_s``,
        ``build_s`` (the adapter built from the tensors, in the background), ``install_s`` (the
        pause between steps), ``id``."""
        return [dict(h) for h in self._wbridge_lora_channel(channel).history]

    def wbridge_lora_digests(self, channel: str) -> dict[str, str]:
        """SHA-256 of each tensor of the channel's last pull (canonical names; JSON-safe)."""
        import hashlib

        import torch

        return {
            k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in self._wbridge_lora_channel(channel).staging.items()
        }

    def wbridge_lora_internals(self) -> list[str]:
        """The vLLM internals of ``lora_internals.INTERNALS`` this engine lacks (empty: none)."""
        return vl.check(self)

    def wbridge_lora_close(self, channel: str | None = None) -> None:
        """Leaves ``channel`` (None: every adapter channel) and drops its adapters from the engine
        (idempotent)."""
        state = self._wbridge_lora_state()
        for name in [channel] if channel is not None else list(state.channels):
            ch = state.channels.pop(name, None)
            if ch is not None:
                ch.close()
