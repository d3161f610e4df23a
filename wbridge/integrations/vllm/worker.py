"""vLLM rollout workers as wbridge subscribers.

Usage::

    llm = LLM(model=path, worker_extension_cls="wbridge.integrations.vllm.WBridgeWorkerExtension")
    llm.collective_rpc("wbridge_subscribe", args=("policy", "tcp://trainer:29700"), kwargs={"token": "..."})
    v = llm.collective_rpc("wbridge_pull", kwargs={"timeout": 60.0})[0]   # after each trainer publish
    llm.reset_prefix_cache()      # cached KV blocks were computed with the old weights

The same machinery is offered as vLLM's weight-transfer backend ``"wbridge"``
(``WeightTransferConfig(backend="wbridge")``, driven by ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``): see ``transfer``.

How a pull reaches the kernels
------------------------------
vLLM post-processes weights after loading (on CPU it repacks linear weights for its GEMM kernels
and drops the original parameter; on GPU it derives FP8 scales and kernel layouts), so writing
into ``param.data`` after start-up changes nothing the kernels read for those layers. wbridge
therefore pulls into a *checkpoint-format* copy of each rank's parameters (fused ``qkv_proj``,
``gate_up_proj``, stacked experts, TP-sliced, as ``load_weights`` leaves them before processing),
and then, per parameter (``commit``): copies it into the live parameter where vLLM's
processing is the identity (one fused copy from a flat staging buffer on the parameter's device);
rebuilds the kernel of an unquantised linear layer from staging on the pull's thread and swaps it
in at commit; and replays vLLM's own reload lifecycle (``initialize_layerwise_reload`` -> load ->
``finalize_layerwise_reload``) for the remaining layers, so vLLM re-runs its processing exactly as
at start-up. With a background pull (``wbridge_pull_start`` / ``update_info["background"]``) the
engine keeps generating on its old weights until the commit, which is the only pause.

The destination layout is traced from the engine's own ``load_weights`` (``wbridge.integrations.trace``), run on
the checkpoint-format parameters that the reload machinery restores, and cached as JSON keyed by
the model config, the vLLM version and the rank.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from ...errors import LayoutError, UsageError, WaitTimeout, WBridgeError
from ..trace import TraceResult, trace_load_weights, traced
from .commit import Reload, allocate_staging, commit, plan_commit, prepare
from .lora import LoRAWorkerMixin
from .watch import Watcher

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "wbridge", "traces")


def hf_checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Canonical (checkpoint) names and shapes for a Hugging Face config, from transformers'
    model class built on the meta device (no memory)."""
    from ..transformers import config_shapes

    return config_shapes(hf_config)


def _portable(t: Any) -> tuple[str, list[int], bytes]:
    import torch

    t = t.detach().cpu().contiguous()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def portable_to_tensor(x: tuple[str, list[int], bytes]) -> Any:
    """Inverse of the ``(dtype, shape, raw bytes)`` form the inspection RPCs return."""
    import torch

    dtype, shape, raw = x
    if not raw:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf.view(getattr(torch, dtype)).reshape(shape)


_BG_LOCK = threading.Lock()  # guards the background-pull slot: the watcher and RPCs both take it


class _Background:
    """One pull on a worker thread: the version it pulls at least, its result ``(version, pull
    seconds, prepare seconds)`` or its error."""

    def __init__(self, min_version: int | None = None) -> None:
        self.min_version = min_version
        self.thread: Any = None
        self.result: tuple[int, float, float] | None = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def run(self, fetch: Any, timeout: float, min_version: int | None) -> None:
        try:
            self.result = fetch(timeout, min_version)
        except BaseException as e:  # noqa: BLE001 - handed to wbridge_commit
            self.error = e


class WBridgeWorkerExtension(LoRAWorkerMixin):
    """Mixed into vLLM's worker (``worker_extension_cls``); methods are called through
    ``LLM.collective_rpc`` on every rank. Its LoRA adapter channels' RPCs (``wbridge_lora_*``)
    come from ``lora.LoRAWorkerMixin``.

    ``wbridge_subscribe(channel, store, token=None, transport="auto")`` traces the layout, allocates
    the checkpoint-format destination tensors and joins the channel. ``wbridge_pull(timeout)``
    pulls the newest version into them and reloads the engine's weights; returns the version.
    """

    # -- helpers (names prefixed: the worker class has its own attributes) ------------------------
    def _wbridge_model(self) -> Any:
        runner = getattr(self, "model_runner", None)
        if runner is None:
            raise UsageError("wbridge: this vLLM worker has no model_runner")
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _wbridge_model_config(self) -> Any:
        cfg = getattr(self, "vllm_config", None) or self.model_runner.vllm_config
        return cfg.model_config

    def _wbridge_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def wbridge_trace(
        self, canonical: Mapping[str, Any] | None = None, cache_dir: str | None = DEFAULT_CACHE
    ) -> TraceResult:
        """The rank's checkpoint-format layout, traced from the engine's own ``load_weights``."""
        import vllm

        model, mc = self._wbridge_model(), self._wbridge_model_config()
        shapes = canonical or hf_checkpoint_shapes(mc.hf_config)
        parallel = getattr(self, "parallel_config", None) or self.model_runner.vllm_config.parallel_config

        def run() -> TraceResult:
            with Reload(model, mc, loads=False) as rl:
                rl.unwrapped()
                return trace_load_weights(model, model.load_weights, shapes)

        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        ep = getattr(parallel, "enable_expert_parallel", False)
        return traced(cache_dir, run, mc, "vllm", vllm.__version__, self._wbridge_rank(), shapes, tp=tp, pp=pp, ep=ep)

    def wbridge_subscribe(
        self,
        channel: str,
        store: str,
        token: str | None = None,
        transport: str = "auto",
        cache_dir: str | None = DEFAULT_CACHE,
        **subscriber_kwargs: Any,
    ) -> int:
        """Traces the layout, allocates destination tensors and joins ``channel``; returns the
        number of destination tensors."""

        from ...subscriber import Subscriber

        if getattr(self, "_wbridge_sub", None) is not None:
            self.wbridge_close()
        trace = self.wbridge_trace(cache_dir=cache_dir)
        shapes = self._wbridge_checkpoint_shapes(trace)
        plan = plan_commit(self._wbridge_model(), shapes)  # on the live, processed model
        staging = allocate_staging(self._wbridge_model(), plan, shapes, self._wbridge_model_config().dtype)
        entries = trace.bind(staging)
        sub = Subscriber(
            channel,
            store,
            token=token,
            transport=transport,
            **{"name": f"vllm-rank{self._wbridge_rank()}-{os.getpid()}", **subscriber_kwargs},
        )
        try:
            sub.register(entries)
            # a wrong token fails here, not at the first update: the committed version's record
            # (once there is one) is sealed with the channel's token
            sub.latest()
        except BaseException:
            sub.close()
            raise
        self._wbridge_sub, self._wbridge_staging, self._wbridge_stats = sub, staging, []
        self._wbridge_plan, self._wbridge_prepared = plan, None
        self._wbridge_version = None
        return len(entries)

    def _wbridge_checkpoint_shapes(self, trace: TraceResult) -> dict[str, tuple[int, ...]]:
        model, mc = self._wbridge_model(), self._wbridge_model_config()
        with Reload(model, mc, loads=False) as rl:
            rl.unwrapped()
            params = dict(model.named_parameters())
            missing = [n for n in trace.entries if n not in params]
            if missing:
                raise LayoutError(f"traced parameters not in the model (stale trace cache?): {missing[:3]}")
            return {n: tuple(params[n].shape) for n in trace.entries}

    def wbridge_pull(self, timeout: float = 60.0, min_version: int | None = None) -> int:
        """Pulls the newest version (at least ``min_version``) and reloads it into the engine;
        returns the version."""
        fetched = self._wbridge_fetch(timeout, min_version)
        self._wbridge_commit(*fetched)
        return fetched[0]

    def wbridge_pull_start(self, timeout: float = 60.0, min_version: int | None = None) -> None:
        """Starts pulling the newest version (at least ``min_version``) into staging on a worker
        thread and returns at once: the engine keeps generating on its current weights. Then
        ``wbridge_commit()`` (the only pause) waits for the pull and commits it into the kernels.
        The thread also builds the repacked layers' new kernels (``commit.prepare``)."""
        import threading

        holder = self._wbridge_holder()
        with _BG_LOCK:
            if getattr(holder, "_wbridge_bg", None) is not None:
                raise UsageError("wbridge: a background pull is already running; commit it first")
            bg = _Background(min_version)
            bg.thread = threading.Thread(target=bg.run, args=(holder._wbridge_fetch, timeout, min_version), daemon=True)
            bg.thread.start()  # before others see it: an unstarted thread is not alive either
            holder._wbridge_bg = bg

    def wbridge_pull_done(self) -> bool:
        """Whether the background pull has finished (successfully or not)."""
        bg = getattr(self._wbridge_holder(), "_wbridge_bg", None)
        return bg is None or not bg.thread.is_alive()

    def wbridge_commit(self, timeout: float = 60.0) -> int:
        """Waits (at most ``timeout``) for the background pull, then commits it into the engine;
        returns the version. A failed pull raises its error and leaves the kernels alone."""
        holder = self._wbridge_holder()
        bg = getattr(holder, "_wbridge_bg", None)
        if bg is None:
            raise UsageError("wbridge: wbridge_commit without wbridge_pull_start")
        bg.thread.join(timeout)
        if bg.thread.is_alive():
            raise WaitTimeout(f"wbridge: the background pull did not finish within {timeout:.1f}s")
        try:
            if bg.error is not None:
                raise bg.error
            holder._wbridge_commit(*bg.result)
        finally:
            with _BG_LOCK:
                holder._wbridge_bg = None
            holder._wbridge_poke()
        return bg.result[0]

    def wbridge_watch(self, timeout: float = 60.0) -> None:
        """Starts (once) a thread that watches the channel and starts the background pull
        (``wbridge_pull_start``) as soon as a version newer than the kernels' is committed, so the
        next ``wbridge_commit`` finds it staged; ``timeout`` bounds each pull. After a pull it
        waits for that pull's commit (or ``wbridge_discard``). ``wbridge_close`` stops it."""
        holder = self._wbridge_holder()
        sub = getattr(holder, "_wbridge_sub", None)
        if sub is None:
            raise UsageError("wbridge: wbridge_watch before subscribe")
        watcher = getattr(holder, "_wbridge_watcher", None)
        if watcher is not None and watcher.alive:
            return
        holder._wbridge_skip = 0
        holder._wbridge_watcher = Watcher(
            sub.wait_version,
            holder._wbridge_floor,
            lambda v: holder.wbridge_pull_start(timeout, min_version=v),
            give_up_s=timeout,
        )

    def _wbridge_floor(self) -> int | None:
        """For the watcher: the version it pulls only above, or None while a pull is in flight
        or staged."""
        if getattr(self, "_wbridge_bg", None) is not None:
            return None
        return max(getattr(self, "_wbridge_version", None) or 0, getattr(self, "_wbridge_skip", 0))

    def _wbridge_poke(self) -> None:
        watcher = getattr(self, "_wbridge_watcher", None)
        if watcher is not None:
            watcher.poke()

    def wbridge_staged(self) -> dict[str, Any]:
        """The background pull, as ``{"state", "version", "error", "retry", "held"}``: ``state``
        is ``"idle"`` (none), ``"pulling"`` (``version``: at least this one), ``"ready"`` (staged:
        ``wbridge_commit`` puts ``version`` into the kernels at once) or ``"failed"`` (``error``
        says what; ``retry``: the watcher pulls again once the failed pull is discarded, False
        when the watcher itself stopped); ``held``: the kernels' version."""
        holder = self._wbridge_holder()
        bg = getattr(holder, "_wbridge_bg", None)
        out: dict[str, Any] = {
            "state": "idle", "version": None, "error": None, "retry": True, "held": holder.wbridge_version()
        }  # fmt: skip
        watcher = getattr(holder, "_wbridge_watcher", None)
        if bg is None:
            if watcher is not None and watcher.error is not None:
                e = watcher.error
                out.update(state="failed", retry=False, error=f"the channel watcher stopped: {type(e).__name__}: {e}")
        elif not bg.done:
            out.update(state="pulling", version=bg.min_version)
        elif bg.error is not None:
            e = bg.error
            out.update(state="failed", version=bg.min_version, error=f"the pull failed: {type(e).__name__}: {e}")
        else:
            out.update(state="ready", version=bg.result[0])
        return out

    def wbridge_discard(self, min_version: int | None = None) -> None:
        """Drops a finished background pull without committing it (the kernels stay as they are);
        the watcher then pulls again: at least ``min_version`` when given, else the newest. A pull
        still running (one the watcher started since the caller looked) is left to finish."""
        holder = self._wbridge_holder()
        with _BG_LOCK:
            bg = getattr(holder, "_wbridge_bg", None)
            if bg is not None and bg.done:
                holder._wbridge_bg, holder._wbridge_prepared = None, None
            if min_version is not None:
                holder._wbridge_skip = min_version - 1
        holder._wbridge_poke()

    # The two halves of a pull, apart so that the weight-transfer backend (``transfer``) can
    # fetch in ``update_weights`` and commit in ``finish_weight_update``.
    def _wbridge_fetch(self, timeout: float, min_version: int | None = None) -> tuple[int, float, float]:
        """Pulls into the checkpoint-format staging tensors and builds the repacked layers' new
        kernels from them (the live kernels are untouched); returns ``(version, pull seconds,
        prepare seconds)``."""
        sub = getattr(self, "_wbridge_sub", None)
        if sub is None:
            raise UsageError("wbridge: pull before subscribe (wbridge_subscribe / init_weight_transfer_engine)")
        self._wbridge_prepared = None  # staging is about to change: kernels built from it are stale
        t0 = time.perf_counter()
        v = sub.pull(min_version=min_version, timeout=timeout)
        t1 = time.perf_counter()
        self._wbridge_pulled = sub.stats.last  # its bytes and delta-or-not, for wbridge_stats
        self._wbridge_prepared = prepare(self._wbridge_model(), self._wbridge_plan, self._wbridge_staging)
        return v, t1 - t0, time.perf_counter() - t1

    def _wbridge_commit(self, version: int, pull_s: float, prepare_s: float) -> None:
        """Puts the staged version into the kernels (``commit.commit``): the only pause."""
        t1 = time.perf_counter()
        prepared, self._wbridge_prepared = self._wbridge_prepared, None
        if prepared is None:
            raise UsageError("wbridge: commit without a completed pull")
        self._wbridge_version = None  # a failed commit leaves the kernels on no known version
        commit(self._wbridge_model(), self._wbridge_model_config(), self._wbridge_plan, self._wbridge_staging, prepared)
        self._wbridge_version = version
        pulled = getattr(self, "_wbridge_pulled", None)
        self._wbridge_stats.append(
            {
                "version": version,
                "nbytes": 0 if pulled is None else pulled.nbytes,
                "delta": False if pulled is None else pulled.delta,
                "delta_reason": "" if pulled is None else getattr(pulled, "delta_reason", ""),
                "repaired": 0 if pulled is None else pulled.repaired,
                "pull_s": pull_s,
                "prepare_s": prepare_s,
                "commit_s": time.perf_counter() - t1,
            }
        )

    def wbridge_commit_plan(self) -> dict[str, list[str]]:
        """How each staged parameter reaches the kernels: ``{"direct": [parameter names],
        "repack": [module names], "reload": [module names]}`` (see ``commit``)."""
        plan = getattr(self._wbridge_holder(), "_wbridge_plan", None)
        if plan is None:
            raise UsageError("wbridge: wbridge_commit_plan before subscribe")
        return plan.as_dict()

    def _wbridge_holder(self) -> Any:
        """Who holds the subscription: this worker, or (when the engine was started with
        ``WeightTransferConfig(backend="wbridge")`` and the extension only inspects) its
        weight-transfer engine."""
        if getattr(self, "_wbridge_sub", None) is None:
            engine = getattr(self, "weight_transfer_engine", None)
            if isinstance(engine, WBridgeWorkerExtension):
                return engine
        return self

    def wbridge_version(self) -> int | None:
        """The wbridge version the engine's kernels hold (None before the first update)."""
        return getattr(self._wbridge_holder(), "_wbridge_version", None)

    def wbridge_stats(self) -> list[dict]:
        """One dict per committed update of this rank: ``version``, ``nbytes`` read, ``delta``
        (whether the pull applied deltas) and ``delta_reason`` (why or why not, where the
        subscriber says), ``repaired`` chunks, ``pull_s``, ``prepare_s`` (kernels rebuilt in the
        background) and ``commit_s`` (the pause)."""
        return list(getattr(self._wbridge_holder(), "_wbridge_stats", []))

    def wbridge_staging(self) -> dict[str, tuple[str, list[int], bytes]]:
        """The checkpoint-format tensors of the last pull, as ``(dtype, shape, raw bytes)`` (RPC-safe;
        ``portable_to_tensor`` rebuilds them)."""
        return {k: _portable(v) for k, v in getattr(self._wbridge_holder(), "_wbridge_staging", {}).items()}

    def wbridge_digests(self) -> dict[str, str]:
        """SHA-256 of each checkpoint-format tensor of the last pull (JSON-safe: for vLLM's
        ``/collective_rpc`` route, which passes on only strings, lists and dicts)."""
        import hashlib

        return {
            k: hashlib.sha256(_portable(v)[2]).hexdigest()
            for k, v in getattr(self._wbridge_holder(), "_wbridge_staging", {}).items()
        }

    def wbridge_parameters(self) -> dict[str, tuple[str, list[int], bytes]]:
        """The engine's live parameters and buffers as its kernels see them, as
        ``(dtype, shape, raw bytes)``."""
        model = self._wbridge_model()
        out = {k: _portable(v) for k, v in model.named_parameters()}
        out.update({f"buffer:{k}": _portable(v) for k, v in model.named_buffers()})
        return out

    def wbridge_close(self) -> None:
        """Stops the watcher and leaves the channel (idempotent); the kernels keep their weights."""
        watcher = getattr(self, "_wbridge_watcher", None)
        self._wbridge_watcher = None
        if watcher is not None:
            watcher.close()
        sub = getattr(self, "_wbridge_sub", None)
        self._wbridge_sub = None
        if sub is not None:
            try:
                sub.close()
            except WBridgeError as e:  # the publisher (and its store) may be gone already
                import logging

                logging.getLogger(__name__).warning("wbridge: closing the subscriber: %s", e)
