"""vLLM rollout workers as wbridge subscribers.

Usage::

    llm = LLM(model=path, worker_extension_cls="wbridge.integrations.vllm.WBridgeWorkerExtension")
    llm.collective_rpc("wbridge_subscribe", args=("policy", "tcp://trainer:29700"), kwargs={"token": "..."})
    v = llm.collective_rpc("wbridge_pull", kwargs={"timeout": 60.0})[0]   # after each trainer publish
    llm.reset_prefix_cache()      # cached KV blocks were computed with the old weights

The same machinery is offered as vLLM's weight-transfer backend ``"wbridge"``
(``WeightTransferConfig(backend="wbridge")``, driven by ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``): see ``vllm_transfer``.

How a pull reaches the kernels
------------------------------
vLLM post-processes weights after loading (on CPU it repacks linear weights for its GEMM kernels
and drops the original parameter; on GPU it derives FP8 scales and kernel layouts), so writing
into ``param.data`` after start-up changes nothing the kernels read. wbridge therefore keeps a
*checkpoint-format* copy of each rank's parameters (fused ``qkv_proj``, ``gate_up_proj``, stacked
experts, TP-sliced, as ``load_weights`` leaves them before processing) as the subscriber's
destination, and after each pull replays vLLM's own reload lifecycle
(``initialize_layerwise_reload`` -> load -> ``finalize_layerwise_reload``) with a loader that copies
those tensors in, so vLLM re-runs its processing exactly as at start-up.

The destination layout is traced from the engine's own ``load_weights`` (``wbridge.integrations.trace``), run on
the checkpoint-format parameters that the reload machinery restores, and cached as JSON keyed by
the model config, the vLLM version and the rank.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from ..errors import LayoutError, UsageError, WaitTimeout, WBridgeError
from .trace import TraceResult, cache_key, cached_trace, trace_load_weights

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "wbridge", "traces")


def hf_checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Canonical (checkpoint) names and shapes for a Hugging Face config, from transformers'
    model class built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from .transformers import checkpoint_shapes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return checkpoint_shapes(model)


def _copy_loader(param: Any, loaded_weight: Any) -> None:
    """A weight loader for tensors already in the parameter's (checkpoint) format."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise LayoutError(f"reload: shape {tuple(loaded_weight.shape)} for a parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


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


class _Background:
    """One pull on a worker thread: its result ``(version, seconds)`` or its error."""

    def __init__(self) -> None:
        self.thread: Any = None
        self.result: tuple[int, float] | None = None
        self.error: BaseException | None = None

    def run(self, fetch: Any, timeout: float, min_version: int | None) -> None:
        try:
            self.result = fetch(timeout, min_version)
        except BaseException as e:  # noqa: BLE001 - handed to wbridge_commit
            self.error = e


class _NothingLoaded(logging.Filter):
    """Drops vLLM's "Failed to load weights" warning: a reload that only traces or reads shapes
    loads nothing on purpose, and vLLM then puts every layer's kernel tensors back (as it says)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _Reload:
    """vLLM's layerwise reload of ``model``; inside it every layer holds its checkpoint-format
    parameters (restored on the meta device) and processing runs when a layer is complete.
    ``loads=False``: the block loads nothing (tracing, reading shapes), so vLLM's warning that a
    layer loaded nothing is expected and silenced."""

    def __init__(self, model: Any, model_config: Any, *, loads: bool = True) -> None:
        self.model, self.model_config, self.loads = model, model_config, loads

    def __enter__(self) -> _Reload:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        return self

    def unwrapped(self) -> None:
        """Puts the original weight loaders back (for tracing, which must not trigger processing)."""
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader

        for p in self.model.parameters():
            if hasattr(p, "weight_loader"):
                p.weight_loader = _get_original_loader(p)

    def copy_loaders(self) -> None:
        """Makes every parameter load a checkpoint-format tensor by plain copy, still deferred
        through vLLM's layerwise wrappers (so processing runs once a layer is complete)."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            _get_original_loader,
            _wrap_parameters_weight_loader,
        )
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        for layer in self.model.modules():
            tensors = get_layer_tensors(layer)
            for name, t in tensors.items():
                if name in SKIP_LOAD_TENSORS:
                    continue
                _get_original_loader(t)  # raises early on an odd loader chain
                t.weight_loader = _copy_loader
            _wrap_parameters_weight_loader(layer)

    def __exit__(self, *exc: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.loads:
            finalize_layerwise_reload(self.model, self.model_config)
            return
        quiet, logger = _NothingLoaded(), logging.getLogger(_LAYERWISE_LOGGER)
        logger.addFilter(quiet)
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            logger.removeFilter(quiet)


def _repack_cpu_moe(model: Any) -> None:
    """Works around vLLM 0.32 on CPU: a weight update of an unquantized fused-MoE layer copies the
    new weights in kernel *input* format but skips the CPU grouped-GEMM prepack
    (``fused_experts.process_weights_after_loading`` runs only on the first load), so the kernel
    would read unpacked weights. Re-run that prepack, as start-up does."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for mod in model.modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(mod, "w13_weight") and "CPU" in type(experts).__name__:
            experts.process_weights_after_loading(mod)


class WBridgeWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); methods are called through
    ``LLM.collective_rpc`` on every rank.

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
            with _Reload(model, mc, loads=False) as rl:
                rl.unwrapped()
                return trace_load_weights(model, model.load_weights, shapes)

        if cache_dir is None:
            return run()
        key = cache_key(
            mc.hf_config.to_dict(),
            "vllm",
            vllm.__version__,
            self._wbridge_rank(),
            tp=parallel.tensor_parallel_size,
            pp=parallel.pipeline_parallel_size,
            ep=getattr(parallel, "enable_expert_parallel", False),
            dtype=str(mc.dtype),
            quantization=mc.quantization,
            canonical=sorted(shapes.items()),
        )
        return cached_trace(cache_dir, key, run)

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
        import torch

        from ..subscriber import Subscriber

        if getattr(self, "_wbridge_sub", None) is not None:
            self._wbridge_sub.close()
        trace = self.wbridge_trace(cache_dir=cache_dir)
        dtype = self._wbridge_model_config().dtype
        shapes = self._wbridge_checkpoint_shapes(trace)
        staging = {n: torch.zeros(shapes[n], dtype=dtype) for n in trace.entries}
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
        self._wbridge_version = None
        return len(entries)

    def _wbridge_checkpoint_shapes(self, trace: TraceResult) -> dict[str, tuple[int, ...]]:
        model, mc = self._wbridge_model(), self._wbridge_model_config()
        with _Reload(model, mc, loads=False) as rl:
            rl.unwrapped()
            params = dict(model.named_parameters())
            missing = [n for n in trace.entries if n not in params]
            if missing:
                raise LayoutError(f"traced parameters not in the model (stale trace cache?): {missing[:3]}")
            return {n: tuple(params[n].shape) for n in trace.entries}

    def wbridge_pull(self, timeout: float = 60.0, min_version: int | None = None) -> int:
        """Pulls the newest version (at least ``min_version``) and reloads it into the engine;
        returns the version."""
        v, pull_s = self._wbridge_fetch(timeout, min_version)
        self._wbridge_commit(v, pull_s)
        return v

    def wbridge_pull_start(self, timeout: float = 60.0, min_version: int | None = None) -> None:
        """Starts pulling the newest version (at least ``min_version``) into staging on a worker
        thread and returns at once: the engine keeps generating on its current weights. Then
        ``wbridge_commit()`` (the only pause) waits for the pull and reloads the kernels."""
        import threading

        holder = self._wbridge_holder()
        if getattr(holder, "_wbridge_bg", None) is not None:
            raise UsageError("wbridge: a background pull is already running; commit it first")
        bg = _Background()
        bg.thread = threading.Thread(target=bg.run, args=(holder._wbridge_fetch, timeout, min_version), daemon=True)
        holder._wbridge_bg = bg
        bg.thread.start()

    def wbridge_pull_done(self) -> bool:
        """Whether the background pull has finished (successfully or not)."""
        bg = getattr(self._wbridge_holder(), "_wbridge_bg", None)
        return bg is None or not bg.thread.is_alive()

    def wbridge_commit(self, timeout: float = 60.0) -> int:
        """Waits (at most ``timeout``) for the background pull, then reloads it into the engine;
        returns the version. A failed pull raises its error and leaves the kernels alone."""
        holder = self._wbridge_holder()
        bg = getattr(holder, "_wbridge_bg", None)
        if bg is None:
            raise UsageError("wbridge: wbridge_commit without wbridge_pull_start")
        bg.thread.join(timeout)
        if bg.thread.is_alive():
            raise WaitTimeout(f"wbridge: the background pull did not finish within {timeout:.1f}s")
        holder._wbridge_bg = None
        if bg.error is not None:
            raise bg.error
        holder._wbridge_commit(*bg.result)
        return bg.result[0]

    # The two halves of a pull, apart so that the weight-transfer backend (``vllm_transfer``) can
    # fetch in ``update_weights`` and reload in ``finish_weight_update``.
    def _wbridge_fetch(self, timeout: float, min_version: int | None = None) -> tuple[int, float]:
        """Pulls into the checkpoint-format staging tensors (the kernels are untouched);
        returns ``(version, seconds)``."""
        sub = getattr(self, "_wbridge_sub", None)
        if sub is None:
            raise UsageError("wbridge: pull before subscribe (wbridge_subscribe / init_weight_transfer_engine)")
        t0 = time.perf_counter()
        v = sub.pull(min_version=min_version, timeout=timeout)
        return v, time.perf_counter() - t0

    def _wbridge_commit(self, version: int, pull_s: float) -> None:
        """Reloads the staging tensors into the engine through vLLM's reload lifecycle."""
        t1 = time.perf_counter()
        self._wbridge_version = None  # a failed reload leaves the kernels on no known version
        self._wbridge_apply()
        self._wbridge_version = version
        self._wbridge_stats.append({"version": version, "pull_s": pull_s, "reload_s": time.perf_counter() - t1})

    def _wbridge_apply(self) -> None:
        import torch

        model, mc = self._wbridge_model(), self._wbridge_model_config()
        with torch.no_grad(), _Reload(model, mc) as rl:
            rl.copy_loaders()
            params = dict(model.named_parameters())
            for name, t in self._wbridge_staging.items():
                p = params[name]
                p.weight_loader(p, t)
        _repack_cpu_moe(model)

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
        sub = getattr(self, "_wbridge_sub", None)
        self._wbridge_sub = None
        if sub is not None:
            try:
                sub.close()
            except WBridgeError as e:  # the publisher (and its store) may be gone already
                import logging

                logging.getLogger(__name__).warning("wbridge: closing the subscriber: %s", e)
